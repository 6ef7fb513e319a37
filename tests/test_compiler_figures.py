"""The target compiler's figures read honestly: loop bodies scaled by their trip counts and nothing else,
matrix products written as padded convolutions counted without their padding, custom-call kernels (Pallas,
cuDNN) counted apart, and the compiler flags each device's family is compiled with (shard/plan/chips.yaml,
run.compiler_flags)."""

import importlib.util
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
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
    cfg = config.load(None, ["run.target=v6e-8", "run.compiler_flags={xla_tpu_scoped_vmem_limit_kib: null, "
                             "--xla_enable_async_all_gather: false, xla_foo: 3}"])
    cpu = SimpleNamespace(platform="cpu")
    flags = target.compiler_flags(cfg.run, cpu)  # the target's family, not this machine's
    assert "xla_tpu_scoped_vmem_limit_kib" not in flags.flags and flags.flags["xla_enable_async_all_gather"] is False
    # the chip's own: Trillium's 96 MiB of scoped VMEM, not v5p's (a core has 64 MiB: its compiles overflowed)
    limit = lambda *a: target.compiler_flags(config.load(None, list(a)).run, cpu).flags.get(  # noqa: E731
        "xla_tpu_scoped_vmem_limit_kib")
    assert limit("run.target=v6e-8") == 98304 and limit("run.target=v5p-8") is None
    tpu = SimpleNamespace(platform="tpu", device_kind="TPU v6 lite")
    assert target.compiler_flags(config.load(None, []).run, tpu).flags["xla_tpu_scoped_vmem_limit_kib"] == 98304
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
def test_the_moe_dropless_under_ep_on_a_tpu_counts_its_grouped_kernels_by_their_estimates(tmp_path):
    """configs/text_moe.yaml dropless under ep on v5p-8, 128 wide: every custom-call kernel is a grouped product's
    (auto's: JAX's megablox gmm and tgmm), each stating its cost, so nothing analytic is added on top of them; they
    hold at least the experts' forward and rows' gradient share (2 x pairs x d x f per expert matrix: 4 layers,
    32 x 64 tokens x top-2, d_model 128, d_ff 256, two matrices)."""
    cfg = config.load("configs/text_moe.yaml", overrides(tmp_path, "model.routing=dropless", "run.target=v5p-8",
                                                         "train.attention=xla", "model.d_model=128", "model.d_ff=256"))
    c = analysis.analyse(cfg, target.devices(target.of(cfg.run)))["compiler"]
    assert c["grouped_kernel_calls"] == c["kernel_calls"] > 0  # every kernel an experts' product, none attention's
    forward = 4 * 2 * (2 * 32 * 64 * 2 * 128 * 256)
    assert c["kernel_flops_per_device"] == 0 and c["kernel_estimated_flops_per_device"] >= 2 * forward / 4


# A grouped product of m rows (k wide) by its group's (k, n) matrix, in a loop of L trips: the forward, the rows'
# gradient and the matrices' gradient, 2 m k n FLOPs each (numpy below), each run once per trip.
M, K, N, G, L = 512, 256, 384, 4, 6
PRODUCT = 2 * int(np.prod([M, K, N]))
OTHER = 1_000_000  # the program's other work, as the cost model counts it
ATTENTION = 7e12  # a work's attention FLOPs, never run here: whoever counts a grouped kernel as attention's shows
# the model's work as the plan's trace gives it: attention's, and the grouped products' forward (one a layer)
GROUPED_WORK = SimpleNamespace(attention_flops=ATTENTION, grouped_flops=L * PRODUCT,
                               data=SimpleNamespace(task="lm", batch_size=1, tokens_per_example=1))


def grouped_program(names: tuple, estimated: bool, op_name: str = "") -> str:
    """HLO text: an L-trip loop whose body runs three grouped products' kernels named `names` (and the helper that
    computes the groups' offsets), each with its Pallas cost estimate or none."""
    estimate = f'"cost_estimate":{{"flops":"{PRODUCT}","bytes_accessed":"8"}},' if estimated else ""
    where = f', metadata={{op_name="{op_name}"}}' if op_name else ""
    calls = "\n".join(f'  %{name} = f32[8]{{0}} custom-call(%a), custom_call_target="{target}", backend_config='
                       f'{{"custom_call_config":{{{estimate}"body":"}}"\n}}}}{where}'
                       for name, target in names)
    return f"""HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %ragged-dot-metadata = (s32[3]{{0}}) custom-call(%s), custom_call_target="tpu_custom_call"
{calls}
}}

ENTRY %main (a: f32[8]) -> f32[8] {{
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{L}"}}}}
}}
"""


