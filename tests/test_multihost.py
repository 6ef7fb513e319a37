"""Multi-host for real: several local processes joined by JAX's distributed runtime (gloo
collectives on CPU) into one mesh, started by the launcher as a user would start them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, subprocess_env, TINY_GPT, overrides

STEPS = ["train.steps=6", "run.log_every=1"]


def launch(*args, timeout=300) -> subprocess.CompletedProcess:
    env = subprocess_env()
    return subprocess.run([sys.executable, "-m", "shard.launch", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> np.ndarray:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return np.array([r["loss"] for r in records if "loss" in r and "eval_loss" not in r])


def train_processes(run_dir, processes, *extra):
    devices = 8 // processes
    done = launch("local", f"--processes={processes}", "--", *overrides(run_dir, *TINY_GPT, *extra),
                  f"run.cpu_devices={devices}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


# hybrid: data across the 2 processes (mesh.dcn_data), tensor inside each; fsdp's parameters split across processes
# are covered by the checkpoint moves below, a replica per process by tests/test_sync.py
@pytest.mark.parametrize("preset", ["hybrid"])
def test_processes_x_devices_give_the_loss_curve_of_one_process(train, tmp_path, preset):
    # A sample and an eval at the end: every process must take part in both (the arrays are split
    # across them), or the run hangs at its end.
    one = train(*TINY_GPT, *STEPS, f"mesh={preset}", "train.sample_len=8")
    expected = np.array([r["loss"] for r in one.history])
    # 2 processes (4 write and restore checkpoints below): hybrid's multi-node layout (data across the 2
    # processes) is the case it adds
    for processes in (2,):
        extra = ["train.sample_len=8", "run.progress=true", "run.tensorboard=true", "run.plot=true"]
        if preset == "hybrid" and processes == 2:
            # a multi-node layout: the data axis (4) crosses the 2 processes, tensor stays inside each
            extra += ["mesh.dcn_data=2"]
        out = train_processes(tmp_path / str(processes), processes, *STEPS, f"mesh={preset}", *extra)
        np.testing.assert_allclose(losses(tmp_path / str(processes)), expected, rtol=1e-5)
        # only process 0 speaks (each line is prefixed with its process index)
        assert "[0] model gpt" in out.stdout and "[1] model" not in out.stdout
        assert f"{one.mesh.shape['data']} x expert=1" in out.stdout and "on 8 cpu device(s)" in out.stdout
        assert f"[0] def {one.sample}" in out.stdout and out.stdout.count("sample:") == 1
        assert '"eval_loss"' in (tmp_path / str(processes) / "metrics.jsonl").read_text()
        # process 0 alone writes TensorBoard's events, draws the curves and shows progress (as lines: piped)
        assert len(list((tmp_path / str(processes) / "tensorboard").iterdir())) == 1
        assert (tmp_path / str(processes) / "curves.png").exists()
        assert f"[0] [{STEPS[0].split('=')[1]}/" in out.stdout and "[1] [" not in out.stdout


def test_pipeline_stages_across_processes_give_the_loss_curve_of_one_process(train, tmp_path):
    """stage=2 over 2 processes (the slow link between stages, as pipelines are meant to run): the batch's rows
    are split over the stages too, so each process reads only its stage's half of every batch."""
    expected = np.array([r["loss"] for r in train(*TINY_GPT, *STEPS).history])
    train_processes(tmp_path / "staged", 2, *STEPS, "mesh=pp", "mesh.stage=2", "mesh.data=4")
    np.testing.assert_allclose(losses(tmp_path / "staged"), expected, rtol=1e-5)


def test_checkpoints_move_between_process_layouts(train, tmp_path):
    """4 processes write, 1 restores; 1 writes, 2 restore: both continue the uninterrupted curve."""
    save = ["checkpoint.enabled=true", "checkpoint.async=false", "mesh=fsdp", "run.log_every=1"]
    expected = np.array([r["loss"] for r in train(*TINY_GPT, *STEPS, "mesh=fsdp", subdir="whole").history])

    train_processes(tmp_path / "four", 4, *save, "train.steps=3")
    one = train(*TINY_GPT, *save, *STEPS, f"checkpoint.restore_from={tmp_path / 'four'}", subdir="four_then_one")
    assert one.start_step == 3
    np.testing.assert_allclose([r["loss"] for r in one.history], expected[3:], rtol=1e-5)

    train(*TINY_GPT, *save, "train.steps=3", subdir="one")
    train_processes(tmp_path / "one_then_two", 2, *save, *STEPS, f"checkpoint.restore_from={tmp_path / 'one'}")
    np.testing.assert_allclose(losses(tmp_path / "one_then_two"), expected[3:], rtol=1e-5)


