"""Pallas' splash attention, the fused kernel on TPU (train.attention=splash, or auto there): its tiles, how its
inputs lie on the mesh, and the kernel mapped over the batch (and under a mesh, over each device's block).
shard/nn/attention.py chooses it and calls `splash`.
"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shard.nn import partition

SPLASH_BLOCKS = (512, 256, 128)  # the kernel's tiles, largest first: a length must be a multiple of one


def splash_block(q_len: int, kv_len: int) -> int | None:
    """The splash kernel's tile along both lengths: the largest of SPLASH_BLOCKS that divides them, else None."""
    return next((b for b in SPLASH_BLOCKS if q_len % b == 0 and kv_len % b == 0), None)


def misfit(q, k) -> str:
    """Why the kernel cannot take this call (its tiles), else an empty string."""
    if splash_block(q.shape[1], k.shape[1]) is None:
        return (f"sequence lengths that are multiples of {SPLASH_BLOCKS[-1]} (its tiles), got {q.shape[1]} queries "
                f"and {k.shape[1]} keys")
    return ""


@dataclass(frozen=True)
class Layout:
    """How the splash kernel's inputs lie on the mesh: each device runs the kernel on its own block."""
    mesh: object
    q: PartitionSpec       # (batch, length, heads, head_dim)
    kv: PartitionSpec      # (batch, length, kv_heads, head_dim)
    segments: PartitionSpec


def layout(q_shape, kv_shape) -> Layout | None:
    """The blocks of the active mesh's devices (None: no mesh): the batch and heads split as the logical rules
    split them, where they divide; whole sequences and head dims on each device (the kernel takes whole ones).
    Grouped heads are split only where the key/value heads split the same way, so that each device holds the
    key/value heads of its query heads."""
    if (active := partition.active()) is None:
        return None
    mesh, rules = active
    sizes = dict(mesh.shape)
    size = lambda entry: int(np.prod([sizes[a] for a in partition.axes_of(entry)]))  # noqa: E731
    batch, _, heads, _ = partition.logical_to_spec(("batch", "length", "heads", "head_dim"), rules, sizes)
    kv_heads = partition.logical_to_spec(("batch", "length", "kv_heads", "head_dim"), rules, sizes)[2]
    batch = batch if q_shape[0] % size(batch) == 0 else None
    if heads != kv_heads or q_shape[2] % size(heads) or kv_shape[2] % size(heads):
        heads = None
    return Layout(mesh, PartitionSpec(batch, None, heads, None), PartitionSpec(batch, None, heads, None),
                  PartitionSpec(batch, None))


def splash(q, k, v, is_causal: bool, segments=None, window: int | None = None, *, layout: Layout | None = None,
           softcap: float | None = None, scale: float | None = None, sinks=None, chunk: int | None = None,
           interpret: bool = False) -> jax.Array:
    """Pallas splash attention over (batch, length, heads, head_dim) arrays: the kernel works on one example's
    (heads, length, head_dim), so it is mapped over the batch, and under a mesh (`layout`) each device maps it
    over its own block (a shard_map: the partitioner cannot split a Mosaic kernel). Grouped key/value heads are
    the kernel's own (a single one: its MQA form). `softcap`: the kernel's own logit soft-cap. `sinks` (heads,): the
    kernel's own attention sinks (its running maximum and sum start from each head's), their gradient its own too.
    `chunk`: causal attention within chunks of that many row places (its ChunkedCausalMask, whose empty blocks it
    skips; packed rows' chunks go in as segment ids instead, shard/nn/masks.py). `interpret`: Pallas' interpreter,
    on any device (tests)."""
    def local(q, k, v, segments, sinks):
        kernel = _splash_kernel(q.shape[2], k.shape[2], q.shape[1], k.shape[1], is_causal, window, interpret, softcap,
                                chunk)
        # splash does not scale the logits; heads first, as it takes them
        q = (q * jnp.asarray(q.shape[-1] ** -0.5 if scale is None else scale, q.dtype)).transpose(0, 2, 1, 3)
        k, v = (a.transpose(0, 2, 1, 3) for a in (k, v))
        if k.shape[1] == 1:  # one key/value head: the kernel's MQA form takes it without the head axis
            k, v = k[:, 0], v[:, 0]
        extra = {} if sinks is None else {"sinks": sinks.astype(jnp.float32)}  # every example's the same
        if segments is None:
            out = jax.vmap(lambda q, k, v: kernel(q, k, v, **extra))(q, k, v)
        else:
            out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=_segment_ids(s), **extra))(q, k, v, segments)
        return out.transpose(0, 2, 1, 3)

    if layout is None:
        return local(q, k, v, segments, sinks)
    specs = (layout.q, layout.kv, layout.kv, None if segments is None else layout.segments,
             None if sinks is None else PartitionSpec(layout.q[2]))  # a device's query heads' sinks
    return jax.shard_map(local, mesh=layout.mesh, in_specs=specs, out_specs=layout.q, check_vma=False)(
        q, k, v, segments, sinks)


def _segment_ids(s):
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
    return SegmentIds(q=s, kv=s)


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, kv_heads: int, q_len: int, kv_len: int, is_causal: bool, window: int | None,
                   interpret: bool, softcap: float | None = None, chunk: int | None = None):
    """The kernel for one example's shapes (its mask's block map is worked out here, once, in NumPy)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (q_len, kv_len)
    if chunk is not None:
        mask = masks.ChunkedCausalMask(shape, chunk)  # not among the package's exports
    elif window is not None:
        mask = sa.LocalMask(shape, (window - 1, 0 if is_causal else window - 1), offset=0)
    else:
        mask = sa.CausalMask(shape) if is_causal else sa.FullMask(shape)
    block = splash_block(q_len, kv_len)
    blocks = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                           block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    make = sa.make_splash_mqa if kv_heads == 1 else sa.make_splash_mha
    with jax.ensure_compile_time_eval():  # its block map as arrays, not values of the trace it is first made in
        return make(sa.MultiHeadMask([mask] * heads), block_sizes=blocks, head_shards=1, q_seq_shards=1,
                    attn_logits_soft_cap=softcap, interpret=interpret)
