"""Attention sinks (GPT-OSS's): one learned logit per query head joins the softmax's denominator and weighs no
value. Every path of shard.nn.hooks.attention takes them: XLA's kernels (the CPU's, the grouped one, the one that
stands in for jax.nn.dot_product_attention), splash's (Pallas' interpreter), context parallelism's ring and
all_gather, and generation's caches. Each is checked against attention written out here: NumPy in float64 for the
outputs, jax.grad of the same written in jax.numpy for the gradients of q, k, v and the sinks; none of the project's
kernels is a reference."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard.core import flops
from shard.core import mesh as mesh_lib
from shard.errors import UserError
from shard.nn import attention, decoding, hooks, partition, ring, softmax, splash

CPU, TPU = SimpleNamespace(platform="cpu", device_kind="cpu"), SimpleNamespace(platform="tpu", device_kind="TPU v5")
H100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")

SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)  # four query heads over two key/value heads


def written(xp, q, k, v, sinks, causal, window=0, softcap=None, scale=None, segments=None, qpos=None, kpos=None):
    """Attention with sinks as transformers' GPT-OSS eager_attention_forward writes it, in NumPy (xp=np, float64)
    or jax.numpy (xp=jnp, for jax.grad): the scaled (capped, masked) logits and a column of each head's sink
    concatenated, softmax after subtracting the row maximum, the sink's column dropped, the product with v.
    window 0: global; qpos/kpos: positions (default 0..length-1); segments: (batch, length) document ids."""
    if xp is np:
        q, k, v, sinks = (np.asarray(a, np.float64) for a in (q, k, v, sinks))
    b, t, h, d = q.shape
    groups = h // k.shape[2]
    k, v = xp.repeat(k, groups, axis=2), xp.repeat(v, groups, axis=2)  # query head h reads kv head h // groups
    s = xp.einsum("bthd,bshd->bhts", q, k) * (d ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * xp.tanh(s / softcap)
    qpos = np.arange(t) if qpos is None else np.asarray(qpos)
    kpos = np.arange(k.shape[1]) if kpos is None else np.asarray(kpos)
    apart = qpos[..., :, None] - kpos[..., None, :]  # (t, s) or (b, t, s)
    seen = (apart >= 0 if causal else np.ones(apart.shape, bool)) & ((np.abs(apart) < window) | (window == 0))
    seen = seen[..., None, :, :] if seen.ndim == 3 else seen[None, None]
    if segments is not None:
        segments = np.asarray(segments)
        seen = seen & (segments[:, :, None] == segments[:, None, :])[:, None]
    s = xp.where(seen, s, -xp.inf)
    both = xp.concatenate([s, xp.broadcast_to(sinks[None, :, None, None], (b, h, t, 1))], axis=-1)
    p = xp.exp(both - both.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return xp.einsum("bhts,bshd->bthd", p[..., :-1], v)


def inputs(batch=2, length=8, heads=4, kv_heads=2, dim=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (batch, length, heads, dim)),
            *(jax.random.normal(key, (batch, length, kv_heads, dim)) for key in keys[1:3]),
            jax.random.normal(keys[3], (batch, length, heads, dim)))  # the last: a loss's weights


def documents(batch, length):
    """Row 0 two documents and padding (id 0), row 1 one document."""
    ids = np.ones((batch, length), np.int32)
    ids[0] = np.repeat([1, 2, 0, 0], length // 4)
    return jnp.asarray(ids)


def value_and_grads(fn):
    """fn(q, k, v, sinks, ...) and the gradients of sum(fn * weights) by q, k, v and the sinks, compiled once."""
    grads = jax.grad(lambda q, k, v, s, w, *a: jnp.sum(fn(q, k, v, s, *a) * w), argnums=(0, 1, 2, 3))
    return jax.jit(lambda q, k, v, s, w, *a: (fn(q, k, v, s, *a), *grads(q, k, v, s, w, *a)))


def assert_close(got, want, tol, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)), (what, i)
        np.testing.assert_allclose(g, w, atol=tol * np.abs(w).max(), rtol=0, err_msg=f"{what}: output/grad {i}")


# ----------------------------------------------------------------------------- one device: XLA and splash

LAYER_WINDOWS = (5, 0)  # a stack of a local layer and a global one: the window a traced int


@pytest.mark.parametrize("kernel,device,precision,causal,window,packed,softcap,scale", [
    ("xla", None, "float32", True, None, False, None, None),     # xla_cpu
    ("xla", None, "float32", True, 5, True, 2.0, 0.3),           # xla_cpu: window, documents, soft-cap, scale
    ("xla", None, "bfloat16", False, 3, False, None, None),      # xla_cpu's bfloat16 logits, a two-sided window
    ("xla", H100, "float32", True, 5, True, None, None),         # what jax.nn.dot_product_attention ran: xla_grouped
    ("xla", H100, "float32", True, "traced", True, 2.0, 0.3),    # xla_grouped: a layer's traced window, soft-cap
    ("xla", H100, "bfloat16", True, None, False, None, None),    # xla_grouped's bfloat16 logits
    ("auto", H100, "float32", False, None, True, None, None),    # auto on a GPU: XLA's; full attention, documents
])
def test_the_hook_with_sinks_equals_attention_written_out(kernel, device, precision, causal, window, packed, softcap,
                                                          scale):
    """shard.nn.hooks.attention with sinks, grouped heads (4 over 2): outputs against NumPy, gradients of q, k, v and
    the sinks against jax.grad of the written-out softmax with its sink column. The call is still the named one
    whose FLOPs shard/core/flops.py counts."""
    q, k, v, weights = inputs()
    segments = documents(2, 8) if packed else None

    def hook(q, k, v, sinks, w=None):
        with hooks.use(attention=kernel), hooks.packed(segments, None):
            return hooks.attention(q, k, v, is_causal=causal, window=window if w is None else (w, LAYER_WINDOWS),
                                   softcap=softcap, scale=scale, sinks=sinks)

    def reference(q, k, v, sinks, w=0):
        return written(jnp, q, k, v, sinks, causal, w, softcap, scale, segments)

    tol = 3e-2 if precision == "bfloat16" else 2e-5
    sinks = jnp.asarray(SINKS)
    with attention.configured(precision, device):
        ours = value_and_grads(hook)
        for w in LAYER_WINDOWS if window == "traced" else (None,):
            layer = () if w is None else (jnp.int32(w),)
            fixed = (window or 0) if w is None else w
            want = (written(np, q, k, v, SINKS, causal, fixed, softcap, scale, segments),
                    *value_and_grads(reference)(q, k, v, sinks, weights, fixed)[1:])
            assert_close(ours(q, k, v, sinks, weights, *layer), want, tol, f"window {fixed}")
        jaxpr = jax.make_jaxpr(hook)(q, k, v, sinks, *layer)
    counted = ((0, 1), (5, 1)) if window == "traced" else window  # a stack's windows: the mean over its layers
    assert flops.attention_flops(jaxpr.jaxpr) == attention.flops(q.shape, k.shape, v.shape, causal, counted)


def test_sinks_change_the_output_and_a_query_that_sees_nothing_gives_zero():
    """The sink matters (sinks of -inf give plain attention); a row whose every key is masked comes out finite, zero,
    on XLA's kernel and in the online softmax (generation's and the ring's)."""
    q, k, v, _ = inputs(batch=1, length=4)
    plain = attention.xla_cpu(q, k, v, True)
    assert float(jnp.max(jnp.abs(attention.xla_cpu(q, k, v, True, sinks=SINKS) - plain))) > 1e-2
    np.testing.assert_allclose(attention.xla_cpu(q, k, v, True, sinks=jnp.full(4, -jnp.inf)), plain, atol=1e-6)
    mask = jnp.ones((1, 1, 1, 4, 4), bool).at[..., 2, :].set(False)  # query 2 sees no key
    out = attention.grouped(q, k, v, mask, sinks=SINKS)
    assert np.all(np.isfinite(out)) and float(jnp.max(jnp.abs(out[:, 2]))) == 0.0
    sink = attention.sink_logits(SINKS, 2)  # (kv_heads, group, 1): queries laid out (batch, kv, group, length)
    state = softmax.fold(softmax.start((1, 2, 2, 4), 8, sink), jnp.full((1, 2, 2, 4, 3), -jnp.inf),
                         jnp.ones((1, 3, 2, 8)), "bkgqs,bskd->bkgqd")
    out, lse = softmax.finish(state)
    assert np.all(np.isfinite(out)) and float(jnp.max(jnp.abs(out))) == 0.0
    np.testing.assert_allclose(lse, jnp.broadcast_to(sink, (1, 2, 2, 4)))


