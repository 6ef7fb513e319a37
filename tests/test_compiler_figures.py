"""The target compiler's figures read honestly: loop bodies scaled by their trip counts and nothing else,
matrix products written as padded convolutions counted without their padding, custom-call kernels (Pallas,
cuDNN) counted apart, and the compiler flags each device's family is compiled with (shard/plan/chips.yaml,
run.compiler_flags)."""

import importlib.util
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from conftest import TINY_GPT, overrides, run_cli
from shard import config
from shard.plan import analysis
from shard.core import step as step_lib
from shard.errors import UserError
from shard.plan import hlo
from shard.plan import target

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")

# An entry that costs 100 cycles outside its loop and a 20-trip loop whose body costs 50 and runs a kernel.
LOOPED = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %f = f32[8]{0} fusion(%x), kind=kOutput, calls=%fused, backend_config={"window_config":{"estimated_cycles":"50"}}
  %k = f32[8]{0} custom-call(%f), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":
{"body": "}"}
}
}

%fused (a: f32[8]) -> f32[8] {
  ROOT %m = f32[8]{0} multiply(%a, %a)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %o = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused, backend_config={"window_config":{"estimated_cycles":"100"}}
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"20"}}
}
"""


def test_only_loop_bodies_scale_by_their_trip_counts():
    scale, basis = hlo.loop_scale(LOOPED)
    assert scale == pytest.approx((100 + 20 * 50) / (100 + 50)) and "cycle" in basis
    assert hlo.kernel_calls(LOOPED) == 20


def test_without_cycle_estimates_the_scale_is_weighed_by_matrix_products():
    text = LOOPED.replace('"estimated_cycles":"50"', '"x":"0"').replace('"estimated_cycles":"100"', '"x":"0"')
    text = text.replace("%k = f32[8]{0} custom-call", "%d = f32[8,8]{1,0} dot(f32[8,4]{1,0} %a, f32[4,8]{1,0} %b), "
                        "lhs_contracting_dims={1}, rhs_contracting_dims={0}\n  %k = f32[8]{0} custom-call")
    scale, basis = hlo.loop_scale(text)
    assert scale == pytest.approx(20.0) and basis == "matrix-product FLOPs"


@pytest.mark.parametrize("window,per_output", [
    ("size=1x4 pad=0_0x3_3 rhs_reversal=0x1", 4 * 1 * (4 / 4)),  # 4 outputs, each sees 1 of its 4 window places
    ("size=1x1", 4.0),
    ("size=1x2 stride=1x2", 4.0 * 2),
])
def test_a_convolution_counts_the_window_places_on_its_input_not_its_padding(window, per_output):
    # lhs (spatial0=4, batch=64, features=4, spatial1=1) x rhs (in=4, spatial1=W, out=128, spatial0=1)
    size = int(window.split("x")[1].split()[0])
    width = 1 if "pad" in window else size * (2 if "stride" in window else 1)
    text = f"""HloModule m

