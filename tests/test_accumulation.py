"""Gradient accumulation (`train.grad_accum=K`): the same updates as the whole batch at once, with
less activation memory."""

import jax
import numpy as np
import pytest

from conftest import TINY_GPT, overrides
from shard import config, plan

STEPS = ["train.steps=6", "run.log_every=1", "run.cpu_devices=8"]


@pytest.mark.parametrize("mesh", ["dp", "fsdp"])
def test_microbatches_give_the_whole_batch_curve(train, mesh):
    whole = [r["loss"] for r in train(*TINY_GPT, *STEPS, f"mesh={mesh}", subdir="whole").history]
    accumulated = train(*TINY_GPT, *STEPS, f"mesh={mesh}", "train.grad_accum=2", subdir="accumulated")
    assert whole[-1] < whole[0]
    np.testing.assert_allclose([r["loss"] for r in accumulated.history], whole, rtol=1e-5)


def test_accumulation_lowers_the_steps_activation_memory(tmp_path):
    temp = {k: plan.analyse(config.load(None, overrides(tmp_path, *TINY_GPT, "data.batch_size=32",
                                                        f"train.grad_accum={k}")), jax.devices()[:1])
            ["memory_per_device"]["temp"] for k in (1, 4)}
    assert temp[4] < 0.75 * temp[1], temp
