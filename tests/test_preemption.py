"""Stopping at any moment: SIGTERM/SIGINT checkpoint and exit 0; SIGKILL mid-save loses nothing earlier;
unreadable or half-written checkpoints are skipped with a warning that names them."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env, TINY_GPT, run_cli

QUIET = ["run.progress=false", "train.sample_len=0", "train.eval_batches=1"]


def start(run_dir, *args) -> subprocess.Popen:
    env = subprocess_env()
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TINY_GPT, f"run.dir={run_dir}", *QUIET, *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, proc, timeout=120):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def checkpoints(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_exits_zero_and_resumes(tmp_path, sig):
    proc = start(tmp_path, "train.steps=100000", "checkpoint.every=100000", "run.log_every=1")
    wait_for(lambda: logged_steps(tmp_path) >= 5, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    line = [l for l in out.splitlines() if l.startswith(sig.name)]
    assert len(line) == 1 and "run again to resume" in line[0], out
    stopped = int(line[0].split("after step ")[1].split(";")[0])
    assert checkpoints(tmp_path) == [stopped], err
    if sig == signal.SIGINT:
        return  # resuming is the same for both signals; once is enough
    again = run_cli(*TINY_GPT, f"run.dir={tmp_path}", *QUIET, f"train.steps={stopped + 3}")
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {stopped}" in again.stdout


def test_sigkill_during_async_saves_leaves_a_restorable_checkpoint(tmp_path):
    for delay in (0.0, 0.17):
        proc = start(tmp_path, "train.steps=100000", "checkpoint.every=1", "checkpoint.keep=2", "run.log_every=1000")
        before = checkpoints(tmp_path)
        wait_for(lambda: len(set(checkpoints(tmp_path)) - set(before)) >= 2, proc)
        time.sleep(delay)
        proc.kill()  # SIGKILL: no handler runs, a save is very likely in flight
        proc.communicate()
    # What was left is consistent: the next start resumes from a complete checkpoint and trains on.
    latest = max(checkpoints(tmp_path))
    again = run_cli(*TINY_GPT, f"run.dir={tmp_path}", *QUIET, f"train.steps={latest + 2}", "checkpoint.every=1")
    assert again.returncode == 0, again.stderr
    resumed = int(again.stdout.split("resuming from step ")[1].split()[0])
    assert resumed <= latest
    assert "Traceback" not in again.stderr


def test_corrupt_and_partial_checkpoints_are_skipped_with_a_warning(train, tmp_path, capsys):
    train(*TINY_GPT, "train.steps=20", "checkpoint.enabled=true", "checkpoint.every=10")
    folder = tmp_path / "run" / "checkpoints"
    for f in (folder / "20" / "model").rglob("*"):  # truncate every file of the newest checkpoint's parameters
        if f.is_file():
            f.write_bytes(b"")
    partial = folder / "30.orbax-checkpoint-tmp-123"
    partial.mkdir()  # what an interrupted save leaves behind
    capsys.readouterr()
    result = train(*TINY_GPT, "train.steps=22", "checkpoint.enabled=true", "checkpoint.every=10", "run.log_every=1")
    out, err = capsys.readouterr()
    assert f"skipping incomplete checkpoint {partial}" in err
    assert f"skipping unreadable checkpoint {folder / '20'}" in err
    assert "resuming from step 10" in out and result.start_step == 10
    assert [r["step"] for r in result.history][-1] == 22


def test_explicitly_named_corrupt_checkpoint_is_refused(tmp_path):
    first = run_cli(*TINY_GPT, f"run.dir={tmp_path / 'a'}", *QUIET, "train.steps=10", "checkpoint.every=10")
    assert first.returncode == 0, first.stderr
    for f in (tmp_path / "a" / "checkpoints" / "10" / "model").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    proc = run_cli(*TINY_GPT, f"run.dir={tmp_path / 'b'}", *QUIET, "train.steps=12",
                   f"checkpoint.restore_from={tmp_path / 'a'}")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "checkpoint" in proc.stderr, proc.stderr
