"""Chunked attention (Llama 4's attention_chunk_size C; transformers' chunked_overlay on a causal mask): a query at
position p sees a key at s only if s <= p and s // C == p // C. Every path of shard.nn.hooks.attention takes it:
XLA's kernels (the CPU's, the grouped one, the one that stands in for jax.nn.dot_product_attention), splash's
(Pallas' interpreter), context parallelism's ring and all_gather, and generation's cache. Positions are the tokens'
own: a packed document's count from its start, a cached row's from its first real token. Each path is checked
against attention written out here: NumPy in float64 for the outputs, jax.grad of the same in jax.numpy for the
gradients of q, k, v (and the sinks where they join); none of the project's kernels is a reference."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard.core import flops
from shard.core import mesh as mesh_lib
from shard.errors import UserError
from shard.nn import attention, decoding, hooks, partition, ring, splash

CPU, TPU = SimpleNamespace(platform="cpu", device_kind="cpu"), SimpleNamespace(platform="tpu", device_kind="TPU v5")
H100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)  # four query heads over two key/value heads


def written(xp, q, k, v, chunk, sinks=None, segments=None, positions=None):
    """Causal attention within chunks of `chunk` positions (0: plain causal), in NumPy (xp=np, float64) or jax.numpy
    (xp=jnp, for jax.grad): the scaled logits masked where the key lies after the query or in another chunk (or
    another document, `segments`), a column of each head's sink logit joining the softmax (`sinks`), the product with
    v. positions: (t,) or (batch, t), default 0..t-1."""
    if xp is np:
        q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
        sinks = None if sinks is None else np.asarray(sinks, np.float64)
    b, t, h, d = q.shape
    k, v = xp.repeat(k, h // k.shape[2], axis=2), xp.repeat(v, h // k.shape[2], axis=2)  # head h: kv head h // groups
    s = xp.einsum("bthd,bshd->bhts", q, k) * d ** -0.5
    pos = np.arange(t) if positions is None else np.asarray(positions)
    query, key = pos[..., :, None], pos[..., None, :]
    seen = (key <= query) & ((key // max(chunk, 1) == query // max(chunk, 1)) | (chunk == 0))
    seen = seen[:, None] if seen.ndim == 3 else seen[None, None]
    if segments is not None:
        segments = np.asarray(segments)
        seen = seen & (segments[:, :, None] == segments[:, None, :])[:, None]
    s = xp.where(seen, s, -xp.inf)
    if sinks is not None:
        s = xp.concatenate([s, xp.broadcast_to(sinks[None, :, None, None], (b, h, t, 1))], axis=-1)
    p = xp.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return xp.einsum("bhts,bshd->bthd", p[..., :t], v)


def inputs(batch=2, length=12, heads=4, kv_heads=2, dim=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (batch, length, heads, dim)),
            *(jax.random.normal(key, (batch, length, kv_heads, dim)) for key in keys[1:3]),
            jax.random.normal(keys[3], (batch, length, heads, dim)))  # the last: a loss's weights


def documents(lengths: list[list[int]], length: int, starts: tuple = ()):
    """Segment ids (1, 2, ...; the rest of a row padding, 0) and each token's position in its document (padding
    counted as a run of its own, as packed batches give it), written as loops. `starts`: the first positions of row
    0's documents (a document begun in an earlier row), else 0."""
    ids, pos = np.zeros((len(lengths), length), np.int32), np.zeros((len(lengths), length), np.int32)
    for row, docs in enumerate(lengths):
        at = 0
        for i, n in enumerate(docs):
            ids[row, at:at + n] = i + 1
            pos[row, at:at + n] = np.arange(n) + (starts[i] if row == 0 < len(starts) else 0)
            at += n
        pos[row, at:] = np.arange(length - at)
    return ids, pos


def value_and_grads(fn, argnums=(0, 1, 2)):
    """fn(q, k, v, ...) and the gradients of sum(fn * weights) by q, k, v (and whatever else argnums names),
    compiled once; called as (q, k, v, weights, *rest)."""
    grads = jax.grad(lambda q, k, v, w, *a: jnp.sum(fn(q, k, v, *a) * w), argnums=argnums)
    return jax.jit(lambda q, k, v, w, *a: (fn(q, k, v, *a), *grads(q, k, v, w, *a)))


def assert_close(got, want, tol, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)), (what, i)
        np.testing.assert_allclose(g, w, atol=tol * np.abs(w).max(), rtol=0, err_msg=f"{what}: output/grad {i}")


# ----------------------------------------------------------------------------- one device: XLA's kernels

LAYER_CHUNKS = (4, 0)  # a stack of a chunked layer and a global one: the chunk a traced int
DOCS = [[5, 5], [12]]  # row 0: two documents of 5 and padding, so its documents' chunks are not the row's


