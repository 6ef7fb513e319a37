"""Attention over a sequence split along its length over the `context` mesh axis, and the split's layout.

Everything outside attention works on a device's own tokens, so only attention needs the other devices' keys and
values, one of two ways (`Split.strategy`, set by train.context_strategy: shard/strategies/context.py):

- all_gather: each device keeps its queries and gathers the whole sequence's keys and values over `context`
  (the partitioner inserts the all-gather, and a reduction of their gradients). Under causal attention in the
  load-balanced layout it scores only the blocks its queries see (shard/nn/gathered.py).
- ring: keys and values travel round the devices, one chunk at a time, with collective permutes inside
  `shard_map`; each device folds every chunk into its queries' output with the online softmax
  (shard/nn/softmax.py), so none ever holds the whole sequence's. The backward pass rings the same way (a custom
  VJP), sending each chunk's key/value gradients along with it.

Under causal attention the later tokens attend to more keys. So that every device has the same work, language-
model sequences are laid out load-balanced: cut into 2N chunks, device i holds chunks i and 2N-1-i (MaxText's
dual-chunk swap). The train step reorders a batch's tokens that way (`reorder`); a model reads its tokens'
positions from `shard.nn.hooks.positions` (learned or rotary embeddings follow the tokens) and attention masks by
position, so results equal the unsplit model's.
"""

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shard.nn import attention as attn
from shard.nn import masks, partition, softmax
from shard.nn.gathered import gathered_causal

AXIS = "context"


@dataclass(frozen=True)
class Split:
    """How attention runs under mesh.context > 1."""
    size: int                       # devices along `context`
    strategy: str                   # all_gather or ring
    order: tuple | None = None      # the position of each token of a sequence as laid out (None: in order)