# ----------------------------------------------------------------------------- failures

def child_pids(parent: int) -> dict[int, str]:
    """pid -> command line of each child of `parent` (from /proc)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            pass
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_killing_one_process_stops_the_launch_and_leaves_nothing_behind(tmp_path):
    env = subprocess_env()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shard.launch", "local", "--processes=2", "--",
         *overrides(tmp_path, *TINY_GPT, "train.steps=100000", "run.log_every=1"), "run.cpu_devices=4"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # both are training
        assert launcher.poll() is None, launcher.communicate()
        assert time.time() < deadline, "training did not start"
        time.sleep(0.2)
    children = child_pids(launcher.pid)
    assert len(children) == 2, children
    victim = next(pid for pid, cmd in children.items() if "run.process_id=1" in cmd)
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    out, err = launcher.communicate(timeout=60)
    assert time.time() - killed < 60
    assert launcher.returncode != 0
    assert "process 1 was killed by SIGKILL" in err, err
    assert not any(alive(pid) for pid in children)


def start_process(tmp_path, port, index, *extra) -> subprocess.Popen:
    env = subprocess_env()
    args = [*overrides(tmp_path, *TINY_GPT, "train.steps=2"), "run.cpu_devices=4",
            f"run.coordinator=127.0.0.1:{port}", "run.num_processes=2", f"run.process_id={index}", *extra]
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_processes_with_different_configs_refuse_to_start(tmp_path):
    from shard.run.launch import free_port

    port = free_port()
    procs = [start_process(tmp_path, port, i, f"train.seed={i}") for i in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 2, err
        assert "resolved config differs between processes" in err and "Traceback" not in err
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing written


def test_a_peer_that_never_arrives_is_a_clear_error_in_bounded_time(tmp_path):
    from shard.run.launch import free_port

    started = time.time()
    p = start_process(tmp_path, free_port(), 0, "run.init_timeout_s=3")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and time.time() - started < 60
    assert "not every process joined within run.init_timeout_s=3" in err


@pytest.mark.parametrize("args,message", [
    (["run.coordinator=10.0.0.2", "run.num_processes=2", "run.process_id=0"], "give host:port"),
    (["run.coordinator=10.0.0.2:1234"], "go together"),
    (["run.coordinator=10.0.0.2:1234", "run.num_processes=2", "run.process_id=2"], "between 0 and"),
])
def test_bad_distributed_settings_are_one_line(args, message):
    from conftest import run_cli

    done = run_cli("train.steps=1", *args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- launch commands

def test_tpu_dry_run_copies_the_code_and_runs_on_every_worker():
    from shard.run.launch import CODE_TARBALL

    done = launch("tpu", "--name=pod", "--zone=us-east5-a", "--project=proj", "--dry-run", "--",
                  "configs/gpt_small.yaml", "mesh=fsdp")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"gcloud compute tpus tpu-vm scp {CODE_TARBALL} 'pod:~/' --worker=all --zone=us-east5-a --project=proj",
        "gcloud compute tpus tpu-vm ssh pod --worker=all --zone=us-east5-a --project=proj "
        "'--command=mkdir -p shard && tar -xzf shard-code.tar.gz -C shard && cd shard && "
        "pip install -q -e '\"'\"'.[tpu]'\"'\"' && python3 train.py configs/gpt_small.yaml mesh=fsdp "
        "run.distributed=on'",
    ]


def test_slurm_dry_run_writes_one_task_per_node_or_per_gpu():
    done = launch("slurm", "--nodes=4", "--gpus-per-node=8", "--partition=gpu", "--time=02:00:00", "--dry-run",
                  "--", "configs/gpt_small.yaml")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=02:00:00",
                 f"srun {sys.executable} train.py configs/gpt_small.yaml run.distributed=on",
                 "# then: sbatch shard.sbatch"):
        assert line in lines, done.stdout
    per_gpu = launch("slurm", "--nodes=2", "--gpus-per-node=8", "--per-gpu", "--dry-run", "--", "mesh=fsdp")
    assert "#SBATCH --ntasks-per-node=8" in per_gpu.stdout.splitlines()
    assert not (ROOT / "shard.sbatch").exists()  # a dry run writes nothing
    # Each node writes its own shards of a checkpoint: a node-local run.dir is a warning, a bucket is not.
    assert "warning: run.dir=runs/default is a local path" in per_gpu.stderr
    remote = launch("slurm", "--nodes=2", "--dry-run", "--", "run.dir=gs://bucket/run")
    assert remote.returncode == 0 and "warning" not in remote.stderr, remote.stderr


def test_gke_prints_the_xpk_command():
    done = launch("gke", "--cluster=c1", "--tpu-type=v5litepod-256", "--num-slices=2",
                  "--docker-image=gcr.io/p/shard:1", "--", "mesh=fsdp")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("xpk workload create --cluster=c1 --workload=shard-train --tpu-type=v5litepod-256 "
                                   "--num-slices=2 --docker-image=gcr.io/p/shard:1 "
                                   "'--command=python3 train.py mesh=fsdp run.distributed=on'")
    gpu = launch("gke", "--cluster=c1", "--device-type=h100-80gb-8", "--num-nodes=4", "--docker-image=img")
    assert "--device-type=h100-80gb-8 --num-nodes=4" in gpu.stdout


@pytest.mark.parametrize("args,message", [
    (["local"], "--processes"),
    (["local", "--processes=0"], "positive"),
    (["slurm", "--nodes=2", "--per-gpu"], "--per-gpu needs --gpus-per-node"),
    (["gke", "--cluster=c"], "exactly one of --tpu-type"),
    (["mars"], "invalid choice"),
])
def test_bad_launch_options_are_one_line_exit_2(args, message):
    done = launch(*args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_on_simulated_cpu_devices_a_program_ends_before_the_next_is_dispatched():
    # XLA:CPU can hang when two programs' collectives overlap on its shared thread pool (shard/run/distributed.py):
    # the trainer's, evaluation's and generation's loops pass each program's outputs through `finished`.
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from shard.run import distributed

    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(jnp.full((8, 192, 192), 0.01), NamedSharding(mesh, P("x")))

    @jax.jit
    def slow(x):  # long enough that without waiting it is still running when the call returns
        for _ in range(40):
            x = jnp.tanh(x @ x)
        return x + x.sum()  # the sum over the devices is a collective

    out = distributed.finished(slow(x))
    assert all(shard.data.is_ready() for shard in out.addressable_shards)


SLOW_MLP = ["model.name=stock_models:SlowMLP", "model.work=8", "data.name=synthetic", "data.features=[16]",
            "data.classes=8", "data.batch_size=8", "run.progress=false", "train.sample_len=0", "train.eval_batches=1",
            "run.tensorboard=false", "run.plot=false", "run.log_every=1", "optimizer.warmup_steps=2"]


def slow_processes(run_dir, port, *extra) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *SLOW_MLP, f"run.dir={run_dir}",
                              "run.cpu_devices=2", f"run.coordinator=127.0.0.1:{port}", "run.num_processes=2",
                              f"run.process_id={i}", *extra], cwd=ROOT / "tests", env=subprocess_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


def test_a_stop_that_reaches_one_process_stops_both_after_the_same_step_and_resumes_bitwise(tmp_path):
    """SIGTERM to one process only (the extreme of reaching hosts at different steps): both agree on the
    step, save it together, exit 0; the job then resumes to the loss of a run never stopped."""
    from shard.run.launch import free_port

    run, steps = tmp_path / "stopped", ["train.steps=30", "checkpoint.every=1000"]
    procs = slow_processes(run, free_port(), *steps)
    deadline = time.time() + 180
    while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3):
        assert all(p.poll() is None for p in procs) and time.time() < deadline, [p.communicate() for p in procs]
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    stopped = int(outs[0][0].split("stopped after step ")[1].split(";")[0])
    assert "SIGTERM on process 1" in outs[0][0] and stopped < 30, outs[0][0]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [stopped]
    for p in slow_processes(run, free_port(), *steps) + slow_processes(tmp_path / "whole", free_port(), *steps):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    resumed, whole = losses(run), losses(tmp_path / "whole")
    assert len(whole) == 30 and resumed[-1] == whole[-1]  # bitwise
