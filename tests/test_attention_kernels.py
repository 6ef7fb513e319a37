"""The attention kernels of shard/nn/attention.py: Pallas' splash kernel (run by Pallas' interpreter on the CPU)
gives the XLA kernel's outputs and gradients, alone and per device under a mesh; `auto` picks each device's
kernel; explicit kernels that cannot run are one line; bfloat16 logits stay close to float32 ones; a sliding
window masks and counts its FLOPs; a TPU target's step runs the splash kernel (Mosaic's custom call)."""

import importlib.util
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_GPT, overrides, run_cli
from shard import config
from shard.nn import attention, hooks, partition, splash
from shard.errors import UserError

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")

CPU, TPU = SimpleNamespace(platform="cpu", device_kind="cpu"), SimpleNamespace(platform="tpu", device_kind="TPU v5")
H100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
# A GPT the splash kernel takes: its length a multiple of the kernel's 128-wide tiles.
SPLASH_GPT = ["model.name=gpt", "model.vocab_size=256", "model.d_model=256", "model.n_layers=2", "model.n_heads=2",
              "model.d_ff=256", "model.max_len=128", "data.name=text", "data.seq_len=128", "data.batch_size=8"]


def inputs(batch=2, length=256, heads=4, kv_heads=2, dim=64, seed=0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, length, heads, dim), dtype)
    return (q, jax.random.normal(kk, (batch, length, kv_heads, dim), dtype),
            jax.random.normal(kv, (batch, length, kv_heads, dim), dtype))