def grouped_figures(text: str, stated: float):
    """The plan's compiler figures of `text`, one device, whose cost analysis counted `stated` FLOPs of kernels (the
    TPU cost model counts a kernel's estimate, once per loop body) beside the other work."""
    step = SimpleNamespace(cost_analysis=lambda: {"flops": OTHER + stated})
    return analysis.compiler_figures(step, text, GROUPED_WORK, 0.0, None, 1, "none")


TPU = "tpu_custom_call"


@pytest.mark.parametrize("names,estimated,op_name", [
    ((("gmm_megablox.1", TPU), ("gmm_megablox_transpose_rhs.1", TPU), ("tgmm_megablox.1", TPU)), True, ""),
    ((("ragged-dot-none", TPU), ("ragged-dot-none.1", TPU), ("ragged-dot-none.2", TPU)), True, ""),
    ((("jvp_jit_gmm__.2", TPU), ("transpose_jvp_jit_gmm___.2", TPU), ("transpose_jvp_jit_tgmm___.2", TPU)), True,
     "jit(loss)/transpose(jvp(jit(tgmm)))/pallas_call"),
    ((("triton_a", "__gpu$xla.gpu.triton"), ("triton_b", "__gpu$xla.gpu.triton"),
      ("triton_c", "__gpu$xla.gpu.triton")), False, "jit(step)/tokamax:{}/ragged_dot_general"),
], ids=["tokamax-megablox", "xla-tpu-ragged-dot", "jax-megablox", "triton-no-estimate"])
def test_each_grouped_product_is_counted_once_whatever_kernel_lowered_it(names, estimated, op_name):
    """tokamax's megablox kernels, XLA's own TPU ragged-dot kernels, JAX's megablox and (stating no cost) Triton's:
    the step's FLOPs are the other work plus 3 products x 2 m k n x L trips, by numpy, whether the cost model counted
    the kernels' estimates (for one trip) or nothing; none is taken for attention, none counted twice."""
    c = grouped_figures(grouped_program(names, estimated, op_name), 3 * PRODUCT if estimated else 0.0)
    assert c["grouped_kernel_calls"] == c["kernel_calls"] == 4 * L  # three products and the offsets' helper a trip
    assert c["flops_per_device"] == pytest.approx(OTHER + 3 * L * PRODUCT, rel=1e-9)
    assert c["kernel_flops_per_device"] == (0 if estimated else pytest.approx(3 * L * PRODUCT))


def _ragged_step(product, tpu):
    """Compiled for one chip of a v5p slice: the gradient of an L-layer loop of grouped products of M rows (K wide)
    by each layer's G matrices of (K, N) (the group sizes are the step's argument: a kernel works on all M rows)."""
    from jax.sharding import SingleDeviceSharding

    def put(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(tpu))

    def loss(x, ws, sizes):
        def layer(total, w):
            return total + jnp.sum(product(x, w, sizes).astype(jnp.float32) ** 2), None
        return jax.lax.scan(layer, jnp.zeros(()), ws)[0]

    with jax.default_device(tpu):  # tokamax picks its kernel by the default device
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(put((M, K)), put((L, G, K, N)),
                                                              put((G,), jnp.int32)).compile()


@needs_libtpu
@pytest.mark.parametrize("kernel", ["tokamax", "xla"])
def test_a_compiled_grouped_product_counts_its_kernels_once_each_run(kernel):
    """The TPU compiler's own program: tokamax's megablox kernels (forward, rows' gradient, matrices' gradient) give
    the step 3 x 2 m k n x L FLOPs (numpy) and the cost model's small rest; XLA's ragged_dot keeps the forward and
    the rows' gradient as kernels (2 x 2 m k n x L by their estimates) and computes the matrices' gradient as a
    dense product per group over every row (G x 2 m k n x L, counted with the other products). Nothing analytic is
    added: every kernel states its cost."""
    tpu = target.devices(target.parse("v5p-8"))[0]
    if kernel == "tokamax":
        tokamax = pytest.importorskip("tokamax")
        from absl import flags
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        product = lambda x, w, sizes: tokamax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype,  # noqa: E731
                                                         implementation="mosaic")
    else:
        product = jax.lax.ragged_dot
    step = _ragged_step(product, tpu)
    c = analysis.compiler_figures(step, step.as_text(), GROUPED_WORK, 0.0, None, 1, "none")
    assert c["kernel_flops_per_device"] == 0 and c["grouped_kernel_calls"] > 0
    if kernel == "tokamax":
        assert c["kernel_estimated_flops_per_device"] == 3 * L * PRODUCT
        assert c["flops_per_device"] == pytest.approx(3 * L * PRODUCT, rel=0.01)
    else:
        assert c["kernel_estimated_flops_per_device"] == 2 * L * PRODUCT
        assert c["flops_per_device"] == pytest.approx((2 + G) * L * PRODUCT, rel=0.01)