@pytest.mark.parametrize("causal,window,packed,heads,kv_heads", [
    (True, 100, True, 4, 2),      # grouped heads, documents and a window across the tiles
    (False, None, False, 2, 1),   # one key/value head: the kernel's MQA form
])
def test_splash_takes_sinks(causal, window, packed, heads, kv_heads):
    """Pallas' splash kernel (its interpreter, on the CPU) with its own sinks: outputs and gradients as written out."""
    q, k, v, weights = inputs(length=128, heads=heads, kv_heads=kv_heads)
    sinks = jnp.asarray(SINKS[:heads])
    segments = documents(2, 128) if packed else None
    ours = lambda q, k, v, s: splash.splash(q, k, v, causal, segments, window, sinks=s, interpret=True)  # noqa: E731
    ref = lambda q, k, v, s: written(jnp, q, k, v, s, causal, window or 0, segments=segments)  # noqa: E731
    want = (written(np, q, k, v, sinks, causal, window or 0, segments=segments),
            *value_and_grads(ref)(q, k, v, sinks, weights)[1:])
    assert_close(value_and_grads(ours)(q, k, v, sinks, weights), want, 5e-5, "splash")


@pytest.mark.slow
def test_splash_with_sinks_under_a_mesh_and_per_layer_windows(monkeypatch):
    """The hook's splash path: each device's query heads' sinks (heads over tensor, the batch over data), and a
    layer's traced window choosing the kernel compiled for it (jax.lax.switch, the sinks in every branch)."""
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    monkeypatch.setattr(splash, "splash", lambda *a, **kw: SPLASH(*a, **kw, interpret=True))
    q, k, v, weights = inputs(length=128)
    sinks = jnp.asarray(SINKS)

    def hook(q, k, v, s, w):
        with hooks.use(attention="splash"), partition.activate(mesh, partition.merged_rules(None, mesh.axis_names)):
            return hooks.attention(q, k, v, is_causal=True, window=(w, (40, 0)), sinks=s)

    ours = value_and_grads(hook)
    for w in (40, 0):
        ref = lambda q, k, v, s: written(jnp, q, k, v, s, True, w)  # noqa: E731
        want = (written(np, q, k, v, sinks, True, w), *value_and_grads(ref)(q, k, v, sinks, weights)[1:])
        with attention.configured("float32", TPU):
            assert_close(ours(q, k, v, sinks, weights, jnp.int32(w)), want, 5e-5, f"window {w}")