@pytest.mark.parametrize("device,chunk,packed,positions,sinks", [
    (None, 4, False, False, False),        # xla_cpu, 3 chunks
    (None, "traced", True, True, False),   # xla_cpu: a layer's traced chunk over packed documents, by their positions
                                           # (row 0's from 2 and 3: their first chunks begun before the row)
    (H100, 4, False, False, False),        # what jax.nn.dot_product_attention ran: xla_grouped
    (H100, 4, True, False, True),          # xla_grouped: documents (positions found from their ids), sinks
    (H100, "traced", False, False, True),  # xla_grouped: a layer's traced chunk, sinks
])
def test_the_hook_chunks_equal_attention_written_out(device, chunk, packed, positions, sinks):
    """shard.nn.hooks.attention with a chunk, grouped heads (4 over 2), 12 tokens: outputs against NumPy, gradients
    against jax.grad of the written-out attention. The call is the named one whose FLOPs shard/core/flops.py counts,
    each chunk size weighed by its layers."""
    q, k, v, weights = inputs()
    segments, places = documents(DOCS, 12, (2, 3) if positions else ()) if packed else (None, None)
    segments = None if segments is None else jnp.asarray(segments)
    given = jnp.asarray(places) if positions else None
    extra = (jnp.asarray(SINKS),) if sinks else ()

    def hook(q, k, v, *a):
        c = chunk if chunk != "traced" else (a[-1], LAYER_CHUNKS)
        with hooks.use(attention="xla"), hooks.packed(segments, given):
            return hooks.attention(q, k, v, is_causal=True, chunk=c, sinks=a[0] if sinks else None)

    argnums = (0, 1, 2, 4) if sinks else (0, 1, 2)
    with attention.configured("float32", device):
        ours = value_and_grads(hook, argnums)
        for c in LAYER_CHUNKS if chunk == "traced" else (chunk,):
            layer = (jnp.int32(c),) if chunk == "traced" else ()
            ref = lambda q, k, v, *a: written(jnp, q, k, v, c, a[0] if sinks else None, segments, places)  # noqa
            want = (written(np, q, k, v, c, SINKS if sinks else None, segments, places),
                    *value_and_grads(ref, argnums)(q, k, v, weights, *extra)[1:])
            assert_close(ours(q, k, v, weights, *extra, *layer), want, 2e-5, f"chunk {c}")
        jaxpr = jax.make_jaxpr(hook)(q, k, v, *extra, *layer)
    counted = ((0, 1), (4, 1)) if chunk == "traced" else chunk
    assert flops.attention_flops(jaxpr.jaxpr) == attention.flops(q.shape, k.shape, v.shape, True, None, counted)


def test_a_chunked_calls_flops_are_its_chunks_causal_pairs():
    """12 queries in chunks of 5: 15 + 15 + 3 pairs of the causal 78; a stack of one chunked layer and a global one
    counts their mean; the call's name says its chunk."""
    q = jnp.zeros((1, 12, 2, 4))
    assert attention.flops(q.shape, q.shape, q.shape, True, None, 5) == 2 * 2 * 33 * 8
    both = attention.flops(q.shape, q.shape, q.shape, True, None, ((0, 1), (5, 1)))
    assert both == (2 * 2 * 33 * 8 + 2 * 2 * 78 * 8) / 2
    jaxpr = jax.make_jaxpr(lambda q: hooks.attention(q, q, q, is_causal=True, chunk=5))(q)
    call = next(e.params["name"] for e in jaxpr.jaxpr.eqns if e.primitive.name in ("pjit", "jit"))
    assert attention.call_of(call) == (True, None, 5) and flops.attention_flops(jaxpr.jaxpr) == 2 * 2 * 33 * 8
    assert attention.call_of("shard_attention_causal_chunks0x1_5x3") == (True, None, ((0, 1), (5, 3)))


def test_refusals_are_one_line():
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    x = jnp.zeros((1, 8, 2, 8))
    for kwargs, match in [(dict(is_causal=False, chunk=4), "chunked attention .* is causal attention"),
                          (dict(is_causal=True, chunk=4, window=3), r"a sliding window \(3\) and chunked attention"),
                          (dict(is_causal=True, chunk=-2), "chunk sizes"),
                          (dict(is_causal=True, chunk=(jnp.int32(4), (4, 0)), window=(jnp.int32(3), (3, 0))),
                           "a sliding window")]:
        with pytest.raises(UserError, match=match) as e:
            hooks.attention(x, x, x, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="train.attention=cudnn needs no chunked attention") as e:
        attention.choose("cudnn", q, q, chunk=64, device=H100)
    assert "\n" not in str(e.value) and "use train.attention=auto or xla" in str(e.value)
    assert attention.choose("cudnn", q, q, chunk=(jnp.int32(0), (0, 0)), device=H100) == "cudnn"  # no layer chunked
    assert attention.choose("auto", q, q, chunk=64, device=H100) == "xla"
    assert attention.choose("auto", q, q, chunk=64, device=TPU) == "splash"  # its ChunkedCausalMask
    assert attention.choose("splash", q, q, chunk=64, device=TPU) == "splash"
    hooks.attention(x, x, x, is_causal=True, chunk=0, window=3)  # chunk 0: none, so a window is fine


