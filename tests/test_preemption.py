"""Stopping at any moment: SIGTERM/SIGINT checkpoint and exit 0; SIGKILL mid-save loses nothing earlier;
unreadable or half-written checkpoints are skipped with a warning that names them."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env, TINY_GPT, run_cli
from shard.errors import UserError

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
    assert partial.is_dir()  # skipped, never deleted
    # Step 20, saved again on the way to 22, was rewritten whole: it resumes now.
    capsys.readouterr()
    again = train(*TINY_GPT, "train.steps=20", f"checkpoint.restore_from={folder / '20'}", subdir="from20")
    assert again.start_step == 20 and "skipping" not in capsys.readouterr().err
    # The unreadable copy was moved aside, not deleted; the interrupted save of step 30 is still there after
    # step 30 is saved for real.
    assert ((folder / "20.unreadable" / "model").is_dir()
            and err.count(f"moved unreadable checkpoint {folder / '20'}") == 1)
    train(*TINY_GPT, "train.steps=30", "checkpoint.enabled=true", "checkpoint.every=10")
    assert partial.is_dir() and 30 in checkpoints(tmp_path / "run")


def test_a_checkpoint_that_fails_for_io_is_retried_and_never_skipped(train, tmp_path, monkeypatch, capsys):
    from shard.run import checkpoint

    train(*TINY_GPT, "train.steps=10", "checkpoint.enabled=true", "checkpoint.every=5")
    real, failures = checkpoint.restore_step, []
    monkeypatch.setattr(checkpoint, "RETRY_DELAYS_S", (0, 0))

    def flaky(*args, **kwargs):  # a storage that fails twice, then answers
        if len(failures) < 2:
            failures.append(1)
            raise OSError(5, "Input/output error")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "restore_step", flaky)
    capsys.readouterr()
    assert train(*TINY_GPT, "train.steps=12", "checkpoint.enabled=true", "checkpoint.every=5").start_step == 10
    assert capsys.readouterr().err.count("trying again") == 2

    def down(*args, **kwargs):
        raise ValueError("UNAVAILABLE: the bucket did not answer")

    monkeypatch.setattr(checkpoint, "restore_step", down)
    with pytest.raises(UserError, match="could not be read after 3 tries.*nothing was skipped"):
        train(*TINY_GPT, "train.steps=14", "checkpoint.enabled=true", "checkpoint.every=5")
    assert 12 in checkpoints(tmp_path / "run")  # still there, not skipped for an older one


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


SLOW = ["model.name=stock_models:SlowMLP", "data.name=synthetic", "data.features=[16]", "data.classes=8",
        "data.batch_size=8", "run.cpu_devices=1", *QUIET]


def start_slow(run_dir, trace, *args) -> subprocess.Popen:
    """The slow model in a fresh process, importable from tests/ (the working directory)."""
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *SLOW, f"run.dir={run_dir}",
                             f"model.trace={trace}", *args], cwd=ROOT / "tests", env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def events(trace: Path) -> list[str]:
    return trace.read_text().split() if trace.exists() else []


def test_a_stop_in_the_loop_lands_within_a_step_even_between_log_points(tmp_path):
    """No log point, checkpoint or eval for 1000 steps: the loop must still not run ahead of the device
    (dispatch is asynchronous: it would queue all 1000 steps and see the stop only after them)."""
    run = tmp_path / "run"
    proc = start_slow(run, "", "model.work=40", "train.steps=1000", "run.log_every=1000", "checkpoint.every=1000")
    wait_for(lambda: logged_steps(run) >= 1, proc)  # step 1 is always logged
    seen = time.monotonic()
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    elapsed = time.monotonic() - seen + 0.05  # + the poll interval before step 1's record was seen
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = int(out.split("SIGTERM: stopped after step ")[1].split(";")[0])
    assert 1 < stopped < 1000 and checkpoints(run) == [stopped]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    fastest = min(m["step_time_s"] for m in metrics if "step_time_s" in m)
    # Steps run between step 1's record and the signal, plus the one running and the one queued behind it;
    # twice that, as the machine's load changes the step time from step to step (a loop that ran ahead of
    # the device would stop after all 1000 steps).
    assert stopped <= 1 + 2 * elapsed / fastest + 3, (stopped, fastest, elapsed)


def test_a_stop_during_start_up_exits_at_once_without_a_checkpoint(tmp_path):
    trace = tmp_path / "trace"
    proc = start_slow(tmp_path / "run", trace, "model.init_seconds=600", "train.steps=5")
    wait_for(lambda: "init" in events(trace), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)  # not the 600 s the model takes to build
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM: stopped during start; no checkpoint was written by this run" in out
    assert checkpoints(tmp_path / "run") == []


def test_a_stop_during_the_final_eval_keeps_the_last_checkpoint_and_exits_zero(tmp_path):
    trace = tmp_path / "trace"
    proc = start_slow(tmp_path / "run", trace, "model.seconds=0.2", "train.steps=2", "train.eval_batches=0",
                      "data.size=512")
    wait_for(lambda: "eval" in events(trace), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "SIGTERM: stopped during the final eval and sample; checkpoint at step 2 is written" in out
    assert checkpoints(tmp_path / "run") == [2]
    records = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval_loss" in r for r in records)  # the eval did not finish