SPLASH = splash.splash


def test_cudnn_refuses_sinks_in_one_line_and_auto_runs_a_kernel_that_takes_them():
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    sinks = jnp.zeros(4)
    with pytest.raises(UserError, match="train.attention=cudnn needs no attention sinks") as e:
        attention.choose("cudnn", q, q, sinks=sinks, device=H100)
    assert "\n" not in str(e.value) and "use train.attention=auto or xla" in str(e.value)
    assert attention.choose("cudnn", q, q, device=H100) == "cudnn"  # without sinks it takes the call
    assert attention.choose("auto", q, q, sinks=sinks, device=H100) == "xla"
    assert attention.choose("auto", q, q, sinks=sinks, device=TPU) == "splash"  # the kernel's own sinks
    assert attention.choose("splash", q, q, sinks=sinks, device=TPU) == "splash"
    assert attention.choose("auto", q, q, sinks=sinks, device=CPU) == "xla"
    with pytest.raises(UserError, match=r"one logit per query head, \(4,\)"):
        hooks.attention(jnp.zeros((1, 4, 4, 8)), jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)), is_causal=True,
                        sinks=jnp.zeros(2))


# ----------------------------------------------------------------------------- context parallelism

@pytest.mark.parametrize("strategy,causal", [("ring", True), ("all_gather", True), ("ring", False),
                                             ("all_gather", False)])
