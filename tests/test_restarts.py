"""Runs that look after themselves, with real processes: the launcher restarts a job whose worker was
killed, and the restarted job ends where an uninterrupted one does, bitwise, each step logged once."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, subprocess_env, overrides
from test_multihost import child_pids

# A small model whose steps take a little host time (a callback sleeps), so a test can kill a process mid-run.
SLOW = ["model.name=stock_models:SlowMLP", "model.seconds=0.1", "data.name=synthetic", "data.features=[16]",
        "data.classes=8", "data.batch_size=8", "run.cpu_devices=1", "run.log_every=1"]
STEPS = 24
SAVE = ["checkpoint.enabled=true", "checkpoint.every=8", f"train.steps={STEPS}"]


def launcher(run_dir, *args, restarts=0, train_args=()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shard.launch", "local", "--processes=2",
                             f"--max-restarts={restarts}", *args, "--", *overrides(run_dir, *SLOW, *SAVE, *train_args)],
                            cwd=ROOT / "tests", env={**subprocess_env(), "PYTHONPATH": str(ROOT / "tests")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r]


def checkpoints(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 2-process run, and one whose process 1 is killed (SIGKILL) after step 10, past the
    checkpoint at step 8, under --max-restarts=1."""
    plain_dir, killed_dir = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("killed")
    plain = launcher(plain_dir)
    plain_out, plain_err = plain.communicate(timeout=600)
    assert plain.returncode == 0, plain_out[-3000:] + plain_err[-3000:]

    proc = launcher(killed_dir, restarts=1)
    deadline = time.time() + 300
    while not (8 in checkpoints(killed_dir) and any(r["step"] >= 11 for r in train_records(killed_dir))):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "training did not reach step 11"
        time.sleep(0.05)
    victim = next(pid for pid, cmd in child_pids(proc.pid).items() if "run.process_id=1" in cmd)
    os.kill(victim, signal.SIGKILL)
    killed_at = max(r["step"] for r in train_records(killed_dir))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return {"plain": plain_dir, "killed": killed_dir, "out": out, "err": err, "killed_at": killed_at}


def test_a_killed_worker_restarts_the_job_which_ends_bitwise_as_an_uninterrupted_one(runs):
    assert "process 1 was killed by SIGKILL" in runs["err"]
    assert runs["err"].count("launch: restarting every process") == 1
    assert "resuming from step 8" in runs["out"]
    plain, killed = train_records(runs["plain"]), train_records(runs["killed"])
    # every step once, in order: the steps between the checkpoint and the kill were trained again, logged once
    assert [r["step"] for r in killed] == list(range(1, STEPS + 1)) == [r["step"] for r in plain]
    assert [r["loss"] for r in killed] == [r["loss"] for r in plain]  # bitwise: JSON keeps every float's digits
    eval_plain = [r for r in records(runs["plain"]) if "eval_loss" in r]
    assert [r for r in records(runs["killed"]) if "eval_loss" in r] == eval_plain
    # what the first attempt logged past the checkpoint is kept aside, not lost
    discarded = [json.loads(line) for line in (runs["killed"] / "metrics.discarded.jsonl").read_text().splitlines()
                 if line.strip().endswith("}")]
    assert discarded and all(8 < r["step"] for r in discarded)


def nan_arrays(path: Path) -> Path:
    """Arrays whose every input is NaN: every attempt's first step stops the run (exit status 1)."""
    np.savez(path, inputs=np.full((64, 16), np.nan, np.float32), targets=np.arange(64, dtype=np.int32) % 8)
    return path


def test_a_job_that_keeps_failing_stops_after_its_restarts(tmp_path):
    data = nan_arrays(tmp_path / "nan.npz")
    proc = launcher(tmp_path / "run", restarts=2, train_args=["data.name=arrays", f"data.path={data}"])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    assert err.count("launch: restarting every process") == 2 and "no restarts left (--max-restarts=2)" in err


