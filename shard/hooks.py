"""The choices a model leaves to the framework: how its stack of layers runs (a scan, or a pipeline
over the `stage` mesh axis), activation checkpointing, the attention kernel, where each token of
a sequence sits (context parallelism), and what it keeps between calls while generating.

A model runs its stacked layers with `stack(layers, x)`, applies a single layer through `layer(fn)`,
computes attention with `attention(q, k, v, is_causal=...)`, takes its tokens' positions from
`positions(length)`, multiplies token activations by a weight matrix with `dense(x, w)` and runs a
recurrence over time with `recurrence(step, carry, xs)`; what those do
is set by the run (`mesh.stage` and `pipeline.*`, `train.remat`, `train.attention`, `mesh.context` and
`train.context_strategy`; generation's caches, shard/use/decoding.py; export's unrolled layers) while its
step is traced, under `use(...)`. Outside the framework they are plain JAX (a scan, no remat, XLA's
attention, positions in order), so a model stays an ordinary Flax module.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from shard.strategies import context
from shard.use import decoding
from shard.errors import UserError

_REMAT: contextvars.ContextVar = contextvars.ContextVar("shard_remat", default="none")
_ATTENTION: contextvars.ContextVar = contextvars.ContextVar("shard_attention", default="xla")
_PIPELINE: contextvars.ContextVar = contextvars.ContextVar("shard_pipeline", default=None)
_STACKS: contextvars.ContextVar = contextvars.ContextVar("shard_stacks_seen", default=None)
_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("shard_context_split", default=None)
_DECODE: contextvars.ContextVar = contextvars.ContextVar("shard_decode_calls", default=None)
_UNROLL: contextvars.ContextVar = contextvars.ContextVar("shard_unroll_layers", default=False)
_PACKED: contextvars.ContextVar = contextvars.ContextVar("shard_packed_rows", default=None)


# train.remat -> what a layer keeps for the backward pass (everything, nothing, or matmul outputs).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@contextlib.contextmanager
def use(remat: str = "none", attention: str = "xla", pipeline=None, split: context.Split | None = None,
        decode: decoding.Calls | None = None, unroll: bool = False):
    """While tracing: `layer` applies this activation-checkpointing policy, `attention` this kernel,
    `stack` hands its layers to `pipeline(layers, x)` (shard/strategies/pipeline.py's Schedule; None: a scan), and
    under context parallelism (`split`) attention runs over the context devices and `positions` gives
    the tokens' positions in their load-balanced order. `decode`: generating, attention, positions,
    stacks and recurrences keep their state in these calls' entries (shard/use/decoding.py). `unroll`: the
    stack runs its layers one after another in Python, without a scan (ONNX export)."""
    variables = ((_REMAT, remat), (_ATTENTION, attention), (_PIPELINE, pipeline), (_CONTEXT, split),
                 (_DECODE, decode), (_UNROLL, unroll))
    tokens = [var.set(value) for var, value in variables]
    try:
        yield
    finally:
        for (var, _), token in zip(variables, tokens):
            var.reset(token)


@contextlib.contextmanager
def packed(segment_ids: jax.Array | None, token_positions: jax.Array | None):
    """While the step runs the model on a packed batch (data.packing=documents): each row's document ids
    (batch, length; 0 = padding), which attention keeps apart, and each token's position in its document,
    which `positions` returns. None (an unpacked batch): nothing changes."""
    token = _PACKED.set(None if segment_ids is None else (segment_ids, token_positions))
    try:
        yield
    finally:
        _PACKED.reset(token)


def positions(length: int) -> jax.Array:
    """The position of each of a sequence's `length` tokens as the step lays them out: 0..length-1, or
    under context parallelism the load-balanced order (shard/strategies/context.py), or while generating
    each row's positions after those it has cached (batch, length; shard/use/decoding.py), or in a packed
    batch each token's place in its own document (batch, length). Position embeddings, learned or rotary,
    index with this so they follow the tokens."""
    calls = _DECODE.get()
    if calls is not None:
        return calls.positions(length)
    if (rows := _PACKED.get()) is not None and rows[1].shape[-1] == length:
        return rows[1]
    return context.positions(_CONTEXT.get(), length)


def layout(length: int) -> jax.Array:
    """Where each of a row's `length` tokens stands in the row as the step lays them out (0..length-1, or
    the load-balanced order under context parallelism), whatever document it belongs to: for a model that
    orders tokens by their place in the row (a mixture of experts' queue), not by position embedding."""
    return context.positions(_CONTEXT.get(), length)


@contextlib.contextmanager
def watch_stacks():
    """Yields a list that gets the layer count of every `stack` call traced inside (the checks of
    pipeline parallelism need to know whether, and how deep, a model stacks its layers)."""
    seen: list[int] = []
    token = _STACKS.set(seen)
    try:
        yield seen
    finally:
        _STACKS.reset(token)


def stack(layers: nnx.Module, x):
    """Apply stacked layers (a module whose arrays have a leading `layers` axis) to x, in order: a
    scan, or under `mesh.stage > 1` a pipeline over the stages. A layer must map x to an array of
    x's shape. Variables a layer updates in its call (normalisation statistics, auxiliary losses)
    are written back (under a pipeline: their mean over the microbatches)."""
    seen, pipeline = _STACKS.get(), _PIPELINE.get()
    if seen is not None:
        seen.append(jax.tree.leaves(nnx.state(layers))[0].shape[0])
    if (calls := _DECODE.get()) is not None:
        return scan_decoding(layers, x, calls)
    if _UNROLL.get():
        return unrolled(layers, x)
    return scan(layers, x) if pipeline is None else pipeline(layers, x)


def scan(layers: nnx.Module, x):
    """The stacked layers in order, one at a time (the compiled program holds one layer)."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def run(x, one):
        return layer(lambda one, x: one(x))(one, x)

    return run(x, layers)


def scan_decoding(layers: nnx.Module, x, calls: decoding.Calls):
    """The scan of `scan`, over the layers' decoding entries too: each layer's calls take and put theirs. After
    the prefill the stacked entries ride in the scan's carry, each layer writing its new tokens into them in
    place (as the scan's input and output they would be copied whole at every step)."""
    given = calls.take()
    if given is not None:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def carried(carry, one):
            x, entries, i = carry
            inner = calls.inner(entries, layer=i)
            token = _DECODE.set(inner)
            try:
                return one(x), inner.made, i + 1
            finally:
                _DECODE.reset(token)

        x, made, _ = carried((x, given, jnp.int32(0)), layers)
        calls.put(made)
        return x

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
    def run(x, one, entries):
        inner = calls.inner(entries)
        token = _DECODE.set(inner)
        try:
            return one(x), inner.made
        finally:
            _DECODE.reset(token)

    x, made = run(x, layers, given)
    calls.put(made)
    return x


def unrolled(layers: nnx.Module, x):
    """The stacked layers in order as a Python loop over their slices (a program with every layer written
    out, for converters that do not take Flax's scan); what a layer updates is written back, as by `scan`."""
    graphdef, state = nnx.split(layers)
    updated = []
    for i in range(jax.tree.leaves(state)[0].shape[0]):
        one = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        x = one(x)
        updated.append(nnx.state(one))
    nnx.update(layers, jax.tree.map(lambda *a: jnp.stack(a), *updated))
    return x


def recurrence(step, carry, xs):
    """`jax.lax.scan(step, carry, xs)` for a model's recurrence over time (an LSTM's), xs time-major and the
    carry's arrays batch-major: while generating, it goes on from the carry the previous call ended with
    (shard/use/decoding.py); over packed rows, the carry goes back to the one it started with at each
    document's first token, so no state passes from one document into the next."""
    calls = _DECODE.get()
    if calls is not None:
        return decoding.recur(step, carry, xs, calls)
    if (rows := _PACKED.get()) is None:
        return jax.lax.scan(step, carry, xs)
    starts = rows[1].T == 0  # (length, batch): where a document begins
    if jax.tree.leaves(xs)[0].shape[0] != starts.shape[0] or any(
            c.shape[:1] != starts.shape[1:] for c in jax.tree.leaves(carry)):
        raise UserError(f"data.packing=documents: a recurrence over packed rows {rows[1].shape} needs its inputs "
                        "time-major and its carry batch-major, to restart it at each document")

    def restarting(state, x):
        x, start = x
        state = jax.tree.map(lambda c, c0: jnp.where(start.reshape(-1, *(1,) * (c.ndim - 1)), c0, c), state, carry)
        return step(state, x)

    return jax.lax.scan(restarting, carry, (xs, starts))


def layer(fn):
    """Wrap the function that applies one (scanned) layer with the active activation-checkpointing
    policy (`train.remat`): none keeps every activation, full recomputes the layer in the backward
    pass, dots keeps only matrix-product outputs. A model calls this instead of choosing a policy."""
    policy = REMAT_POLICIES.get(_REMAT.get())
    if policy is None:
        return fn
    return nnx.remat(fn, policy=policy)


# ----------------------------------------------------------------------------- attention

# cuDNN's fused (flash) attention: NVIDIA GPUs, half-precision inputs, head sizes up to 128 in steps of 8.
CUDNN_DTYPES = ("bfloat16", "float16")


def check_attention(attention: str, device, dtype) -> None:
    """Fail early, in one line, when `train.attention` cannot run on this device and compute dtype."""
    if attention == "cudnn" and (device.platform != "gpu" or str(dtype) not in CUDNN_DTYPES):
        raise UserError(f"train.attention=cudnn needs an NVIDIA GPU and train.dtype=bfloat16, got a "
                        f"{device.platform} device and {dtype}; use train.attention=xla")


# Every attention call is a jitted function of (q, k, v), and a packed batch's segment ids, with one of
# these names, so that shard/core/flops.py finds it in a step's jaxpr and counts its FLOPs from the shapes
# of the first three, whichever kernel runs inside (XLA's matrix products, or cuDNN's fused primitive that
# no FLOP count sees).
CAUSAL_NAME, FULL_NAME = "shard_attention_causal", "shard_attention_full"


def _kernel(q, k, v, implementation, is_causal, segments=None):
    if implementation == "xla" and jax.default_backend() == "cpu":
        return _cpu_attention(q, k, v, is_causal, segments)
    if segments is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation=implementation)
    # Packed rows: a query sees only keys of its own document (padding, id 0, sees padding: no empty row).
    mask = (segments[:, :, None] == segments[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, implementation=implementation)


def _cpu_attention(q, k, v, is_causal, segments=None):
    """jax.nn.dot_product_attention's XLA path, written so XLA's CPU backend compiles it faster: the
    scale applied to the queries rather than the scores, the causal mask one (length, length) table
    rather than a mask the size of the scores, and the products as 3-D batched products over (batch x
    key/value heads) with a query head's group folded into its rows, rather than 4-D products and a vmap
    over groups. The same products and float32 softmax; the default GPT's step on 2 cores: 62.9 -> 59.6
    ms for the first two, about 2 ms more for the 3-D products (bench/RESULTS.md)."""
    b, t, heads, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads  # query heads per key/value head (heads = kv_head * groups + group, as JAX's)
    q = q * jnp.asarray(d ** -0.5, q.dtype)
    q = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4).reshape(b * kv_heads, groups * t, d)
    k, v = (a.transpose(0, 2, 1, 3).reshape(b * kv_heads, s, a.shape[-1]) for a in (k, v))
    scores = jnp.einsum("nqd,nsd->nqs", q, k, preferred_element_type=jnp.float32)
    mask = jnp.tile(jnp.tri(t, s, dtype=bool), (groups, 1)) if is_causal else None
    if segments is not None:  # packed rows: a query sees its own document's keys only
        same = segments[:, :, None] == segments[:, None, :]  # (b, t, s)
        same = jnp.broadcast_to(same[:, None, None], (b, kv_heads, groups, t, s)).reshape(b * kv_heads, groups * t, s)
        mask = same if mask is None else mask & same
    if mask is not None:  # query i sees keys 0..i, aligned at the top left, masked with JAX's large negative
        scores = jnp.where(mask, scores, -0.7 * jnp.finfo(jnp.float32).max)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("nqs,nsd->nqd", probs, v)
    return out.reshape(b, kv_heads, groups, t, -1).transpose(0, 3, 1, 2, 4).reshape(b, t, heads, -1)


def _named(name: str, is_causal: bool):
    def fn(q, k, v, implementation, segments=None):  # flops.py reads the shapes of (q, k, v), the first three
        return _kernel(q, k, v, implementation, is_causal, segments)

    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn, static_argnames="implementation")