# ----------------------------------------------------------------------------- splash (Pallas' interpreter)

SPLASH = splash.splash


@pytest.mark.parametrize("chunk,packed", [("traced", False), (48, True)])  # traced: each static kernel switched
def test_splash_takes_chunks(monkeypatch, chunk, packed):
    """The hook's splash path on 128 tokens: a static chunk of 48 (ChunkedCausalMask, chunks across the kernel's
    tiles), a layer's traced chunk (one kernel per chunk size, by jax.lax.switch), and packed documents (their chunks
    in the segment ids, the kernel's mask causal)."""
    monkeypatch.setattr(splash, "splash", lambda *a, **kw: SPLASH(*a, **kw, interpret=True))
    q, k, v, weights = inputs(batch=2 if packed else 1, length=128)
    segments, places = documents([[50, 60], [128]], 128) if packed else (None, None)
    segments = None if segments is None else jnp.asarray(segments)

    def hook(q, k, v, *a):
        with hooks.use(attention="splash"), hooks.packed(segments, None if places is None else jnp.asarray(places)):
            return hooks.attention(q, k, v, is_causal=True, chunk=(a[0], (48, 0)) if a else chunk)

    ours = value_and_grads(hook)
    for c in (48, 0) if chunk == "traced" else (chunk,):
        ref = lambda q, k, v: written(jnp, q, k, v, c, None, segments, places)  # noqa: E731
        want = (written(np, q, k, v, c, None, segments, places), *value_and_grads(ref)(q, k, v, weights)[1:])
        with attention.configured("float32", TPU):
            assert_close(ours(q, k, v, weights, *((jnp.int32(c),) if chunk == "traced" else ())), want, 5e-5,
                         f"splash chunk {c}")


# ----------------------------------------------------------------------------- context parallelism

@pytest.mark.parametrize("strategy,chunk,packed", [("ring", 8, False), ("ring", "traced", False), ("ring", 6, True),
                                                   ("all_gather", "traced", False), ("all_gather", 6, True)])
def test_split_attention_takes_chunks(strategy, chunk, packed):
    """Over 4 context devices in the load-balanced layout, through the hook (the split's positions, the packed
    batch's segment ids and positions laid out with the tokens): outputs and gradients as written out. A chunk of 8
    over 32 tokens leaves the ring's step 2 unseen (ring_steps); a layer's traced chunk (6 or 0) masks each block;
    packed documents' chunks count from their positions (ring: the first document's start at 3, begun in an earlier
    row; all_gather: the positions found from the laid-out segment ids)."""
    n, t = 4, 32
    mesh = jax.make_mesh(tuple(n if a == "context" else 1 for a in mesh_lib.AXES), mesh_lib.AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_lib.AXES))
    q, k, v, weights = inputs(length=t)
    segments, places = documents([[13, 19], [32]], t, (3, 0) if strategy == "ring" else ()) if packed else (None, None)
    order = np.asarray(ring.balanced_order(t, n))
    split = ring.Split(n, strategy, tuple(order))
    laid = (None, None) if segments is None else (jnp.asarray(segments[:, order]),  # all_gather: positions from ids
                                                  None if strategy == "all_gather" else jnp.asarray(places[:, order]))

    def split_run(q, k, v, *a):
        with partition.activate(mesh, partition.RULES), hooks.use(split=split), hooks.packed(*laid):
            laid_out = (partition.constrain(x[:, order], ("batch", "length", "heads", "head_dim")) for x in (q, k, v))
            out = hooks.attention(*laid_out, is_causal=True, chunk=(a[0], (6, 0)) if a else chunk)
            return out[:, np.argsort(order)]

    ours = value_and_grads(split_run)
    for c in (6, 0) if chunk == "traced" else (chunk,):
        ref = lambda q, k, v: written(jnp, q, k, v, c, None, segments, places)  # noqa: E731
        want = (written(np, q, k, v, c, None, segments, places), *value_and_grads(ref)(q, k, v, weights)[1:])
        assert_close(ours(q, k, v, weights, *((jnp.int32(c),) if chunk == "traced" else ())), want, 2e-5,
                     f"{strategy} chunk {c}")


