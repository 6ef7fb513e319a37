"""train.nonfinite=stop|skip|rollback: a batch that makes the loss NaN is rolled back past, named in the log
and the metrics; the state after a rollback is the checkpoint's, bitwise; bad settings are one line."""

import json
import shutil

import jax
import numpy as np
import pytest

from conftest import TINY_GPT, overrides, run_cli

MLP = ["model.name=mlp", "model.in_features=16", "model.out_features=8", "model.hidden=[32,32]", "data.name=arrays",
       "data.batch_size=8", "run.log_every=1", "run.cpu_devices=1"]
ROLLBACK = ["train.nonfinite=rollback", "checkpoint.enabled=true", "checkpoint.every=2", "checkpoint.keep=100",
            "checkpoint.async=false"]


def arrays(path, nan_rows) -> str:
    """64 examples of 16 features, 8 classes; the given rows' inputs are NaN (a bad record in the data)."""
    x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    x[list(nan_rows)] = np.nan
    np.savez(path, inputs=x, targets=(np.arange(64) % 8).astype(np.int32))
    return f"data.path={path}"


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rollback_restores_the_checkpoint_and_skips_the_batches_that_led_to_the_bad_step(train, tmp_path, capsys,
                                                                                        monkeypatch):
    from shard.run import checkpoint, trainer

    restored = []  # every state start_state hands the loop (copied: steps donate it), then one per rollback
    real = trainer.start_state

    def recording(*args):
        state = real(*args)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restored.append((jax.device_get(state), shapes))
        return state

    monkeypatch.setattr(trainer, "start_state", recording)
    data = arrays(tmp_path / "nan.npz", [5])
    result = train(*MLP, data, *ROLLBACK, "train.steps=20")
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("rollback:")]
    events = [r for r in records(tmp_path / "run") if "rolled_back_from" in r]
    assert len(lines) == len(events) == len(restored) - 1 >= 2, out
    for line, event in zip(lines, events):  # the log and the metrics name the same bad step and skipped batches
        assert f"at step {event['rolled_back_from']};" in line and f"restored step {event['step']}" in line
        assert f"skipped batches {event['skipped_batches_first']}..{event['skipped_batches_last']}" in line
        assert event["step"] < event["rolled_back_from"] and event["step"] % 2 == 0  # the checkpoint before it
    # The run finished, each step logged once, every loss finite.
    steps = [r["step"] for r in result.history]
    assert steps == list(range(1, 21)) and all(np.isfinite(r["loss"]) for r in result.history)
    assert [r["step"] for r in records(tmp_path / "run") if "loss" in r] == steps
    # The state after each rollback is the checkpoint's, bitwise.
    folder = tmp_path / "run" / "checkpoints"
    for event, (state, shapes) in zip(events, restored[1:]):
        saved, _ = checkpoint.restore_path(str(folder / str(event["step"])), "test", shapes, model_only=False)
        assert int(state.step) == event["step"]
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The skipped batches shift the data for good (the offset is in each checkpoint): resumed from step 16, a
    # run reads what this one read after it.
    for step in (18, 20):
        shutil.rmtree(folder / str(step))
    resumed = train(*MLP, data, *ROLLBACK, "train.steps=20")
    assert resumed.start_step == 16
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in result.history if r["step"] > 16]


def test_rollbacks_in_a_row_stop_the_run_in_one_line(tmp_path):
    """Every batch is bad: each rollback goes back to the start, and the fourth in a row stops the run."""
    data = arrays(tmp_path / "nan.npz", range(64))
    done = run_cli(*overrides(tmp_path / "run", *MLP, data, *ROLLBACK, "train.steps=10", "train.max_rollbacks=3"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("rollback: loss is nan") == 3
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: loss is nan") and "stopped after 3 rollbacks in a row to step 0" in last


@pytest.mark.parametrize("args,message", [
    (["train.nonfinite=retry"], "train.nonfinite='retry' is not allowed; choose one of: stop, skip, rollback"),
    (["train.nonfinite=rollback", "checkpoint.enabled=false"], "train.nonfinite=rollback restores the last checkpoint"),
    (["train.nonfinite=rollback", "train.skip_nonfinite=true"], "disagree"),
    (["run.step_timeout_s=-5"], "run.step_timeout_s=-5.0 is out of range"),
    (["train.max_rollbacks=0"], "train.max_rollbacks=0 is out of range"),
])
def test_bad_settings_are_one_line(tmp_path, args, message):
    done = run_cli(*TINY_GPT, f"run.dir={tmp_path}", "train.steps=1", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "config.yaml").exists()