def test_negative_restarts_are_one_line():
    done = subprocess.run([sys.executable, "-m", "shard.launch", "local", "--processes=2", "--max-restarts=-1", "--",
                           "train.steps=1"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == ("error: --max-restarts=-1: give 0 (no restarts) or a "
                                                            "positive number")


def test_a_hung_step_dumps_every_stack_and_the_restarted_job_finishes(tmp_path):
    """Process 0 of 2 blocks inside its 6th step (process 1 then waits for it): within run.step_timeout_s each
    writes its threads' stacks and the last collective to the run folder and exits; the launcher restarts the
    job, which finishes."""
    run = tmp_path / "run"
    proc = launcher(run, restarts=1, train_args=["model.hang_after=6", f"model.hang_once={tmp_path / 'hung'}",
                                                  "run.step_timeout_s=10", "train.steps=12"])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert (tmp_path / "hung").exists() and err.count("launch: restarting every process") == 1
    dumps = sorted(run.glob("hang-process0-*.txt"))
    assert len(dumps) == 1, sorted(p.name for p in run.iterdir())
    text = dumps[0].read_text()
    assert text.startswith("process 0: no step finished within run.step_timeout_s=10 s (after step")
    assert "last collective entered: the stop agreement after step" in text
    assert "_maybe_hang" in text and "stock_models.py" in text  # the hung thread's stack
    assert f"every thread's stack: {dumps[0]}" in out + err and "exiting (status 3)" in out + err
    assert [r["step"] for r in train_records(run)] == list(range(1, 13))


def test_goodput_accounts_for_the_restart(runs):
    """The run folder says where the wall time went: the killed run lost time between the kill and the restart
    and trained again the steps past its checkpoint; the uninterrupted one did neither."""
    from shard.observe import goodput

    plain = goodput.account(goodput.read(runs["plain"]))
    killed = goodput.account(goodput.read(runs["killed"]))
    assert plain["attempts"] == 1 and plain["lost"] == 0 and plain["retrained_steps"] == 0 and plain["steps"] > 0
    assert killed["attempts"] == 2 and killed["lost"] > 0 and killed["retrained"] > 0
    logged_before = max(json.loads(line)["step"] for line in
                        (runs["killed"] / "metrics.discarded.jsonl").read_text().splitlines() if line.endswith("}"))
    # every step past the checkpoint (8) the first attempt reached is trained again (the last one logged, or
    # the one it had dispatched when it was killed)
    assert killed["retrained_steps"] in (logged_before - 8, logged_before - 8 + 1)
    for totals in (plain, killed):  # the kinds add up to the wall time
        assert abs(sum(totals[k] for k in goodput.KINDS) - totals["wall"]) < 1e-6 * totals["wall"] + 1e-3
    assert runs["out"].count("goodput ") == 1 and "1 restart(s)" in runs["out"]
    done = subprocess.run([sys.executable, "-m", "shard.goodput", str(runs["killed"])], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "retrained" in done.stdout and "lost" in done.stdout and "attempts 2" in done.stdout
    assert (runs["killed"] / "goodput.png").read_bytes()[:4] == b"\x89PNG"
    nothing = subprocess.run([sys.executable, "-m", "shard.goodput", str(runs["killed"] / "checkpoints")], cwd=ROOT,
                             env=subprocess_env(), capture_output=True, text=True)
    assert nothing.returncode == 2 and len(nothing.stderr.strip().splitlines()) == 1


def slurm_up() -> bool:
    """A SLURM controller answers (bench/slurm_local.sh starts one on this machine; SLURM_CONF names it)."""
    if not shutil.which("sbatch"):
        return False
    done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return done.returncode == 0 and any(s in done.stdout for s in ("idle", "mix", "alloc"))


@pytest.mark.skipif(not slurm_up(), reason="no SLURM controller answers (bash bench/slurm_local.sh start; SLURM_CONF)")
def test_slurm_restarts_a_job_whose_task_was_killed(runs, tmp_path):
    """The slurm target against a real scheduler: a 2-task job under --max-restarts=1 whose task 1 is killed
    (SIGKILL) after step 10 runs its step again (srun --kill-on-bad-exit ends the other task), resumes from
    step 8 and ends bitwise where the uninterrupted local run did."""
    run = tmp_path / "run"
    env = {**subprocess_env(), "PYTHONPATH": str(ROOT / "tests")}
    submit = subprocess.run([sys.executable, "-m", "shard.launch", "slurm", "--nodes=1", "--tasks-per-node=2",
                             "--max-restarts=1", "--job-name=restart", "--", *overrides(run, *SLOW, *SAVE)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.split("Submitted batch job ")[1].split()[0]
    try:
        deadline = time.time() + 300
        while not (8 in checkpoints(run) and any(r["step"] >= 11 for r in train_records(run))):
            assert time.time() < deadline, "the job did not reach step 11"
            time.sleep(0.05)
        victims = [p for p in Path("/proc").glob("[0-9]*") if slurm_task(p, job, run) == "1"]
        assert len(victims) == 1
        os.kill(int(victims[0].name), signal.SIGKILL)
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            assert time.time() < deadline + 300, "the job did not end"
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    out = (tmp_path / f"restart-{job}.out").read_text()
    assert "launch: attempt 0 exited with status" in out and "resuming from step 8" in out, out[-3000:]
    assert [(r["step"], r["loss"]) for r in train_records(run)] == \
        [(r["step"], r["loss"]) for r in train_records(runs["plain"])]


def slurm_task(proc: Path, job: str, run: Path) -> str | None:
    """SLURM_PROCID of a train.py process of `job` writing to `run`, else None."""
    try:
        cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        env = dict(v.split("=", 1) for v in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                   if "=" in v)
    except OSError:
        return None
    if "train.py" in cmd and f"run.dir={run}" in cmd and env.get("SLURM_JOB_ID") == job:
        return env.get("SLURM_PROCID")
    return None


def test_the_step_timeout_defaults_off_on_cpu_and_to_a_multiple_of_the_step_elsewhere(tmp_path):
    from shard.run import watchdog

    assert watchdog.timeout_for(None, "cpu") is None and watchdog.timeout_for(0, "gpu") is None
    assert watchdog.timeout_for(None, "tpu") == watchdog.FIRST_STEPS_S and watchdog.timeout_for(7, "cpu") == 7
    dog = watchdog.Watchdog(None, "gpu", tmp_path)
    try:
        dog.beat(10, step_time_s=0.5)
        assert dog.timeout == watchdog.AUTO_FLOOR_S  # 100 x 0.5 s is below the floor
        dog.beat(20, step_time_s=10.0)
        assert dog.timeout == watchdog.AUTO_MULTIPLE * 10.0
    finally:
        dog.close()
    fixed = watchdog.Watchdog(60, "gpu", tmp_path)
    fixed.beat(10, step_time_s=10.0)
    assert fixed.timeout == 60  # a timeout the user gave is kept
    fixed.close()


def test_goodput_splits_steps_trained_again_and_counts_the_gap_as_lost():
    """Two attempts: the first reached step 12, the second resumed at 8; its first 4 steps are retrained."""
    from shard.observe import goodput

    records = [{"event": "start", "attempt": 1, "t": 100.0, "process_start": 90.0},
               {"event": "span", "attempt": 1, "kind": "compile", "s": 5.0, "t": 101.0},
               {"event": "span", "attempt": 1, "kind": "steps", "s": 12.0, "t": 120.0, "step": 12, "n": 12},
               {"event": "start", "attempt": 2, "t": 131.0, "process_start": 125.0},
               {"event": "span", "attempt": 2, "kind": "retrained", "s": 4.0, "t": 140.0, "step": 12, "n": 4},
               {"event": "span", "attempt": 2, "kind": "steps", "s": 8.0, "t": 150.0, "step": 20, "n": 8},
               {"event": "end", "attempt": 2, "t": 151.0}]
    totals = goodput.account(records)
    assert totals["lost"] == 5.0 and totals["wall"] == 61.0 and totals["attempts"] == 2
    assert totals["steps"] == 20.0 and totals["retrained"] == 4.0 and totals["retrained_steps"] == 4
    assert totals["other"] == (30.0 - 17.0) + (26.0 - 12.0)  # each attempt's time that no span named
    assert abs(sum(totals[k] for k in goodput.KINDS) - totals["wall"]) < 1e-9
    assert goodput.summary(totals).startswith("goodput 32.8% of 61.0 s")


def test_a_restarted_attempt_counts_steps_up_to_the_earlier_high_mark_as_retrained(tmp_path):
    from shard.observe import goodput

    first = goodput.Recorder(tmp_path, True)
    first.steps(12, 12, 12.0, 0.0)  # the first attempt reached step 12, then died (no end record)
    again = goodput.Recorder(tmp_path, True)  # the restart resumes at step 8
    again.steps(10, 2, 2.0, 0.5)
    again.steps(14, 4, 4.0, 0.0)
    spans = [r for r in goodput.read(tmp_path) if r.get("attempt") == 2 and r.get("event") == "span"]
    assert [(r["kind"], r.get("n"), r["s"]) for r in spans] == [
        ("retrained", 2, 1.5), ("data_wait", None, 0.5), ("retrained", 2, 2.0), ("steps", 2, 2.0),
        ("data_wait", None, 0.0)]
    assert again.attempt == 2