_CALLS = {True: _named(CAUSAL_NAME, True), False: _named(FULL_NAME, False)}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool) -> jax.Array:
    """Scaled dot-product attention over (batch, length, heads, head_dim) arrays with the active kernel
    (`train.attention`): XLA's own (any device), or cuDNN's fused flash attention. A model calls this
    instead of choosing a kernel; outside the framework it is XLA's."""
    implementation, split = _ATTENTION.get(), _CONTEXT.get()
    if (calls := _DECODE.get()) is not None:  # generating: over the cached keys and values
        return decoding.attend(q, k, v, bool(is_causal), calls)
    segments = None
    if (rows := _PACKED.get()) is not None:
        segments = rows[0]
        if segments.shape != q.shape[:2] or k.shape[1] != q.shape[1]:
            raise UserError(f"data.packing=documents: attention over {q.shape[:2]} (batch, length) queries and "
                            f"{k.shape[1]} keys does not match the batch's segment ids {segments.shape}; packed "
                            "rows need self-attention over whole rows (a pipeline's microbatches do not carry them)")
        if implementation == "cudnn":
            raise UserError("train.attention=cudnn with data.packing=documents: jax.nn.dot_product_attention's "
                            "cuDNN path takes no segment ids; use train.attention=xla")
    if split is not None and split.size > 1:  # the sequence is split over the context devices
        return context.attention(q, k, v, bool(is_causal), split, segments)
    head_dim = q.shape[-1]
    if implementation == "cudnn" and (head_dim > 128 or head_dim % 8):
        raise UserError(f"train.attention=cudnn needs a head size <= 128 and a multiple of 8, got {head_dim}; "
                        "use train.attention=xla")
    return _CALLS[bool(is_causal)](q, k, v, implementation=implementation, segments=segments)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x's last axis times the matrix w, for activations laid out (batch, length, ...): the same product
    as `x @ w`. The leading axes are merged into one first unless the sequence is split over the context
    devices (merging a split length with the batch would move data). Same math, but XLA's CPU backend
    compiles the 2-D product's backward without transposing the output gradient: a 3-D one's weight
    gradient contracts two axes, and XLA wrote the (tokens, width) gradient out transposed, in a strided
    elementwise loop (the default GPT's step: 75 -> 63 ms on 2 cores, bench/RESULTS.md)."""
    split = _CONTEXT.get()
    if x.ndim <= 2 or (split is not None and split.size > 1):
        return x @ w
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def attention_flops(q_shape, k_shape, v_shape, is_causal: bool) -> float:
    """Forward FLOPs of one attention call: the scores Q.K^T and the weighted sum P.V, 2 FLOPs per
    multiply-add, over the (query, key) pairs the output depends on. Causal attention counts only the
    pairs on or below the diagonal (L(L+1)/2 of L^2 for equal lengths): the work actually needed,
    which is what a fused kernel does; XLA's own computes the full square and masks half of it."""
    batch, q_len, heads, head_dim = q_shape
    k_len, v_dim = k_shape[1], v_shape[-1]
    if is_causal:  # query i sees keys 0..i (JAX's mask is aligned at the top left)
        m = min(q_len, k_len)
        pairs = m * (m + 1) // 2 + (q_len - m) * k_len
    else:
        pairs = q_len * k_len
    return 2.0 * batch * heads * pairs * (head_dim + v_dim)