def balanced_order(length: int, n: int) -> tuple:
    """Positions of a sequence's tokens in the load-balanced layout: 2n chunks, device i holding chunks i
    and 2n-1-i, devices in turn (length must divide by 2n)."""
    chunks = np.arange(length).reshape(2 * n, length // (2 * n))
    return tuple(int(p) for i in range(n) for p in np.concatenate([chunks[i], chunks[2 * n - 1 - i]]))


# A language-model batch's per-token arrays: a packed one's segment ids, positions and mask move with its tokens.
TOKEN_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def reorder(batch: dict, order: tuple | None) -> dict:
    """A language-model batch's per-token arrays (batch, length) put in the load-balanced order."""
    if order is None:
        return batch
    index = np.asarray(order)
    return {k: v[:, index] if k in TOKEN_KEYS and v.ndim >= 2 and v.shape[1] == len(order) else v
            for k, v in batch.items()}


def positions(split: Split | None, length: int) -> jax.Array:
    if split is not None and split.order is not None and len(split.order) == length:
        return jnp.asarray(split.order, jnp.int32)
    return jnp.arange(length, dtype=jnp.int32)


def attention(q, k, v, is_causal: bool, split: Split, segments=None, window=None, softcap: float | None = None,
              scale: float | None = None, sinks=None, chunk=None, places=None) -> jax.Array:
    """Attention over (batch, length, heads, head_dim) arrays split on length over `context`. `segments`
    (batch, length), a packed batch's document ids: a query sees only keys of its own document. `window`,
    `softcap`, `scale`, `sinks` and `chunk` as shard.hooks.attention takes them: the window and chunk mask by the
    tokens' positions (a layer's traced one too), so they hold over the split sequence whatever the layout; over
    packed rows each document's chunks become documents of their own (masks.chunk_segments, from the tokens'
    positions in their documents, `places` (batch, length); None: found from the segment ids)."""
    pos = positions(split, q.shape[1])
    value, sizes = masks.windows(window)
    cut, cuts = masks.chunks(chunk, is_causal, window)
    window = masks.effective(value, sizes)  # None (global), an int, or a traced int (0: global)
    chunk = masks.effective(cut, cuts)  # likewise
    laid = split.order if split.order is not None and len(split.order) == q.shape[1] else None
    if segments is not None and chunk is not None:
        segments, chunk = masks.chunk_segments(segments, places, chunk, laid), None
    if split.strategy == "ring":
        mesh, _ = partition.active()
        spec = PartitionSpec(None, AXIS)
        halves = is_causal and split.order is not None and len(split.order) == q.shape[1]
        win, cut = (None if x is None else jnp.asarray(x, jnp.int32) for x in (window, chunk))
        widest = masks.fixed(sizes) if value is None else None if not all(w for w, _ in sizes) else sizes[-1][0]
        every = () if chunk is None or not all(c for c, _ in cuts) else tuple(c for c, _ in cuts)
        steps = ring_steps(laid, q.shape[1], split.size, is_causal, widest, every)
        run = jax.shard_map(partial(_ring, causal=is_causal, n=split.size, halves=halves, steps=steps, softcap=softcap,
                                    scale=1 / math.sqrt(q.shape[-1]) if scale is None else scale), mesh=mesh,
                            in_specs=(spec, spec, spec, PartitionSpec(AXIS), spec, PartitionSpec(), PartitionSpec(),
                                      PartitionSpec()),
                            out_specs=spec, axis_names={AXIS})
        return run(q, k, v, pos, segments, win, cut, sinks)
    # all_gather: keys and values whole along length on every device; queries stay split.
    k, v = (partition.constrain(t, ("batch", None, "kv_heads", "head_dim")) for t in (k, v))
    if is_causal and split.order is not None and len(split.order) == q.shape[1]:
        return gathered_causal(q, k, v, split.order, split.size, segments, window, softcap, scale, sinks, chunk)
    mask = masks.visible(pos, pos, is_causal, window, chunk)
    if mask is not None:
        mask = partition.constrain(mask, ("length", None))[None, None]
    if segments is not None:  # each query's document against every (gathered) key's
        same = partition.constrain(segments[:, :, None] == partition.constrain(segments, ("batch", None))[:, None],
                                   ("batch", "length", None))[:, None]
        mask = same if mask is None else mask & same
    if softcap is None and sinks is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
    return attn.grouped(q, k, v, None if mask is None else mask[:, :, None], "float32", scale, softcap, sinks)


# ----------------------------------------------------------------------------- ring attention
# Inside shard_map: q, k, v are this device's chunks, (batch, chunk, heads, head_dim); pos its positions.
# Grouped heads are kept grouped: q as (batch, kv_heads, group, chunk, head_dim).
#
# Causal work under the load-balanced layout: device i holds chunks i and 2N-1-i (its halves a and b), and
# a block passed on from device j != i is half visible. From an earlier device (j < i) every query sees
# the block's first half (chunk j) and none sees its second (2N-1-j > 2N-1-i); from a later one (j > i) the
# device's second half (2N-1-i) sees the whole block and its first half sees none of it. So each passed-on
# block costs half a block (`halves`): the whole sequence's attention costs about half of computing every
# block, as the unsplit causal model's does. A sliding window (or a chunk) masks by position inside each block, and
# skips what lies wholly outside every query's window (chunk): a ring step whose block no device's queries see (the
# window's widest, over a stack's layers, or every chunk size of its layers, known when tracing: `ring_steps`) is
# neither computed nor passed on (the blocks jump to the next step that is seen, in one permute), and on each device
# a block (or half block) none of whose keys its queries see is skipped at run time (a layer's traced window or
# chunk: a local layer of a mixed stack).

def _grouped(q, k):
    b, t, h, d = q.shape
    return q.reshape(b, t, k.shape[2], h // k.shape[2], d).transpose(0, 2, 3, 1, 4)


def _scores(qg, k, qpos, kpos, causal, qseg=None, kseg=None, win=None, cut=None, softcap=None, scale=1.0):
    """The masked scores of a block, and (with a soft-cap) the cap's derivative at them (else None)."""
    s = attn.capped(jnp.einsum("bhgqd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale, softcap)
    slope = None if softcap is None else 1 - jnp.square(s / softcap)
    seen = masks.visible(qpos, kpos, causal, win, cut)
    s = s if seen is None else jnp.where(seen, s, -jnp.inf)
    if qseg is None:
        return s, slope
    # packed rows: other documents' keys masked too (every query sees itself on the diagonal, so never none)
    return jnp.where((qseg[:, :, None] == kseg[:, None, :])[:, None, None], s, -jnp.inf), slope


def _pass_on(tree, n, shift=1):
    """Each device's `tree` to the device `shift` on round the ring."""
    return jax.lax.ppermute(tree, AXIS, [(i, (i + shift) % n) for i in range(n)])


def ring_steps(order: tuple | None, length: int, n: int, causal: bool, window: int | None,
               chunks: tuple = ()) -> tuple:
    """The ring's steps (s in 1..n-1: the block of the device s back) whose keys some device's queries see, the
    tokens laid out in `order` (None: in order): all of them without a `window` (the widest of a stack's, a static
    int) or `chunks` (every chunk size of a stack's layers, none 0; causal); with one, those some query's window or
    chunk reaches."""
    if window is None and not chunks:
        return tuple(range(1, n))
    pos = np.asarray(range(length) if order is None else order).reshape(n, length // n)

    def runs(p):  # a device's positions as (first, last) of contiguous runs
        p = np.sort(p)
        cuts = np.flatnonzero(np.diff(p) != 1) + 1
        return [(int(r[0]), int(r[-1])) for r in np.split(p, cuts)]

    held = [runs(p) for p in pos]
    def sees(qa, qb, ka, kb):  # does a query of [qa, qb] see a key of [ka, kb]?
        if window is not None:  # q - k (qa - kb up to qb - ka) in [0, window) (causal) or (-window, window)
            return qa - kb < window and (qb - ka >= 0 if causal else ka - qb < window)
        # chunks: q sees the keys from its chunk's start up to itself, so the first query at or after ka (whose
        # chunk starts earliest) sees a key of [ka, kb] if any does
        first = max(qa, ka)
        return first <= qb and any(first // c * c <= kb for c in chunks)

    meets = lambda i, j: any(sees(qa, qb, ka, kb) for qa, qb in held[i] for ka, kb in held[j])  # noqa: E731
    return tuple(s for s in range(1, n) if any(meets(i, (i - s) % n) for i in range(n)))


def _forward(q, k, v, pos, seg, win, cut, sinks, causal, n, halves, steps, softcap, scale):
    """Output and log-sum-exp of each query over every chunk: the device's own first (its diagonal, so
    every query has a visible key from the start), then the chunks passed on round the ring, those of `steps`
    (ring_steps). With `halves` (causal, load-balanced layout) only the visible half of each passed-on block is
    computed; with a window or chunk, none of a block no query sees. Sinks are in the softmax's state from the start."""
    qg = _grouped(q, k)

    def fold(state, qg, qpos, k, v, kpos, qseg=None, kseg=None):
        s, _ = _scores(qg, k, qpos, kpos, causal, qseg, kseg, win, cut, softcap, scale)
        return softmax.fold(state, s, v, "bhgqk,bkhd->bhgqd")

    def seen(state, qg, qpos, k, v, kpos, qseg=None, kseg=None):
        return _if_seen(qpos, kpos, causal, win, cut, lambda state: fold(state, qg, qpos, k, v, kpos, qseg, kseg),
                        state)

    def fold_visible(state, k, v, kpos, kseg=None):
        if not halves:
            return seen(state, qg, pos, k, v, kpos, seg, kseg)
        c = k.shape[1] // 2
        first_keys = lambda state: seen(state, qg, pos, k[:, :c], v[:, :c], kpos[:c], seg,
                                        None if seg is None else kseg[:, :c])

        def last_queries(state):
            m, l, acc = seen((state[0][..., c:], state[1][..., c:], state[2][..., c:, :]), qg[..., c:, :], pos[c:],
                             k, v, kpos, None if seg is None else seg[:, c:], kseg)
            return state[0].at[..., c:].set(m), state[1].at[..., c:].set(l), state[2].at[..., c:, :].set(acc)

        return jax.lax.cond(kpos[0] < pos[0], first_keys, last_queries, state)

    state = fold(softmax.start(qg.shape[:-1], v.shape[-1], attn.sink_logits(sinks, k.shape[2])), qg, pos, k, v, pos,
                 seg, seg)

    # A Python loop (unrolled): XLA's CPU runtime (jaxlib 0.10) does not keep a collective inside a loop in order
    # with the program's others; devices that took the ring's permutes and FSDP's all-gathers in different orders
    # deadlocked (bench/RESULTS.md, "The CI hang").
    travelling = (k, v, pos) if seg is None else (k, v, pos, seg)  # a packed row's ids go with their keys
    for at, s in zip((0, *steps), steps):
        travelling = _pass_on(travelling, n, s - at)
        state = fold_visible(state, *travelling)
    out, lse = softmax.finish(state)  # (b, kv_heads, group, chunk, d)
    b, t, h, _ = q.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, -1).astype(q.dtype), lse


def _if_seen(qpos, kpos, causal, win, cut, fold, state):
    """fold(state), or state as it is where a window or chunk leaves no query of `qpos` a key of `kpos` (decided on
    the device, at run time: a traced window or chunk)."""
    if win is None and cut is None:
        return fold(state)
    return jax.lax.cond(jnp.any(masks.visible(qpos, kpos, causal, win, cut)), fold, lambda state: state, state)


def _ring(q, k, v, pos, seg, win, cut, sinks, causal, n, halves, steps, softcap, scale):
    """Ring attention on a device's chunks. The sinks, the same on every device, are made varying over `context`
    first: each device's gradient of them is its own queries' share, which autodiff then sums over the devices."""
    sinks = None if sinks is None else jax.lax.pcast(sinks, AXIS, to="varying")
    return _ringed(q, k, v, pos, seg, win, cut, sinks, causal, n, halves, steps, softcap, scale)


@partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _ringed(q, k, v, pos, seg, win, cut, sinks, causal, n, halves, steps, softcap, scale):
    return _forward(q, k, v, pos, seg, win, cut, sinks, causal, n, halves, steps, softcap, scale)[0]


def _ring_fwd(q, k, v, pos, seg, win, cut, sinks, causal, n, halves, steps, softcap, scale):
    out, lse = _forward(q, k, v, pos, seg, win, cut, sinks, causal, n, halves, steps, softcap, scale)
    return out, (q, k, v, pos, seg, win, cut, sinks, out, lse)


def _ring_bwd(causal, n, halves, steps, softcap, scale, residuals, d_out):
    """The backward ring: each chunk's keys and values travel again, over the same `steps`, with their gradients
    accumulated along the way; after the last one a pass brings every chunk's gradients home. A sink's gradient
    needs no ring: -sum over its queries of p_sink (dO . O), p_sink = exp(sink - lse)."""
    q, k, v, pos, seg, win, cut, sinks, out, lse = residuals
    qg, dog = _grouped(q, k), _grouped(d_out.astype(jnp.float32), k)
    delta = jnp.sum(dog * _grouped(out.astype(jnp.float32), k), axis=-1)  # rowsum(dO * O)
    d_sinks = None
    if sinks is not None:  # (b, kv_heads, group, chunk) -> (heads,)
        p_sink = jnp.exp(attn.sink_logits(sinks, k.shape[2]) - lse)
        d_sinks = -jnp.sum(p_sink * delta, axis=(0, 3)).reshape(sinks.shape).astype(sinks.dtype)

    def fold(dq, qg, dog, lse, delta, qpos, k, v, kpos, dk, dv, qseg=None, kseg=None):
        s, slope = _scores(qg, k, qpos, kpos, causal, qseg, kseg, win, cut, softcap, scale)
        p = jnp.exp(s - lse[..., None])
        dv = dv + jnp.einsum("bhgqk,bhgqd->bkhd", p, dog)
        ds = p * (jnp.einsum("bhgqd,bkhd->bhgqk", dog, v.astype(jnp.float32)) - delta[..., None])
        ds = ds if slope is None else ds * slope  # through the soft-cap (masked entries have p = 0)
        dq = dq + jnp.einsum("bhgqk,bkhd->bhgqd", ds, k.astype(jnp.float32)) * scale
        dk = dk + jnp.einsum("bhgqk,bhgqd->bkhd", ds, qg.astype(jnp.float32)) * scale
        return dq, dk, dv

    def seen(dq, qg, dog, lse, delta, qpos, k, v, kpos, dk, dv, qseg=None, kseg=None):
        return _if_seen(qpos, kpos, causal, win, cut,
                        lambda grads: fold(grads[0], qg, dog, lse, delta, qpos, k, v, kpos, *grads[1:], qseg, kseg),
                        (dq, dk, dv))

    def fold_visible(dq, k, v, kpos, dk, dv, kseg=None):  # the visible half of a passed-on block, as in _forward
        if not halves:
            return seen(dq, qg, dog, lse, delta, pos, k, v, kpos, dk, dv, seg, kseg)
        c = k.shape[1] // 2

        def first_keys(dq, dk, dv):
            dq, dk_a, dv_a = seen(dq, qg, dog, lse, delta, pos, k[:, :c], v[:, :c], kpos[:c], dk[:, :c], dv[:, :c],
                                  seg, None if seg is None else kseg[:, :c])
            return dq, dk.at[:, :c].set(dk_a), dv.at[:, :c].set(dv_a)

        def last_queries(dq, dk, dv):
            dq_b, dk, dv = seen(dq[..., c:, :], qg[..., c:, :], dog[..., c:, :], lse[..., c:], delta[..., c:],
                                pos[c:], k, v, kpos, dk, dv, None if seg is None else seg[:, c:], kseg)
            return dq.at[..., c:, :].set(dq_b), dk, dv

        return jax.lax.cond(kpos[0] < pos[0], first_keys, last_queries, dq, dk, dv)

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    dq, dk, dv = fold(jnp.zeros(qg.shape, jnp.float32), qg, dog, lse, delta, pos, k, v, pos, zeros(k), zeros(v),
                      seg, seg)

    chunk = (k, v, pos, dk, dv) + (() if seg is None else (seg,))
    for at, s in zip((0, *steps), steps):  # unrolled, as in _forward
        chunk = _pass_on(chunk, n, s - at)
        dq, dk, dv = fold_visible(dq, *chunk[:3], *chunk[3:5], *chunk[5:])
        chunk = (*chunk[:3], dk, dv, *chunk[5:])
    if steps:  # home: the gradients of the block `steps[-1]` devices back
        dk, dv = _pass_on((dk, dv), n, n - steps[-1])
    b, t, h, d = q.shape
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    no_grad = lambda x: None if x is None else np.zeros(x.shape, jax.dtypes.float0)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), no_grad(pos), no_grad(seg), no_grad(win),
            no_grad(cut), d_sinks)


_ringed.defvjp(_ring_fwd, _ring_bwd)
