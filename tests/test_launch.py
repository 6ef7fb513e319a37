"""The launcher's command line, in-process through its dry runs (no processes start, nothing is written).
Real multi-process runs, and the launch commands as a subprocess sees them, are in test_multihost.py."""

import sys

import pytest

from conftest import ROOT
from shard.run import launch

TARGETS = {
    "local": ["local", "--processes=2", "--dry-run"],
    "tpu": ["tpu", "--name=pod", "--zone=us-east5-a", "--dry-run"],
    "slurm": ["slurm", "--nodes=2", "--gpus-per-node=8", "--dry-run"],
    "gke": ["gke", "--cluster=c1", "--tpu-type=v5litepod-8", "--docker-image=img"],
}
ARGS = ["configs/gpt_small.yaml", "mesh=fsdp", "run.dir=gs://bucket/run"]


def dry_run(capsys, monkeypatch, *argv) -> str:
    monkeypatch.setattr(launch, "free_port", lambda: 12345)  # the same commands on every call
    assert launch.main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_leading_train_py_is_dropped_for_every_target(capsys, monkeypatch, target):
    """`-- train.py CONFIG ...` (the torchrun habit) launches what `-- CONFIG ...` does."""
    expected = dry_run(capsys, monkeypatch, *TARGETS[target], "--", *ARGS)
    assert "configs/gpt_small.yaml mesh=fsdp" in expected
    for script in ("train.py", str(ROOT / "train.py"), "./train.py"):
        assert dry_run(capsys, monkeypatch, *TARGETS[target], "--", script, *ARGS) == expected


def test_another_projects_train_py_is_one_clear_error(tmp_path):
    other = tmp_path / "train.py"
    other.write_text("print('not ours')\n")
    with pytest.raises(launch.LaunchError, match="is not this project's train.py"):
        launch.main(["local", "--processes=2", "--dry-run", "--", str(other), "train.steps=1"])
    with pytest.raises(launch.LaunchError, match="go after --"):  # forgot the --
        launch.main(["local", "--processes=2", "train.py", "train.steps=1"])


def test_slurm_runs_the_launching_interpreter_or_the_one_given(capsys, monkeypatch):
    out = dry_run(capsys, monkeypatch, *TARGETS["slurm"], "--", "train.py", *ARGS).splitlines()
    srun = f"srun {sys.executable} train.py configs/gpt_small.yaml mesh=fsdp run.dir=gs://bucket/run run.distributed=on"
    assert srun in out and any("every node" in line.lower() for line in out if line.startswith("#"))
    out = dry_run(capsys, monkeypatch, *TARGETS["slurm"], "--python=/shared/env/bin/python", "--", "mesh=fsdp")
    assert "srun /shared/env/bin/python train.py mesh=fsdp run.distributed=on" in out.splitlines()


@pytest.mark.parametrize("argv", [["--help"], ["local", "--help"], ["slurm", "--help"]])
def test_help_says_train_py_is_dropped(capsys, argv):
    with pytest.raises(SystemExit) as done:
        launch.main(argv)
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal
    assert "leading train.py" in text.replace("`", "") and "-- [CONFIG.yaml] [key=value ...]" in text
    if "slurm" in argv:
        assert "--python PATH" in text and "shared file system" in text


def test_max_restarts_reaches_every_target(capsys, monkeypatch):
    """SLURM and the TPU hosts loop in the shell (srun ends the step when a task fails), GKE's JobSet restarts."""
    slurm = dry_run(capsys, monkeypatch, *TARGETS["slurm"], "--max-restarts=2", "--", *ARGS)
    assert "(for attempt in $(seq 0 2); do srun --kill-on-bad-exit=1 " in slurm and "&& exit 0;" in slurm
    tpu = dry_run(capsys, monkeypatch, *TARGETS["tpu"], "--max-restarts=1", "--", *ARGS)
    assert "&& (for attempt in $(seq 0 1); do python3 train.py configs/gpt_small.yaml" in tpu
    assert "--max-restarts=3" in dry_run(capsys, monkeypatch, *TARGETS["gke"], "--max-restarts=3", "--", *ARGS)
    cpu = dry_run(capsys, monkeypatch, "slurm", "--nodes=1", "--tasks-per-node=2", "--dry-run", "--", *ARGS)
    assert "#SBATCH --ntasks-per-node=2" in cpu.splitlines()  # several processes a node without GPUs
    with pytest.raises(launch.LaunchError, match="--tasks-per-node must be positive"):
        launch.main(["slurm", "--nodes=1", "--tasks-per-node=0", "--dry-run", "--", *ARGS])
    for target in TARGETS:  # none by default: the commands are as before
        assert "attempt" not in dry_run(capsys, monkeypatch, *TARGETS[target], "--", *ARGS)


def test_the_shell_loop_restarts_until_success(tmp_path):
    """The loop the SLURM script and TPU hosts run: a command failing twice then succeeding runs 3 times."""
    import subprocess

    from shard.run import restarts

    counter = tmp_path / "n"
    command = f"echo x >> {counter}; [ $(wc -l < {counter}) -ge 3 ]"
    done = subprocess.run(["bash", "-c", restarts.shell_loop(command, 5)], capture_output=True, text=True)
    assert done.returncode == 0 and counter.read_text().count("x") == 3
    counter.unlink()
    done = subprocess.run(["bash", "-c", restarts.shell_loop(command, 1)], capture_output=True, text=True)
    assert done.returncode == 1 and counter.read_text().count("x") == 2
