"""Causal attention under context parallelism's all_gather strategy, in the load-balanced layout: each device
scores its queries only against the key blocks they can see (shard/nn/ring.py dispatches here)."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from shard.nn import attention as attn
from shard.nn import masks, partition

# ----------------------------------------------------------------------------- all_gather, causal
# Under the load-balanced layout device i's early chunk i sees key chunks 0..i and its late chunk 2N-1-i sees
# 0..2N-1-i: 2N+1 (query chunk, key chunk) blocks on every device, of the 4N that scoring its queries against
# the whole sequence computes. They are computed as two sets of equal shape on all devices:
#   - the late chunk against chunks 0..N-1 (all visible to it);
#   - N+1 single blocks, block j pairing key chunk W[i+j], W = (2N-1, ..., N, 0, ..., N-1), with the late chunk
#     while j < N-i (its keys N..2N-1-i) and with the early chunk after (its keys 0..i).
# The 2N+1 key chunks a device needs are taken from the gathered keys by one gather whose index is split over
# `context` like the queries, so every product is local to a device and the keys' gradient is summed over the
# devices once, by the transpose of that gather, as the unskipped version's is. (Taking the early keys with a
# slice of the gathered array, every device the same, reduced that slice's gradient on its own: an all-reduce
# of half the keys and values more per layer.)


def _blocks(n: int):
    """Per device, the layout slots (2i: chunk i, 2i+1: chunk 2N-1-i) of the 2N+1 key chunks it needs, and
    for the N+1 single blocks whether the late query chunk takes them."""
    slot = lambda m: 2 * m if m < n else 2 * (2 * n - 1 - m) + 1
    window = [*range(2 * n - 1, n - 1, -1), *range(n)]
    keys = np.array([[slot(m) for m in range(n)] + [slot(window[i + j]) for j in range(n + 1)] for i in range(n)])
    late = np.array([[j < n - i for j in range(n + 1)] for i in range(n)])
    return keys, late


def gathered_causal(q, k, v, order, n, segments=None, window=None, softcap=None, scale=None, sinks=None, chunk=None):
    """Causal attention of split queries over gathered keys and values in the load-balanced layout, computing
    only the 2N+1 visible blocks of each device (the softmax is taken over all of a query's blocks at once).
    `window` and `chunk` (an int, or a traced int with 0 for none), `softcap`, `scale` and `sinks` as
    shard.nn.hooks.attention's: the window and chunk mask by position inside the blocks (blocks wholly outside them
    are still computed); a sink joins each query's softmax."""
    b, t, h, d = q.shape
    kv, c = k.shape[2], t // (2 * n)
    keys, late = _blocks(n)
    qc = partition.constrain(q.reshape(b, n, 2, c, kv, h // kv, d),  # (b, device, early/late, chunk, kv, group, d)
                             ("batch", "length", None, None, "kv_heads", None, "head_dim"))
    pos = np.asarray(order).reshape(2 * n, c)
    kpos = pos[keys]  # (device, 2N+1, chunk)
    qpos = np.where(late[..., None], pos[1::2][:, None], pos[0::2][:, None])  # (device, N+1, chunk)
    owner = jnp.asarray(late)[None, :, :, None, None, None, None]
    mixed_q = jnp.where(owner, qc[:, :, 1:], qc[:, :, :1])  # (b, device, N+1, chunk, kv, group, d)
    ks, vs = (partition.constrain(x.reshape(b, 2 * n, c, kv, -1)[:, keys], ("batch", "length", None, None, "kv_heads",
                                                                             "head_dim")) for x in (k, v))
    scale = jnp.float32(1 / math.sqrt(d) if scale is None else scale)
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None  # as jax.nn's
    # scores of the late chunk against chunks 0..N-1, (b, device, kv, group, chunk, N x chunk), and of the single
    # blocks, (b, device, N+1, kv, group, chunk, chunk), these masked by position (the diagonal blocks)
    s_prefix = jnp.einsum("bicngd,bijsnd->bingcjs", qc[:, :, 1], ks[:, :, :n], precision=precision,
                          preferred_element_type=jnp.float32).reshape(b, n, kv, h // kv, c, n * c) * scale
    s_blocks = jnp.einsum("bijcngd,bijsnd->bijngcs", mixed_q, ks[:, :, n:], precision=precision,
                          preferred_element_type=jnp.float32) * scale
    s_prefix, s_blocks = attn.capped(s_prefix, softcap), attn.capped(s_blocks, softcap)
    visible = masks.visible(qpos, kpos[:, n:], True, window, chunk)[:, :, None, None]  # (device, N+1, 1, 1, c, c)
    if window is not None or chunk is not None:  # the late chunk's prefix: causally all visible, not all near
        near = masks.visible(pos[1::2], kpos[:, :n].reshape(n, n * c), True, window, chunk)  # (device, c, N x c)
        s_prefix = jnp.where(jnp.asarray(near)[None, :, None, None], s_prefix, -jnp.inf)
    if segments is not None:  # packed rows: a query's own document only (it always sees itself: no empty row)
        qseg = partition.constrain(segments.reshape(b, n, 2, c), ("batch", "length", None, None))
        kseg = partition.constrain(segments.reshape(b, 2 * n, c)[:, keys], ("batch", "length", None, None))
        same_prefix = qseg[:, :, 1, :, None] == kseg[:, :, :n].reshape(b, n, 1, n * c)
        s_prefix = jnp.where(same_prefix[:, :, None, None], s_prefix, -jnp.inf)
        # (b, device, N+1, chunk)
        mixed_seg = jnp.where(jnp.asarray(late)[None, :, :, None], qseg[:, :, 1:], qseg[:, :, :1])
        visible = visible & (mixed_seg[..., :, None] == kseg[:, :, n:, None, :])[:, :, :, None, None]
    s_blocks = jnp.where(visible, s_blocks, -jnp.inf)
    p_prefix, p_blocks = _softmax(s_prefix, s_blocks, jnp.asarray(late)[None, :, :, None, None, None],
                                  attn.sink_logits(sinks, kv))
    p_prefix, p_blocks = p_prefix.astype(v.dtype), p_blocks.astype(v.dtype)  # normalised before PV, as jax.nn's
    o_prefix = jnp.einsum("bingcjs,bijsnd->bicngd", p_prefix.reshape(b, n, kv, h // kv, c, n, c), vs[:, :, :n],
                          preferred_element_type=jnp.float32)
    o_blocks = jnp.einsum("bijngcs,bijsnd->bijcngd", p_blocks, vs[:, :, n:], preferred_element_type=jnp.float32)
    o_late = o_prefix + jnp.where(owner, o_blocks, 0).sum(2)
    o_early = jnp.where(owner, 0, o_blocks).sum(2)
    out = jnp.stack([o_early, o_late], axis=2).astype(q.dtype)
    return partition.constrain(out.reshape(b, t, h, -1), ("batch", "length", "heads", "head_dim"))


@jax.custom_jvp
def _softmax(s_prefix, s_blocks, is_late, sink):
    """One softmax per query chunk over all its blocks: the late chunk's prefix (b, device, kv, group, chunk, keys)
    and blocks, the early chunk's blocks (b, device, block, kv, group, chunk, keys); is_late says whose a block is.
    `sink` (kv, group, 1): each head's sink logit, one more term of every query's softmax (None: none)."""
    return _probabilities(s_prefix, s_blocks, is_late, sink)[:2]


def _probabilities(s_prefix, s_blocks, is_late, sink):
    """_softmax's, and the sink's probability per query chunk, (late, early) (None without a sink)."""
    block_max = s_blocks.max(-1)
    m_late = jnp.maximum(s_prefix.max(-1), jnp.where(is_late, block_max, -jnp.inf).max(2))
    m_early = jnp.where(is_late, -jnp.inf, block_max).max(2)
    if sink is not None:
        m_late, m_early = jnp.maximum(m_late, sink), jnp.maximum(m_early, sink)
    p_prefix = jnp.exp(s_prefix - m_late[..., None])
    p_blocks = jnp.exp(s_blocks - _per_block(m_late, m_early, is_late)[..., None])
    l_late, l_early = _per_query(p_prefix.sum(-1), p_blocks.sum(-1), is_late)
    p_sink = None
    if sink is not None:
        e_late, e_early = jnp.exp(sink - m_late), jnp.exp(sink - m_early)
        l_late, l_early = l_late + e_late, l_early + e_early
        p_sink = e_late / l_late, e_early / l_early
    return p_prefix / l_late[..., None], p_blocks / _per_block(l_late, l_early, is_late)[..., None], p_sink


def _per_query(prefix_sums, block_sums, is_late):
    """Row sums of the prefix and of the blocks gathered per query chunk: (late, early)."""
    return prefix_sums + jnp.where(is_late, block_sums, 0).sum(2), jnp.where(is_late, 0, block_sums).sum(2)


def _per_block(late, early, is_late):
    """A value per query row of each block, from the late or early chunk's as the block is theirs."""
    return jnp.where(is_late, late[:, :, None], early[:, :, None])


@_softmax.defjvp
def _softmax_jvp(primals, tangents):
    # As jax.nn.softmax's: dp = p (ds - sum(p ds)) over each query's keys (and its sink), so the backward is a single
    # pass over the scores rather than autodiff's through the maxima, exponentials and sums.
    (p_prefix, p_blocks, p_sink), (ds_prefix, ds_blocks, _, d_sink) = _probabilities(*primals), tangents
    is_late = primals[2]
    late, early = _per_query((p_prefix * ds_prefix).sum(-1), (p_blocks * ds_blocks).sum(-1), is_late)
    if p_sink is not None:
        late, early = late + p_sink[0] * d_sink, early + p_sink[1] * d_sink
    return (p_prefix, p_blocks), (p_prefix * (ds_prefix - late[..., None]),
                                  p_blocks * (ds_blocks - _per_block(late, early, is_late)[..., None]))
