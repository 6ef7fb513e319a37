"""Gradient accumulation (`train.grad_accum=K`): the same updates as the whole batch at once, with
less activation memory."""

import jax
import numpy as np
import pytest

from conftest import TINY_GPT, overrides
from shard import config
from shard.plan import analysis

STEPS = ["train.steps=6", "run.log_every=1", "run.cpu_devices=8"]


@pytest.mark.parametrize("mesh", ["dp", "fsdp"])
def test_microbatches_give_the_whole_batch_curve(train, mesh):
    whole = [r["loss"] for r in train(*TINY_GPT, *STEPS, f"mesh={mesh}", subdir="whole").history]
    accumulated = train(*TINY_GPT, *STEPS, f"mesh={mesh}", "train.grad_accum=2", subdir="accumulated")
    assert whole[-1] < whole[0]
    np.testing.assert_allclose([r["loss"] for r in accumulated.history], whole, rtol=1e-5)


def test_accumulation_lowers_the_steps_activation_memory(tmp_path):
    temp = {k: analysis.analyse(config.load(None, overrides(tmp_path, *TINY_GPT, "data.batch_size=32",
                                                        f"train.grad_accum={k}")), jax.devices()[:1])
            ["memory_per_device"]["temp"] for k in (1, 4)}
    assert temp[4] < 0.75 * temp[1], temp


CENTERED = ["model.name=stock_models:BatchCenteredMLP", "model.in_features=16", "model.hidden=32", "model.classes=8",
            "data.name=synthetic", "data.features=[16]", "data.classes=8", "data.batch_size=32",
            "optimizer.lr=3e-2", "train.grad_accum=2"]


def test_a_model_whose_examples_interact_keeps_the_global_reduction_and_says_so(train, tmp_path, capsys):
    """A class that declares `examples_interact` is not run per data shard (its batch mean would be each
    shard's): it trains as on one device, and the log and the plan say what the reduction then costs."""
    one = [r["loss"] for r in train(*CENTERED, *STEPS, "run.cpu_devices=1", subdir="one").history]
    capsys.readouterr()
    dp = [r["loss"] for r in train(*CENTERED, *STEPS, "mesh=dp", subdir="dp").history]
    np.testing.assert_allclose(dp, one, rtol=1e-5)
    said = capsys.readouterr().err
    assert "warning: gradients are reduced by XLA inside the backward pass" in said
    assert "examples_interact = True" in said and "each of the 2 microbatches" in said
    p = analysis.analyse(config.load(None, overrides(tmp_path, *CENTERED, "mesh=dp", "run.cpu_devices=8")),
                     jax.devices()[:8])
    assert "examples_interact" in p["gradient_fallback"] and "note: gradients" in analysis.report(p)
    ring = analysis.analyse(config.load(None, overrides(tmp_path, *TINY_GPT, "mesh=cp", "mesh.context=4", "mesh.data=2",
                                                    "train.grad_accum=2", "train.context_strategy=ring",
                                                    "run.cpu_devices=8")),
                        jax.devices()[:8])
    assert "context_strategy=ring" in ring["gradient_fallback"]
    plain = analysis.analyse(config.load(None, overrides(tmp_path, *TINY_GPT, "mesh=dp", "train.grad_accum=2",
                                                     "run.cpu_devices=8")), jax.devices()[:8])
    assert plain["gradient_fallback"] == ""