def test_split_attention_takes_sinks(strategy, causal):
    """Over 4 context devices (causal: the load-balanced layout, documents, a soft-cap, a scale and a layer's traced
    window; else in order, plain): outputs and gradients of q, k, v and the sinks (each device's queries' share,
    summed over the devices) as written out."""
    n, (b, t) = 4, (2, 32)
    mesh = jax.make_mesh(tuple(n if a == "context" else 1 for a in mesh_lib.AXES), mesh_lib.AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_lib.AXES))
    q, k, v, weights = inputs(length=t)
    sinks = jnp.asarray(SINKS)
    segments = jnp.asarray(np.repeat([[1, 2], [1, 1]], t // 2, axis=1), jnp.int32) if causal else None
    order = np.asarray(ring.balanced_order(t, n) if causal else range(t))
    split = ring.Split(n, strategy, tuple(order) if causal else None)
    options = dict(softcap=2.0, scale=0.3) if causal else {}

    def split_run(q, k, v, s, w):
        with partition.activate(mesh, partition.RULES):
            laid_out = (partition.constrain(x[:, order], ("batch", "length", "heads", "head_dim")) for x in (q, k, v))
            out = ring.attention(*laid_out, causal, split, None if segments is None else segments[:, order],
                                 window=(w, (6, 0)) if causal else None, sinks=s, **options)
            return out[:, np.argsort(order)]

    ours = value_and_grads(split_run)
    for w in (6, 0) if causal else (0,):
        ref = lambda q, k, v, s: written(jnp, q, k, v, s, causal, w, segments=segments, **options)  # noqa: E731
        want = (written(np, q, k, v, sinks, causal, w, segments=segments, **options),
                *value_and_grads(ref)(q, k, v, sinks, weights)[1:])
        assert_close(ours(q, k, v, sinks, weights, jnp.int32(w)), want, 2e-5, f"{strategy} window {w}")


# ----------------------------------------------------------------------------- generation

def attend(calls, q, k, v, window, sinks):
    with hooks.use(decode=calls):
        return hooks.attention(q, k, v, is_causal=True, window=window, sinks=sinks)


@pytest.mark.parametrize("cache", ["global", "blocks", "ring", "kinds"])
def test_prefill_and_a_decoded_token_take_sinks(monkeypatch, cache):
    """A prefill of 5 slots (row 1 left-padded by 2) and one decoded token over generation's caches: every position
    (`global`), the same over blocks of keys (the online softmax from the sinks), a ring of a window's 3 slots, and a
    stack of a local and a global layer (`kinds`, each layer its own cache). The real tokens' outputs as the whole
    sequence's written out (each row from its first real token), the padding's finite."""
    if cache == "blocks":
        monkeypatch.setattr(decoding, "SCORES", 4)
        monkeypatch.setattr(decoding, "KEY_BLOCK", 4)
    b, t, capacity = 2, 6, 8
    q, k, v, _ = inputs(batch=b, length=t)
    start = jnp.asarray([0, 2], jnp.int32)
    windows = {"global": [None], "blocks": [None], "ring": [3], "kinds": [3, 0]}[cache]
    sinks = jnp.asarray(SINKS)

    def layer_window(i):
        return (jnp.int32(windows[i]), tuple(windows)) if cache == "kinds" else windows[i]

    def forward(index, new, given):
        """Each layer over the tokens `new` (a slice) at slot `index`, as a stack's scan runs them: the layers'
        entries after it (a Kinds stack: one entry for all of them, each layer writing its own cache)."""
        outs, made = [], []
        for i in range(len(windows)):
            entry = ([given] if cache == "kinds" else None if given is None else given[i])
            calls = decoding.Calls(jnp.full(b, index, jnp.int32), start, capacity, entry,
                                   layer=jnp.int32(i) if cache == "kinds" else None)
            outs.append(attend(calls, q[:, new], k[:, new], v[:, new], layer_window(i), sinks))
            if cache == "kinds":
                given = calls.made[0]
            made.append(calls.made)
        return outs, (given if cache == "kinds" else made)

    empty = None
    if cache == "kinds":  # the stack's empty caches, as decoding.stack_caches makes them for these windows
        kinds = decoding.cache_kinds(tuple(windows), capacity)
        empty = decoding.Kinds({kind: {n: jnp.zeros((kinds.count(kind), b, kind or capacity, 2, 8)) for n in "kv"}
                                for kind in set(kinds)})
    first, entries = forward(0, slice(0, 5), empty)
    new, _ = forward(5, slice(5, 6), entries)
    for i in range(len(windows)):
        got = np.concatenate([np.asarray(first[i]), np.asarray(new[i])], axis=1)
        assert np.all(np.isfinite(got))
        for row in range(b):  # the row's real tokens, positions 0.. from its start
            s = int(start[row])
            want = written(np, *(x[row:row + 1, s:] for x in (q, k, v)), SINKS, True, windows[i] or 0)
            np.testing.assert_allclose(got[row:row + 1, s:], want, atol=2e-5, err_msg=f"{cache} layer {i} row {row}")
