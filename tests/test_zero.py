"""ZeRO-1/2, low-precision gradient reduction and accumulation, and host offload: each checked against the
published analysis (ZeRO, Rajbhandari et al. 2020: per device 4Psi of float32 parameters, 8Psi/N of Adam moments,
gradients 4Psi or 4Psi/N; about 2Psi sent per step like data parallelism), the plan's figures against what XLA
compiles (its memory analysis, the dtypes in the HLO), and the curves against plain data parallelism."""

import math
import re

import jax
import numpy as np
import pytest

from conftest import TINY_GPT, overrides
from shard import config
from shard.plan import analysis
from shard.plan import hlo
from shard.run import job

N = 8
STEPS = ["train.steps=6", "run.log_every=1", "run.cpu_devices=8"]


def analyse(tmp_path, *extra):
    return analysis.analyse(config.load(None, overrides(tmp_path, *TINY_GPT, "data.batch_size=32", *extra)),
                            jax.devices())


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    out = {}

    def get(*extra):
        if extra not in out:
            out[extra] = analyse(tmp_path_factory.mktemp("plan"), *extra)
        return out[extra]

    return get


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    """curves(*extra): the losses of TINY_GPT trained 6 steps on 8 devices, once per module."""
    from shard.run import trainer

    out = {}

    def get(*extra):
        if extra not in out:
            cfg = config.load(None, overrides(tmp_path_factory.mktemp("run"), *TINY_GPT, *STEPS, *extra))
            out[extra] = [r["loss"] for r in trainer.run(cfg).history]
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
    # One microbatch: ZeRO-2's program is ZeRO-1's (test_the_plans_memory_is_what_xla_compiles), whole gradients.
    assert zero1["memory_per_device"]["gradients"] == zero2["memory_per_device"]["gradients"] == 4 * psi
    split_sum = plans("mesh=zero2", "train.grad_accum=4")["memory_per_device"]["gradients"]
    assert split_sum == pytest.approx(4 * psi / N, rel=0.01)  # the microbatches' sum, kept split
    ring = 2 * (N - 1) / N * 4 * psi  # an all-reduce, or a reduce-scatter plus an all-gather, of Psi floats
    for p in (dp, zero1, zero2):
        assert p["wire_bytes_per_device"] == pytest.approx(ring, rel=0.02)
    for p in (zero1, zero2):
        table = p["collectives"]
        assert table["reduce-scatter"]["count"] and table["all-gather"]["count"]


def test_the_plans_memory_is_what_xla_compiles(plans):
    """The plan's state per device, from the shardings, against XLA's memory_analysis() of the compiled train
    step (the plan's "arguments" and "temp" are that analysis's own figures). Arguments: the state plus one
    device's batch (int32 inputs and targets, split 8 ways), within 64 bytes: the step counter, Adam's count
    and the like. Gradients are temporaries, so only differences between programs show them: with one
    microbatch ZeRO-2 compiles to ZeRO-1's program (equal temp), so the plan counts equal gradients; under
    accumulation the split sum saves temp, at least half the plan's gradient saving and at most all of it
    (the rest: each microbatch's whole gradient and its reduce-scatter's buffers, which XLA assigns
    differently in the two programs)."""
    batch = 2 * 4 * 32 * 32 // N
    for mesh in ("mesh=dp", "mesh=zero1", "mesh=zero2", "mesh=fsdp"):
        mem = plans(mesh)["memory_per_device"]
        assert 0 <= mem["arguments"] - (mem["params"] + mem["optimizer"] + batch) <= 64, mesh
    one = [plans(m)["memory_per_device"] for m in ("mesh=zero1", "mesh=zero2")]
    assert one[0]["temp"] == one[1]["temp"] and one[0]["gradients"] == one[1]["gradients"]
    k4 = [plans(m, "train.grad_accum=4")["memory_per_device"] for m in ("mesh=zero1", "mesh=zero2")]
    saved, planned = k4[0]["temp"] - k4[1]["temp"], k4[0]["gradients"] - k4[1]["gradients"]
    assert 0.5 * planned <= saved <= planned