def test_ring_steps_skip_exactly_the_blocks_no_chunk_reaches():
    """The ring's static steps with chunks against every (query, key) pair's chunk, by brute force."""
    for t, n, chunks in [(32, 4, (8,)), (32, 4, (4,)), (32, 4, (16,)), (48, 4, (6, 5)), (64, 8, (3,))]:
        for order in (None, ring.balanced_order(t, n)):
            pos = np.asarray(range(t) if order is None else order).reshape(n, t // n)
            sees = lambda i, j: any((kp <= qp) and kp // c == qp // c  # noqa: E731
                                    for c in chunks for qp in pos[i] for kp in pos[j])
            want = tuple(s for s in range(1, n) if any(sees(i, (i - s) % n) for i in range(n)))
            assert ring.ring_steps(order, t, n, True, None, chunks) == want, (t, n, chunks, order is None)
    assert ring.ring_steps(ring.balanced_order(32, 4), 32, 4, True, None, (8,)) == (1, 3)


# ----------------------------------------------------------------------------- generation

@pytest.mark.parametrize("cache", ["written", "ring", "blocks", "stack"])
def test_prefill_and_decoded_tokens_past_a_chunk_boundary(monkeypatch, cache):
    """A prefill of 5 slots (row 1 left-padded by 2: its positions start at slot 2) and four decoded tokens, chunks
    of 4 positions: each row's chunk boundaries fall at its own positions 4 and 8. A cache of every position where
    the chunk is no shorter (`written`, 4 slots and tokens), a ring of one chunk where it is (`ring`: 4 slots of 12),
    the ring over blocks of keys (the online softmax), and a stack of a chunked layer and a global one (a traced
    chunk, with sinks: a ring for the first, every position for the second, as the stack's scan hands them). The real
    tokens' outputs as the whole sequence's written out (each row from its first real token); a query right after a
    boundary sees only itself."""
    if cache == "blocks":
        monkeypatch.setattr(decoding, "SCORES", 4)
        monkeypatch.setattr(decoding, "KEY_BLOCK", 4)
    b, t = 2, 9
    capacity = 4 if cache == "written" else 12
    q, k, v, _ = inputs(batch=b, length=t)
    start = jnp.asarray([0, 2], jnp.int32)
    chunks = (4, 0) if cache == "stack" else (4,)
    sinks = jnp.asarray(SINKS) if cache == "stack" else None
    if cache == "written":  # every position written: the chunk no shorter than the cache
        t, q, k, v = 4, *(x[:, :4] for x in (q, k, v))

    def forward(index, new, given):
        """The layers over the tokens `new` at slot `index`; a stack's one entry for all its layers (Kinds)."""
        outs, made = [], []
        for i, c in enumerate(chunks):
            entry = [given] if cache == "stack" else None if given is None else given[i]
            calls = decoding.Calls(jnp.full(b, index, jnp.int32), start, capacity, entry,
                                   layer=jnp.int32(i) if cache == "stack" else None)
            with hooks.use(decode=calls):
                outs.append(hooks.attention(q[:, new], k[:, new], v[:, new], is_causal=True, sinks=sinks,
                                            chunk=(jnp.int32(c), chunks) if cache == "stack" else c))
            if cache == "stack":
                given = calls.made[0]
                assert {kind: a["k"].shape[2] for kind, a in given.caches.items()} == {4: 4, 0: capacity}
            made.append(calls.made)
        return outs, (given if cache == "stack" else made)

    empty = None
    if cache == "stack":  # the stack's empty caches, as decoding.stack_caches makes them
        kinds = decoding.cache_kinds(chunks, capacity)
        empty = decoding.Kinds({kind: {n: jnp.zeros((kinds.count(kind), b, kind or capacity, 2, 8)) for n in "kv"}
                                for kind in set(kinds)})
    prefill = min(5, t)
    outs, entries = forward(0, slice(0, prefill), empty)
    if cache in ("ring", "blocks"):
        assert entries[0][0]["k"].shape[1] == 4  # one chunk's slots
    for slot in range(prefill, t):
        new, entries = forward(slot, slice(slot, slot + 1), entries)
        outs = [np.concatenate([np.asarray(o), np.asarray(n)], axis=1) for o, n in zip(outs, new)]
    for i, c in enumerate(chunks):
        got = outs[i]
        assert np.all(np.isfinite(got))
        for row in range(b):
            s = int(start[row])
            want = written(np, *(x[row:row + 1, s:] for x in (q, k, v)), c, None if sinks is None else SINKS)
            np.testing.assert_allclose(got[row:row + 1, s:], want, atol=2e-5, err_msg=f"{cache} layer {i} row {row}")
            for first in range(s + 4, t, 4) if c and sinks is None else ():  # a chunk's first query: itself only
                np.testing.assert_allclose(got[row, first], np.repeat(np.asarray(v[row, first]), 2, axis=0),
                                           atol=1e-6, err_msg=f"{cache} row {row} slot {first}")