ENTRY %main (a: bf16[4,64,4,{width}], b: bf16[4,{size},128,1]) -> bf16[4,64,4,128] {{
  %a = bf16[4,64,4,{width}]{{3,2,1,0}} parameter(0)
  %b = bf16[4,{size},128,1]{{3,2,1,0}} parameter(1)
  ROOT %c = bf16[4,64,4,128]{{3,2,1,0}} convolution(%a, %b), window={{{window}}}, dim_labels=0bf1_i1o0->0b1f
}}
"""
    outputs = 4 * 64 * 4 * 128
    assert hlo.dot_flops(text, convolutions=True) == pytest.approx(2 * outputs * per_output)


def test_window_hits_equal_counting_every_place():
    for outputs, size, stride, dilate, low, extent in [(4, 4, 1, 1, 3, 1), (7, 3, 2, 1, 2, 9), (5, 2, 1, 2, 0, 4),
                                                       (3, 5, 3, 1, 4, 6)]:
        brute = sum(1 for o in range(outputs) for w in range(size) if 0 <= o * stride + w * dilate - low < extent)
        assert hlo._hits(outputs, size, stride, dilate, low, extent, 1) == brute


def test_recommended_flags_follow_the_family_and_the_user_adds_or_drops_them():
    cfg = config.load(None, ["run.target=v5p-8", "run.compiler_flags={xla_tpu_scoped_vmem_limit_kib: null, "
                             "--xla_enable_async_all_gather: false, xla_foo: 3}"])
    cpu = SimpleNamespace(platform="cpu")
    flags = target.compiler_flags(cfg.run, cpu)  # the target's family, not this machine's
    assert "xla_tpu_scoped_vmem_limit_kib" not in flags.flags and flags.flags["xla_enable_async_all_gather"] is False
    assert (flags.flags["xla_tpu_enable_async_collective_fusion"] is True
            and flags.users == {"xla_enable_async_all_gather", "xla_foo"})
    gpu = target.compiler_flags(config.load(None, []).run, SimpleNamespace(platform="gpu"))
    assert gpu.flags["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert target.compiler_flags(config.load(None, []).run, cpu).flags == {}
    off = config.load(None, ["run.target=v5p-8", "run.recommended_flags=false"])
    assert target.compiler_flags(off.run, cpu).flags == {}


def test_a_recommended_flag_the_compiler_does_not_know_is_dropped_and_a_users_refused():
    lowered = jax.jit(lambda a: a * 2).lower(jnp.ones(4))
    flags = target.CompilerFlags({"xla_cpu_enable_fast_math": False, "xla_no_such_flag": True})
    assert step_lib.compile_with(lowered, flags)(jnp.ones(4)).tolist() == [2.0] * 4
    assert flags.dropped == ["xla_no_such_flag"] and list(flags.flags) == ["xla_cpu_enable_fast_math"]
    with pytest.raises(UserError, match="run.compiler_flags: this compiler has no flag 'xla_no_such_flag'"):
        step_lib.compile_with(lowered, target.CompilerFlags({"xla_no_such_flag": True},
                                                            frozenset({"xla_no_such_flag"})))


def test_an_unknown_compiler_flag_is_one_line_and_exit_2(tmp_path):
    r = run_cli(*overrides(tmp_path, *TINY_GPT), "train.steps=1", "run.compiler_flags={xla_tpu_foo: true}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].endswith(
        "run.compiler_flags: this compiler has no flag 'xla_tpu_foo' (a libtpu flag needs a TPU or "
        "run.target=<TPU slice>; an XLA GPU flag a GPU or run.target=<GPUs>)")


# Wide enough that the step is compute-bound on a v5p chip (the cost model's per-loop overheads are small).
WIDE_GPT = ["model.name=gpt", "model.vocab_size=512", "model.d_model=1024", "model.n_layers=3", "model.n_heads=8",
            "model.d_ff=4096", "model.max_len=512", "data.name=text", "data.seq_len=512", "data.batch_size=16",
            "train.dtype=bfloat16", "mesh=fsdp", "train.remat=full"]


@needs_libtpu
@pytest.mark.slow
def test_a_scanned_and_an_unrolled_compile_give_the_same_estimate(tmp_path):
    """The corrected scaling: the scanned program's estimate (its loop bodies' share times their trips) within
    5% of the same model's program with every layer written out (no loop to scale), FLOPs within 2%."""
    figures = []
    for scan in ("true", "false"):
        cfg = config.load(None, overrides(tmp_path, *WIDE_GPT, "run.target=v5p-8", f"train.scan_layers={scan}"))
        p = analysis.analyse(cfg, target.devices(target.of(cfg.run)))
        figures.append(p["compiler"])
        assert "xla_tpu_enable_async_collective_fusion=True" in analysis.report(p)  # the flags the compile used
    scanned, unrolled = figures
    assert scanned["loop_factor"] > 2 and unrolled["loop_factor"] == pytest.approx(1.0)
    assert scanned["step_s"] == pytest.approx(unrolled["step_s"], rel=0.05)
    assert scanned["flops_per_device"] == pytest.approx(unrolled["flops_per_device"], rel=0.02)


@needs_libtpu
def test_tokamax_grouped_kernels_on_a_tpu_are_counted_as_the_experts_work(tmp_path):
    """configs/text_moe.yaml dropless under ep on v5p-8: auto takes tokamax's Mosaic kernel for the experts' grouped
    products (custom calls the cost model cannot see), and the plan adds their analytic FLOPs, not attention's:
    forward, then two products each in the backward pass, of 2 x pairs x d x f per expert matrix (NumPy-free
    arithmetic from the config: 4 layers, 32 x 64 tokens x top-2, d_model 96, d_ff 192, gelu: two matrices)."""
    pytest.importorskip("tokamax")
    cfg = config.load("configs/text_moe.yaml", overrides(tmp_path, "model.routing=dropless", "run.target=v5p-8",
                                                         "train.attention=xla"))
    c = analysis.analyse(cfg, target.devices(target.of(cfg.run)))["compiler"]
    assert c["grouped_kernel_calls"] == c["kernel_calls"] > 0  # every kernel an experts' product, none attention's
    forward = 4 * 2 * (2 * 32 * 64 * 2 * 96 * 192)
    assert c["kernel_flops_per_device"] == pytest.approx(3 * forward / 4)