def compiled_text(tmp_path, *extra) -> str:
    cfg = config.load(None, overrides(tmp_path, *TINY_GPT, "data.batch_size=32", *extra))
    return job.prepare(cfg, jax.devices(), training=False).train_step.as_text()


def test_bfloat16_reduction_runs_in_bfloat16_and_trains_the_float32_curve(plans, curves):
    """The compiled all-reduce carries the gradients rounded to bfloat16 (XLA's CPU backend widens the
    collective itself to float32; shard/plan/hlo.py reads the rounding), 2 bytes a parameter against 4, and the
    loss follows float32's closely without being float32's."""
    psi = plans("mesh=dp")["param_count"]
    reduced = [plans("mesh=dp", f"train.grad_dtype={d}")["collectives"]["all-reduce"] for d in ("float32", "bfloat16")]
    # Every gradient in 2 bytes instead of 4; the loss and token count (float32 scalars) are reduced apart or not.
    assert abs(reduced[0]["bytes"] - reduced[1]["bytes"] - 2 * psi) <= 8
    fp32, bf16 = np.array(curves("mesh=dp")), np.array(curves("mesh=dp", "train.grad_dtype=bfloat16"))
    np.testing.assert_allclose(bf16, fp32, rtol=1e-2)
    assert bf16[0] == fp32[0] and not np.array_equal(bf16, fp32)  # step 1's loss precedes any update


def test_accum_dtype_is_the_dtype_of_the_microbatch_sum(tmp_path, curves):
    """train.accum_dtype=bfloat16: the microbatch loop carries the gradient sum as Psi bfloat16 numbers (none
    under float32, where the model computes in float32), and the curve stays close to float32's."""
    psi = 34112  # TINY_GPT's parameters (plans("mesh=dp")["param_count"])
    for dtype, expected in (("float32", 0), ("bfloat16", psi)):
        text = compiled_text(tmp_path / dtype, "mesh=dp", "train.grad_accum=2", f"train.accum_dtype={dtype}")
        carried = [sum(math.prod(int(d) for d in dims.split(",") if d)
                       for dt, dims in hlo._ARRAY.findall(m.group(1)) if dt == "bf16")
                   for m in re.finditer(r"=\s*(\(.*?\))\s+while\(", text)]
        assert max(carried) == expected, dtype
    fp32 = np.array(curves("mesh=dp", "train.grad_accum=2"))
    bf16 = np.array(curves("mesh=dp", "train.grad_accum=2", "train.accum_dtype=bfloat16"))
    np.testing.assert_allclose(bf16, fp32, rtol=1e-2)
    assert bf16[0] == fp32[0] and not np.array_equal(bf16, fp32)  # (Adam's normalised step hides most rounding)


def test_zero2_sums_microbatches_split_and_zero1_reduces_once(plans):
    k1, zero1, zero2 = (plans("mesh=zero1"), plans("mesh=zero1", "train.grad_accum=4"),
                        plans("mesh=zero2", "train.grad_accum=4"))
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


def test_zero_and_offload_train_the_data_parallel_curve(curves):
    dp = curves("mesh=dp")
    assert dp[-1] < dp[0]
    for extra in (["mesh=zero1"], ["mesh=zero2", "train.grad_accum=2"], ["mesh=dp", "train.offload=params"]):
        np.testing.assert_allclose(curves(*extra), dp, rtol=1e-5, err_msg=str(extra))


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

    from shard.core import state
    from shard.errors import UserError

    device = SimpleNamespace(platform="cpu", addressable_memories=lambda: [SimpleNamespace(kind="device")])
    state.check_offload("none", device)
    with pytest.raises(UserError, match="train.offload=optimizer .* works on GPU and TPU"):
        state.check_offload("optimizer", device)
