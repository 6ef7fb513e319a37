"""The weights' moving average (train.ema), the strategy written through the one strategy interface: the
average follows its recursion step by step, eval and load_model use it, it starts from the loaded weights
of a checkpoint without one, resumes bitwise, gives the one-device figures under fsdp x tensor, a circular
pipeline and gradient accumulation, and is refused in one line with DiLoCo."""

import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import shard
from conftest import TINY_GPT, overrides, same_curve_as_one_device
from shard import config
from shard.plan import analysis
from shard.errors import UserError

DECAY = 0.5  # a strong pull, so that the average differs clearly from the weights after a few steps
BASE = [*TINY_GPT, "train.steps=4", "run.log_every=1", f"train.ema={DECAY}"]


def saved(run_dir, step: int) -> tuple[list, list]:
    """(parameters, average) of a checkpoint, as flat lists of arrays in tree order."""
    manager = ocp.CheckpointManager(run_dir / "checkpoints", item_handlers={
        "model": ocp.PyTreeCheckpointHandler(), "optimizer": ocp.PyTreeCheckpointHandler()})
    got = manager.restore(step, args=ocp.args.Composite(model=ocp.args.PyTreeRestore(),
                                                        optimizer=ocp.args.PyTreeRestore()))
    manager.close()
    ema = got["optimizer"].get("extra", {}).get("ema")
    return jax.tree.leaves(got["model"]["params"]), (jax.tree.leaves(ema) if ema is not None else None)


def test_the_average_follows_its_recursion_and_eval_and_load_model_use_it(train, tmp_path):
    result = train(*BASE, "checkpoint.enabled=true", "checkpoint.every=1", "checkpoint.keep=4")
    run = tmp_path / "run"
    for step in (2, 3, 4):  # ema_k = d ema_(k-1) + (1 - d) params_k
        (_, before), (params, after) = saved(run, step - 1), saved(run, step)
        for e0, p, e1 in zip(before, params, after):
            np.testing.assert_allclose(e1, DECAY * e0 + (1 - DECAY) * p, rtol=1e-6, atol=1e-7)
    params, ema = saved(run, 4)
    assert max(float(np.max(np.abs(p - e))) for p, e in zip(params, ema)) > 1e-4  # the average is not the weights
    loaded = jax.tree.leaves(nnx.state(shard.load_model(str(run)), nnx.Param))
    for a, e in zip(loaded, ema):
        np.testing.assert_array_equal(np.asarray(a), e)
    # the final eval is the average's: a run without it evaluates the raw weights, which differ
    plain = train(*BASE, "train.ema=0", subdir="plain")
    assert [r["loss"] for r in plain.history] == [r["loss"] for r in result.history]  # training itself unchanged
    assert result.eval["eval_loss"] != plain.eval["eval_loss"]


def test_a_checkpoint_without_the_average_starts_it_from_its_weights(train, tmp_path):
    train(*BASE, "train.ema=0", "train.steps=2", "checkpoint.enabled=true", subdir="plain")
    train(*BASE, "train.steps=3", "checkpoint.enabled=true", f"checkpoint.restore_from={tmp_path / 'plain'}",
          subdir="averaged")
    (start, _), (params, ema) = saved(tmp_path / "plain", 2), saved(tmp_path / "averaged", 3)
    for s, p, e in zip(start, params, ema):  # one step on from the restored weights
        np.testing.assert_allclose(e, DECAY * s + (1 - DECAY) * p, rtol=1e-6, atol=1e-7)


def test_resume_is_bitwise(train, tmp_path):
    whole = train(*BASE, "checkpoint.enabled=true", "checkpoint.every=2")
    _, ema = saved(tmp_path / "run", 4)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")  # as if stopped after step 2
    resumed = train(*BASE, "checkpoint.enabled=true", "checkpoint.every=2")
    assert resumed.start_step == 2
    assert resumed.history[-1]["loss"] == whole.history[-1]["loss"]
    assert resumed.eval == whole.eval
    for a, b in zip(ema, saved(tmp_path / "run", 4)[1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mesh", [["mesh=fsdp_tp", "mesh.tensor=2", "run.cpu_devices=4"],
                                  ["mesh=pp", "pipeline.repeats=2", "model.n_layers=4", "run.cpu_devices=2"],
                                  ["mesh=dp", "train.grad_accum=2", "run.cpu_devices=4"]],
                         ids=["fsdp_tp", "circular_pipeline", "accumulation"])
def test_on_any_mesh_the_average_evaluates_as_on_one_device(train, mesh):
    same_curve_as_one_device(train, BASE, mesh)


def test_the_plan_counts_the_average_and_diloco_is_refused(tmp_path):
    cfg = config.load(None, overrides(tmp_path, *BASE, "run.cpu_devices=4", "mesh=fsdp"))
    result = analysis.analyse(cfg, jax.devices()[:4])
    assert f"train.ema={DECAY}" in result["strategies"]
    params = result["memory_per_device"]["params"]
    assert result["ema"]["bytes_per_device"] == pytest.approx(params, rel=0.05)  # a copy, split like the weights
    with pytest.raises(UserError, match="train.ema=0.5 with train.sync=diloco: the replicas' weights part"):
        analysis.analyse(config.load(None, overrides(tmp_path, *BASE, "run.cpu_devices=4", "mesh.replica=2",
                                                 "train.sync=diloco")), jax.devices()[:4])


def test_two_processes_average_as_one(train, tmp_path):
    from test_multihost import losses as logged, train_processes

    args = [*BASE, "mesh=fsdp", "train.sample_len=8"]
    one = train(*args, "run.cpu_devices=8", subdir="one")
    train_processes(tmp_path / "two", 2, *args, "mesh.dcn_fsdp=2")  # the average's shards span the processes
    np.testing.assert_allclose(logged(tmp_path / "two"), [r["loss"] for r in one.history], rtol=1e-5)
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in records if "eval_loss" in r)["eval_loss"] == pytest.approx(one.eval["eval_loss"], rel=1e-5)