def documents(batch, length):
    """Segment ids: row 0 three documents and padding (id 0), the others two halves."""
    ids = np.tile(np.repeat([1, 2], length // 2), (batch, 1))
    ids[0] = np.repeat([1, 2, 3, 0], length // 4)
    return jnp.asarray(ids, jnp.int32)


def reference(q, k, v, causal, segments=None, window=None):
    """jax.nn.dot_product_attention with the window and documents as its own arguments."""
    mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
    sides = None if window is None else (window - 1, 0 if causal else window - 1)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, local_window_size=sides)


@pytest.mark.parametrize("causal,packed,window,heads,kv_heads", [
    (True, False, None, 4, 2),    # causal, grouped heads
    (True, True, 100, 2, 1),      # documents and a window across the kernel's tiles, one key/value head (MQA)
    (False, True, None, 2, 2),    # full attention over documents
    (False, False, 60, 2, 2),     # a two-sided window
])
def test_splash_gives_the_xla_kernels_outputs_and_gradients(causal, packed, window, heads, kv_heads):
    q, k, v = inputs(length=384, heads=heads, kv_heads=kv_heads, dim=32)  # 3 tiles of 128
    segments = documents(2, 384) if packed else None
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    ours = lambda q, k, v: splash.splash(q, k, v, causal, segments, window, interpret=True)  # noqa: E731
    xla = lambda q, k, v: attention.xla_cpu(q, k, v, causal, segments, window)  # noqa: E731
    np.testing.assert_allclose(ours(q, k, v), reference(q, k, v, causal, segments, window), atol=2e-5)
    np.testing.assert_allclose(xla(q, k, v), reference(q, k, v, causal, segments, window), atol=2e-6)
    for got, want in zip(jax.grad(loss(ours), (0, 1, 2))(q, k, v), jax.grad(loss(xla), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, atol=5e-5)


def test_splash_runs_on_each_devices_block_under_a_mesh():
    """Batch over data, heads over tensor (key/value heads with their query heads), bfloat16 inputs."""
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    q, k, v = inputs(batch=4, length=128, heads=4, kv_heads=2, dtype=jnp.bfloat16)
    segments = documents(4, 128)
    with partition.activate(mesh, partition.merged_rules(None, mesh.axis_names)):
        layout = splash.layout(q.shape, k.shape)
        run = jax.jit(lambda q, k, v, s: splash.splash(q, k, v, True, s, layout=layout, interpret=True))
        out = run(q, k, v, segments)
    assert layout.q == jax.sharding.PartitionSpec("data", None, "tensor", None)
    want = reference(*(a.astype(jnp.float32) for a in (q, k, v)), True, segments)
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=2e-2)
    with partition.activate(mesh, partition.merged_rules(None, mesh.axis_names)):
        # 3 key/value heads do not split over 2 devices: every device gets the whole heads
        assert splash.layout((4, 128, 6, 64), (4, 128, 3, 64)).q[2] is None


@pytest.mark.parametrize("kernel,device,dtype,length,packed,window,want", [
    ("auto", CPU, jnp.bfloat16, 128, False, None, "xla"),
    ("auto", TPU, jnp.float32, 256, True, 64, "splash"),
    ("auto", TPU, jnp.bfloat16, 100, False, None, "xla"),       # not whole tiles
    ("auto", H100, jnp.bfloat16, 100, False, 16, "cudnn"),
    ("auto", H100, jnp.float32, 128, False, None, "xla"),        # cuDNN takes half precision
    ("auto", H100, jnp.bfloat16, 128, True, None, "xla"),        # no segment ids
    ("auto", SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI300X"), jnp.bfloat16, 128, False, None, "xla"),
    ("xla", TPU, jnp.bfloat16, 128, False, None, "xla"),
])
def test_auto_picks_the_devices_kernel_where_the_call_fits_it(kernel, device, dtype, length, packed, window, want):
    q = jax.ShapeDtypeStruct((2, length, 4, 64), dtype)
    segments = jnp.ones((2, length), jnp.int32) if packed else None
    assert attention.choose(kernel, q, q, segments, window, True, device=device) == want


def test_explicit_kernels_that_cannot_take_a_call_are_one_line():
    q = jax.ShapeDtypeStruct((2, 100, 4, 64), jnp.bfloat16)
    with pytest.raises(UserError, match="train.attention=splash needs sequence lengths that are multiples of 128"):
        attention.choose("splash", q, q, device=TPU)
    with pytest.raises(UserError, match="a causal mask with a sliding window"):
        attention.choose("cudnn", q, q, window=8, is_causal=False, device=H100)
    with pytest.raises(UserError, match="train.attention=splash is a TPU kernel"):
        attention.check("splash", CPU, jnp.float32)
    with pytest.raises(UserError, match="train.attention=cudnn needs an NVIDIA GPU"):
        attention.check("cudnn", TPU, jnp.bfloat16)
    attention.check("auto", CPU, jnp.float32)  # auto never refuses


@pytest.mark.parametrize("kernel", ["splash", "cudnn"])
def test_a_kernel_the_cpu_cannot_run_is_one_line_and_exit_2(tmp_path, kernel):
    r = run_cli(*overrides(tmp_path, *TINY_GPT), f"train.attention={kernel}", "train.dtype=bfloat16", "train.steps=1")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and f"train.attention={kernel}" in r.stderr, r.stderr


def bfloat16_reference(q, k, v, segments):
    """MaxText's bfloat16 attention (causal, over documents) written in NumPy with ml_dtypes' bfloat16: logits of
    the scaled queries and the keys rounded to bfloat16 (products summed in float32), exp(logit - row max) rounded
    to bfloat16, its product with the bfloat16 values summed in float32, divided by the float32 row sums."""
    from ml_dtypes import bfloat16

    bf = lambda x: np.asarray(x, np.float32).astype(bfloat16).astype(np.float32)  # noqa: E731
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    _, t, heads, d = q.shape
    k, v = (np.repeat(a, heads // k.shape[2], axis=2) for a in (k, v))  # query head h reads kv head h // group
    logits = bf(np.einsum("bqhd,bkhd->bhqk", bf(q * np.float32(d ** -0.5)), bf(k)))
    seg = np.asarray(segments)
    seen = np.tril(np.ones((t, t), bool)) & (seg[:, :, None] == seg[:, None, :])[:, None]
    logits = np.where(seen, logits, -np.inf)
    weights = bf(np.exp(bf(logits - logits.max(-1, keepdims=True))))
    return np.einsum("bhqk,bkhd->bqhd", weights, bf(v)) / weights.sum(-1).transpose(0, 2, 1)[..., None]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_bfloat16_logits_stay_close_to_float32_on_both_xla_paths(kv_heads):
    q, k, v = inputs(length=64, heads=4, kv_heads=kv_heads, dim=16)
    segments = documents(2, 64)
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    exact = lambda q, k, v: attention.xla_cpu(q, k, v, True, segments)  # noqa: E731
    rounded = bfloat16_reference(q, k, v, segments)
    for path in (attention.xla_cpu, attention.xla_grouped):
        low = lambda q, k, v: path(q, k, v, True, segments, None, "bfloat16")  # noqa: E731
        out = low(q, k, v)
        assert out.dtype == q.dtype
        np.testing.assert_allclose(out, exact(q, k, v), atol=3e-2)
        # the bfloat16 arithmetic itself: the reference's outputs to 1e-5 but where a float32 sum's order rounds a
        # logit the other way (float32 logits and softmax match under 1% of them)
        assert np.mean(np.abs(np.asarray(out) - rounded) < 1e-5) > 0.95, path.__name__
        for got, want in zip(jax.grad(loss(low), (0, 1, 2))(q, k, v), jax.grad(loss(exact), (0, 1, 2))(q, k, v)):
            np.testing.assert_allclose(got, want, atol=6e-2)
    np.testing.assert_allclose(attention.xla_grouped(q, k, v, True, segments, None, "float32"), exact(q, k, v),
                               atol=2e-6)


def test_bfloat16_attention_trains_as_float32_does(train):
    curves = {p: [h["loss"] for h in train(*TINY_GPT, "train.steps=4", "run.log_every=1", "run.cpu_devices=1",
                                           f"train.attention_precision={p}", subdir=p).history]
              for p in ("float32", "bfloat16")}
    np.testing.assert_allclose(curves["bfloat16"], curves["float32"], rtol=1e-2)
    assert curves["bfloat16"] != curves["float32"]  # the setting reached the kernel


def test_attention_names_its_inputs_and_output_and_counts_a_windows_flops():
    q, k, v = inputs(batch=1, length=8, heads=2, kv_heads=1, dim=4)
    jaxpr = jax.make_jaxpr(lambda q, k, v: hooks.attention(q, k, v, is_causal=True, window=3))(q, k, v)
    names = [e.params["name"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "name"]
    assert names == [attention.QUERY, attention.KEY, attention.VALUE, attention.OUTPUT]
    call = next(e.params["name"] for e in jaxpr.jaxpr.eqns if e.primitive.name in ("pjit", "jit"))
    assert attention.call_of(call) == (True, 3, None)
    # query i sees keys i-2..i: 1 + 2 + 3 x 6 pairs, 2 FLOPs x (4 + 4) each, 2 heads
    assert attention.flops(q.shape, k.shape, v.shape, True, 3) == 2 * 2 * 21 * 8
    assert attention.flops(q.shape, k.shape, v.shape, True) == 2 * 2 * 36 * 8  # causal: L(L+1)/2 pairs
    np.testing.assert_allclose(hooks.attention(q, k, v, is_causal=True, window=3), reference(q, k, v, True, None, 3),
                               atol=2e-6)


def target_config(tmp_path, *extra):
    return config.load(None, overrides(tmp_path, *SPLASH_GPT, "run.target=v5p-8", *extra))


@needs_libtpu
def test_auto_traces_splash_for_a_tpu_target_and_counts_the_same_flops(tmp_path):
    from shard.plan import target
    from shard.run import job

    devices = target.devices(target.of(target_config(tmp_path).run))
    works = {kernel: job.workload(target_config(tmp_path, f"train.attention={kernel}"), devices)
             for kernel in ("auto", "xla")}
    assert works["auto"].flops_per_step == works["xla"].flops_per_step  # the kernel's own products not counted
    with hooks.use(attention="auto"), attention.configured(device=devices[0]):
        assert "pallas_call" in str(jax.make_jaxpr(lambda q: hooks.attention(q, q, q, is_causal=True))(
            jnp.zeros((2, 128, 2, 128))))


@pytest.mark.slow
@needs_libtpu
def test_a_tpu_targets_step_runs_the_splash_kernel(tmp_path):
    """auto on a v5p-8 under FSDP x tensor: the compiled step holds Mosaic's custom calls (forward, dq, dkv)."""
    from shard.plan import target
    from shard.run import job

    cfg = target_config(tmp_path, "mesh=fsdp_tp", "mesh.tensor=2")
    compiled = job.prepare(cfg, target.devices(target.of(cfg.run)), training=False).train_step
    assert compiled.as_text().count("tpu_custom_call") >= 3


@pytest.mark.slow
@needs_libtpu
def test_a_dry_run_with_splash_for_a_tpu_target_compiles(tmp_path):
    r = run_cli(*overrides(tmp_path, *SPLASH_GPT), "run.target=v5p-8", "mesh=fsdp", "train.attention=splash",
                "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compile-only devices of v5p-8" in r.stdout


def numpy_attention(q, k, v, causal, window=0, softcap=None, scale=None, segments=None):
    """Attention written out in NumPy (float64): window 0 is global."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    apart = np.arange(q.shape[1])[:, None] - np.arange(k.shape[1])[None, :]
    seen = (apart >= 0 if causal else np.ones_like(apart, bool)) & ((np.abs(apart) < window) | (window == 0))
    seen = seen[None, None] if segments is None else seen & (segments[:, :, None] == segments[:, None, :])[:, None]
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


LAYER_WINDOWS = (3, 0, 5)  # three layers of one stack: local, global, local


@pytest.mark.parametrize("kernel,causal,packed,softcap,scale,precision,device", [
    ("xla", True, False, None, None, "float32", None),     # xla_cpu, a traced window per layer
    ("xla", True, True, 2.0, 0.3, "float32", None),        # soft-capped and scaled, with documents
    ("xla", False, False, 1.5, None, "bfloat16", None),    # two-sided windows, bfloat16 logits
    ("xla", True, True, 2.0, 0.3, "float32", H100),        # xla_grouped: XLA's kernel off the CPU
    ("splash", True, True, 2.0, 0.3, "float32", None),     # a fused kernel per distinct window, by jax.lax.switch
])
def test_per_layer_windows_softcap_and_scale_equal_numpy(monkeypatch, kernel, causal, packed, softcap, scale,
                                                         precision, device):
    """A scan over three layers whose windows are traced ints (0: global), as a stacked model's PerLayer values
    reach the hook; against attention written out in NumPy. Its FLOPs: the mean over the layers' windows."""
    length = 128 if kernel == "splash" else 16
    q, k, v = inputs(batch=2, length=length, heads=4, kv_heads=2, dim=8)
    segments = documents(2, length) if packed else None
    if kernel == "splash":  # Pallas' interpreter on the CPU
        monkeypatch.setattr(splash, "splash", lambda *a, **kw: SPLASH(*a, **kw, interpret=True))

    def layers(q, k, v):
        def one(carry, w):
            with hooks.use(attention=kernel), hooks.packed(segments, None):
                return carry, hooks.attention(q, k, v, is_causal=causal, window=(w, LAYER_WINDOWS), softcap=softcap,
                                              scale=scale)
        return jax.lax.scan(one, 0, jnp.asarray(LAYER_WINDOWS, jnp.int32))[1]

    with attention.configured(precision, device):
        got = jax.jit(layers)(q, k, v)
        jaxpr = jax.make_jaxpr(layers)(q, k, v)
    tol = 2e-2 if precision == "bfloat16" else 2e-5
    for i, w in enumerate(LAYER_WINDOWS):
        want = numpy_attention(q, k, v, causal, w, softcap, scale, None if segments is None else np.asarray(segments))
        np.testing.assert_allclose(got[i], want, atol=tol, err_msg=f"layer {i}, window {w}")
    per_layer = [attention.flops(q.shape, k.shape, v.shape, causal, w or None) for w in LAYER_WINDOWS]
    from shard.core import flops
    assert flops.attention_flops(jaxpr.jaxpr) == pytest.approx(sum(per_layer))


SPLASH = splash.splash


def test_cudnn_takes_no_softcap_and_auto_falls_back():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(UserError, match="no attention-logit soft-capping") as e:
        attention.choose("cudnn", q, q, softcap=50.0, device=H100)
    assert "\n" not in str(e.value)
    assert attention.choose("auto", q, q, softcap=50.0, device=H100) == "xla"
    assert attention.choose("auto", q, q, window=(jnp.int32(4), (4, 0)), device=H100) == "cudnn"
