"""ZeRO-1/2, low-precision gradient reduction and host offload: each checked against the published analysis
(ZeRO, Rajbhandari et al. 2020: per device 4Psi of float32 parameters, 8Psi/N of Adam moments, gradients 4Psi or
4Psi/N; about 2Psi sent per step like data parallelism) and for the same curve as plain data parallelism."""

import jax
import numpy as np
import pytest

from conftest import TINY_GPT, overrides
from shard import config, plan

N = 8
STEPS = ["train.steps=6", "run.log_every=1", "run.cpu_devices=8"]


def analyse(tmp_path, *extra):
    return plan.analyse(config.load(None, overrides(tmp_path, *TINY_GPT, "data.batch_size=32", *extra)), jax.devices())


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    out = {}

    def get(*extra):
        if extra not in out:
            out[extra] = analyse(tmp_path_factory.mktemp("plan"), *extra)
        return out[extra]

    return get


def test_zero_memory_and_bytes_follow_the_paper(plans):
    dp, zero1, zero2 = plans("mesh=dp"), plans("mesh=zero1"), plans("mesh=zero2")
    psi = dp["param_count"]
    for p in (dp, zero1, zero2):  # parameters whole on every device
        assert p["memory_per_device"]["params"] == 4 * psi
    assert dp["memory_per_device"]["optimizer"] == pytest.approx(8 * psi, rel=0.01)
    for p in (zero1, zero2):  # every tensor of the tiny model has a dimension 8 divides
        assert p["memory_per_device"]["optimizer"] == pytest.approx(8 * psi / N, rel=0.01)
    assert zero1["memory_per_device"]["gradients"] == 4 * psi
    assert zero2["memory_per_device"]["gradients"] == pytest.approx(4 * psi / N, rel=0.01)
    ring = 2 * (N - 1) / N * 4 * psi  # an all-reduce, or a reduce-scatter plus an all-gather, of Psi floats
    for p in (dp, zero1, zero2):
        assert p["wire_bytes_per_device"] == pytest.approx(ring, rel=0.02)
    for p in (zero1, zero2):
        table = p["collectives"]
        assert table["reduce-scatter"]["count"] and table["all-gather"]["count"]


def test_zero2_sums_microbatches_split_and_zero1_reduces_once(plans):
    k1, zero1, zero2 = plans("mesh=zero1"), plans("mesh=zero1", "train.grad_accum=4"), plans("mesh=zero2", "train.grad_accum=4")
    assert zero1["wire_bytes_per_device"] == pytest.approx(k1["wire_bytes_per_device"], rel=0.01)
    assert zero1["collectives"]["reduce-scatter"]["count"] == k1["collectives"]["reduce-scatter"]["count"]
    assert zero2["collectives"]["reduce-scatter"]["count"] == 4 * k1["collectives"]["reduce-scatter"]["count"]
    assert zero2["memory_per_device"]["temp"] < zero1["memory_per_device"]["temp"]


def test_data_parallel_reduces_once_per_step_under_accumulation(plans):
    k1, k4 = plans("mesh=dp"), plans("mesh=dp", "train.grad_accum=4")
    assert k4["collectives"]["all-reduce"]["count"] <= k1["collectives"]["all-reduce"]["count"]
    assert k4["wire_bytes_per_device"] <= 1.01 * k1["wire_bytes_per_device"]


def test_bfloat16_reduction_halves_the_data_parallel_bytes(plans):
    fp32, bf16 = plans("mesh=dp"), plans("mesh=dp", "train.grad_dtype=bfloat16")
    assert bf16["wire_bytes_per_device"] <= 0.55 * fp32["wire_bytes_per_device"]
    hybrid = plans("mesh=hybrid", "train.grad_dtype=bfloat16", "train.grad_accum=2")
    assert hybrid["wire_bytes_per_device"] < plans("mesh=hybrid")["wire_bytes_per_device"]


def test_zero_and_offload_train_the_data_parallel_curve(train):
    dp = [r["loss"] for r in train(*TINY_GPT, *STEPS, "mesh=dp", subdir="dp").history]
    assert dp[-1] < dp[0]
    for extra in (["mesh=zero1"], ["mesh=zero2", "train.grad_accum=2"], ["mesh=dp", "train.offload=params"]):
        run = train(*TINY_GPT, *STEPS, *extra, subdir="_".join(extra).replace("=", "-"))
        np.testing.assert_allclose([r["loss"] for r in run.history], dp, rtol=1e-5, err_msg=str(extra))


def test_offload_keeps_the_state_in_host_memory(plans):
    on_device, params = plans("mesh=dp"), plans("mesh=dp", "train.offload=params")
    optimizer = plans("mesh=dp", "train.offload=optimizer")
    mem = lambda p: p["memory_per_device"]
    assert mem(optimizer)["host"] == mem(on_device)["optimizer"]
    assert mem(params)["host"] == mem(on_device)["optimizer"] + 4 * on_device["param_count"]
    assert mem(on_device)["host"] == 0
    assert mem(optimizer)["total"] < mem(on_device)["total"]


def test_offload_where_the_backend_has_no_host_memory_is_one_clear_error():
    from types import SimpleNamespace

    from shard import state
    from shard.errors import UserError

    device = SimpleNamespace(platform="cpu", addressable_memories=lambda: [SimpleNamespace(kind="device")])
    state.check_offload("none", device)
    with pytest.raises(UserError, match="train.offload=optimizer .* works on GPU and TPU"):
        state.check_offload("optimizer", device)
