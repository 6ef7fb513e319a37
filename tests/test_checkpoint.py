"""Checkpoints: exact resume, restore onto other meshes, params-only init, and bad paths."""

import json
import math
import re
import shutil

import jax
import numpy as np
import pytest

from conftest import TINY_GPT, run_cli

RUN = [*TINY_GPT, "train.steps=30", "run.log_every=1", "checkpoint.enabled=true", "checkpoint.every=10",
       "checkpoint.keep=5"]


def curve(result, first=1):
    return {r["step"]: r["loss"] for r in result.history if r["step"] >= first}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """30 steps in one go under fsdp on 8 devices, checkpoints at 10, 20, 30."""
    from shard import config
    from shard.run import trainer
    from conftest import overrides

    run_dir = tmp_path_factory.mktemp("whole")
    result = trainer.run(config.load(None, overrides(run_dir, *RUN, "run.cpu_devices=8", "mesh=fsdp")))
    return run_dir, curve(result)


def resume_from_step_20(tmp_path, uninterrupted):
    """A copy of the uninterrupted run that stopped right after its step-20 checkpoint."""
    source, _ = uninterrupted
    run_dir = tmp_path / "resumed"
    shutil.copytree(source, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "30")
    return run_dir


def test_resume_is_bitwise_exact(train, tmp_path, uninterrupted, capsys):
    run_dir = resume_from_step_20(tmp_path, uninterrupted)
    from shard import config
    from shard.run import trainer
    from conftest import overrides

    result = trainer.run(config.load(None, overrides(run_dir, *RUN, "run.cpu_devices=8", "mesh=fsdp")))
    assert result.start_step == 20 and "resuming from step 20" in capsys.readouterr().out
    resumed, whole = curve(result), uninterrupted[1]
    assert sorted(resumed) == list(range(21, 31))
    assert all(resumed[s] == whole[s] for s in resumed), (resumed, whole)  # bitwise, not approximately


@pytest.mark.parametrize("devices,preset", [(4, "tp"), (2, "dp"), (8, "fsdp_tp")])
def test_restore_onto_another_mesh_continues_the_curve(tmp_path, uninterrupted, devices, preset):
    run_dir = resume_from_step_20(tmp_path, uninterrupted)
    from shard import config
    from shard.run import trainer
    from conftest import overrides

    result = trainer.run(config.load(None, overrides(run_dir, *RUN, f"run.cpu_devices={devices}", f"mesh={preset}")))
    assert result.start_step == 20 and result.mesh.size == devices
    spec = result.state.params["blocks"]["attn"]["q"].get_value().sharding.spec
    assert "tensor" in spec or preset == "dp"  # really on the new layout
    resumed, whole = curve(result), uninterrupted[1]
    np.testing.assert_allclose([resumed[s] for s in range(21, 31)], [whole[s] for s in range(21, 31)], rtol=1e-4)


def test_restore_from_another_run_and_init_from(train, uninterrupted):
    source, whole = uninterrupted
    restored = train(*RUN, "run.cpu_devices=4", "mesh=hybrid", f"checkpoint.restore_from={source}/checkpoints/20",
                     subdir="restored")
    assert restored.start_step == 20
    np.testing.assert_allclose(curve(restored)[21], whole[21], rtol=1e-4)
    fine_tuned = train(*RUN, "train.steps=3", f"train.init_from={source}", subdir="finetune")
    assert fine_tuned.start_step == 0  # parameters only: a fresh optimizer and step count
    assert fine_tuned.history[0]["loss"] < whole[1] - 0.5  # starts from trained weights, not from scratch


def test_non_finite_loss_stops_without_writing_a_checkpoint(train, tmp_path):
    diverge = ["train.steps=40", "optimizer.lr=1e4", "optimizer.clip_norm=0", "run.log_every=100"]
    run_dir = tmp_path / "nan"
    proc = run_cli(*TINY_GPT, *diverge, f"run.dir={run_dir}", "run.progress=false", "train.sample_len=0",
                   "checkpoint.every=5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    found = re.match(r"error: loss is (\S+) \(gradient norm (\S+)\) at step (\d+);", line)
    assert found and not (math.isfinite(float(found[1])) and math.isfinite(float(found[2]))), line
    bad_step = int(found[3])
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert all(step < bad_step for step in saved)
    skipped = train(*TINY_GPT, *diverge, "train.skip_nonfinite=true", "checkpoint.enabled=true", subdir="skip")
    assert skipped.history[-1]["skipped_steps"] > 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(skipped.state.params))


BAD_PATHS = {
    "missing": ("checkpoint.restore_from={tmp}/nowhere", "does not exist"),
    "empty": ("checkpoint.restore_from={tmp}/empty", "holds no checkpoint"),
    "other shapes": ("train.init_from={source}", "parameter"),
}


@pytest.mark.parametrize("case", list(BAD_PATHS))
def test_bad_checkpoint_paths_are_one_line_errors(tmp_path, uninterrupted, case):
    source, _ = uninterrupted
    (tmp_path / "empty").mkdir()
    arg, expected = BAD_PATHS[case]
    model = ([a.replace("model.d_model=32", "model.d_model=64") for a in TINY_GPT] if case == "other shapes"
             else TINY_GPT)
    proc = run_cli(*model, f"run.dir={tmp_path / 'run'}", "train.steps=2", "run.progress=false",
                   arg.format(tmp=tmp_path, source=source))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_model_with_dropout_resumes_bitwise(train, tmp_path):
    """Random state inside the model (nnx.Dropout's nnx.Rngs) is saved and restored like any other."""
    run = ["model.name=stock_models:DropoutMLP", "data.name=synthetic", "data.features=[16]", "data.classes=8",
           "data.batch_size=16", "train.steps=30", "run.log_every=1", "checkpoint.enabled=true",
           "checkpoint.every=10", "run.cpu_devices=2", "mesh=fsdp"]
    whole = train(*run, subdir="whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "30")
    resumed = train(*run, subdir="resumed")
    assert resumed.start_step == 20
    tail = {s: l for s, l in curve(whole).items() if s > 20}
    assert curve(resumed) == tail  # bitwise: the dropout masks of steps 21-30 are the same ones
    assert len(set(tail.values())) > 1
    key = lambda r: jax.random.key_data(r.state.rest["drop"]["rngs"]["key"].get_value())
    np.testing.assert_array_equal(key(resumed), key(whole))


def test_a_run_already_past_train_steps_says_so_and_logs_its_true_step(tmp_path, uninterrupted, capsys):
    from shard import config
    from shard.run import trainer
    from conftest import overrides

    run_dir = tmp_path / "done"
    shutil.copytree(uninterrupted[0], run_dir)
    args = [a for a in RUN if not a.startswith("train.steps")]
    trainer.run(config.load(None, overrides(run_dir, *args, "train.steps=20", "run.cpu_devices=8", "mesh=fsdp")))
    assert "the model is at step 30, already past train.steps=20: nothing to train" in capsys.readouterr().out
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 30 and "eval_loss" in last


def test_raising_train_steps_on_resume_warns_that_the_schedule_changes(tmp_path, uninterrupted, capfd):
    from shard import config
    from shard.run import trainer
    from conftest import overrides

    run_dir = resume_from_step_20(tmp_path, uninterrupted)
    args = [a for a in RUN if not a.startswith("train.steps")]
    trainer.run(config.load(None, overrides(run_dir, *args, "train.steps=22", "run.cpu_devices=8", "mesh=fsdp")))
    err = capfd.readouterr().err
    assert "train.steps=22 but this run was started with 30" in err and "learning-rate schedule" in err
