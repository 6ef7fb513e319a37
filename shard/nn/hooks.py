"""The choices a model leaves to the framework: how its stack of layers runs (a scan, or a pipeline
over the `stage` mesh axis), activation checkpointing, the attention kernel, where each token of
a sequence sits (context parallelism), and what it keeps between calls while generating.

A model runs its stacked layers with `stack(layers, x)`, applies a single layer through `layer(fn)`,
computes attention with `attention(q, k, v, is_causal=...)`, takes its tokens' positions from
`positions(length)`, multiplies token activations by a weight matrix with `dense(x, w)`, runs a mixture of
experts' tokens through their experts with `experts(mlp, x, top_e, top_p, weights)` (their grouped products by
`grouped_matmul(x, w, sizes)`) and runs a
recurrence over time with `recurrence(step, carry, xs)`; what those do
is set by the run (`mesh.stage` and `pipeline.*`, `train.remat`, `train.attention`, `mesh.context` and
`train.context_strategy`; the mesh, for the experts; generation's caches, shard/nn/decoding.py; export's
unrolled layers) while its step is traced, under `use(...)`. Outside the framework they are plain JAX (a scan,
no remat, XLA's attention, positions in order, the experts on one device), so a model stays an ordinary Flax
module.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shard.errors import UserError
from shard.nn import attention as attn
from shard.nn import decoding, deferred, dropless, grouped, partition, ring

# A function a model names so (`fn.__name__ = NOT_MODEL_FLOPS`) is left out of its FLOP count (shard/core/flops.py):
# e.g. an embedding lookup written as a one-hot matrix product, which is no model work.
NOT_MODEL_FLOPS = "not_model_flops"

_REMAT: contextvars.ContextVar = contextvars.ContextVar("shard_remat", default="none")
_ATTENTION: contextvars.ContextVar = contextvars.ContextVar("shard_attention", default="xla")
_PIPELINE: contextvars.ContextVar = contextvars.ContextVar("shard_pipeline", default=None)
_STACKS: contextvars.ContextVar = contextvars.ContextVar("shard_stacks_seen", default=None)
_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("shard_context_split", default=None)
_DECODE: contextvars.ContextVar = contextvars.ContextVar("shard_decode_calls", default=None)
_UNROLL: contextvars.ContextVar = contextvars.ContextVar("shard_unroll_layers", default=False)
_PACKED: contextvars.ContextVar = contextvars.ContextVar("shard_packed_rows", default=None)
_GROUPED: contextvars.ContextVar = contextvars.ContextVar("shard_grouped_matmul", default="xla")
_EXCHANGE: contextvars.ContextVar = contextvars.ContextVar("shard_expert_exchange", default="padded")
_NEXT: contextvars.ContextVar = contextvars.ContextVar("shard_next_tokens", default=None)


# train.remat -> what a layer keeps for the backward pass; the rest is recomputed from the layer's input.
# qkv and attention keep the arrays `attention` names with checkpoint_name: its query, key and value (rotated),
# and its output; keeping the output too spares recomputing XLA's attention's weighted sum of the values (a fused
# kernel's backward reruns its forward either way), the MLP is recomputed either way (MaxText's
# save_dot_with_context_except_mlp). offload keeps what dots keeps, in host memory.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "qkv": jax.checkpoint_policies.save_only_these_names(attn.QUERY, attn.KEY, attn.VALUE),
    "attention": jax.checkpoint_policies.save_only_these_names(attn.QUERY, attn.KEY, attn.VALUE, attn.OUTPUT),
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


@contextlib.contextmanager
def use(remat: str = "none", attention: str = "xla", pipeline=None, split: ring.Split | None = None,
        decode: decoding.Calls | None = None, unroll: bool = False, grouped_matmul: str = "xla",
        expert_exchange: str = "padded"):
    """While tracing: `layer` applies this activation-checkpointing policy, `attention` this kernel,
    `stack` hands its layers to `pipeline(layers, x)` (shard/strategies/pipeline.py's Schedule; None: a scan), and
    under context parallelism (`split`) attention runs over the context devices and `positions` gives
    the tokens' positions in their load-balanced order. `decode`: generating, attention, positions,
    stacks and recurrences keep their state in these calls' entries (shard/nn/decoding.py). `unroll`: the
    stack runs its layers one after another in Python, without a scan (train.scan_layers=false, ONNX export).
    `grouped_matmul`: the kernel of `grouped_matmul` (shard/nn/grouped.py); `expert_exchange`: how `experts`
    moves the pairs under expert parallelism (shard/nn/dropless.py's `exchange`; auto resolved by the device)."""
    variables = ((_REMAT, remat), (_ATTENTION, attention), (_PIPELINE, pipeline), (_CONTEXT, split),
                 (_DECODE, decode), (_UNROLL, unroll), (_GROUPED, grouped_matmul), (_EXCHANGE, expert_exchange))
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


@contextlib.contextmanager
def next_tokens(targets: jax.Array, weights: jax.Array | None = None):
    """While the train step's language-model loss runs the model: each position's next token (batch, length) and,
    for packed rows, each target's weight (0: not trained on), for a model that trains on tokens further ahead
    (multi-token prediction, models/mtp.py) without a second argument. Eval, generation, DPO and GRPO set none."""
    token = _NEXT.set((targets, weights))
    try:
        yield
    finally:
        _NEXT.reset(token)


def upcoming() -> tuple | None:
    """(next tokens, their weights or None, the packed rows' segment ids or None) while the train step's loss runs,
    else None."""
    given, rows = _NEXT.get(), _PACKED.get()
    return None if given is None else (*given, None if rows is None else rows[0])


def positions(length: int) -> jax.Array:
    """The position of each of a sequence's `length` tokens as the step lays them out: 0..length-1, or
    under context parallelism the load-balanced order (shard/nn/ring.py), or while generating
    each row's positions after those it has cached (batch, length; shard/nn/decoding.py), or in a packed
    batch each token's place in its own document (batch, length). Position embeddings, learned or rotary,
    index with this so they follow the tokens."""
    calls = _DECODE.get()
    if calls is not None:
        return calls.positions(length)
    if (rows := _PACKED.get()) is not None and rows[1].shape[-1] == length:
        return rows[1]
    return ring.positions(_CONTEXT.get(), length)


def layout(length: int) -> jax.Array:
    """Where each of a row's `length` tokens stands in the row as the step lays them out (0..length-1, or
    the load-balanced order under context parallelism), whatever document it belongs to: for a model that
    orders tokens by their place in the row (a mixture of experts' queue), not by position embedding."""
    return ring.positions(_CONTEXT.get(), length)


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
    return scan(layers, x) if pipeline is None else pipeline(layers, x)


def scan(layers: nnx.Module, x):
    """The stacked layers in order, one at a time, each through `layer`: a scan (the compiled program holds one
    layer), or under `use(unroll=True)` the layers written out one after another (`unrolled`). A weight the run
    builds per layer (shard/nn/deferred.py: a quantized base plus adapters) is built in the layer. A
    pipeline's stages run their share of the layers through this too, so train.scan_layers and train.remat apply
    there."""
    if _UNROLL.get():
        return unrolled(layers, x)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def run(x, one):
        return layer(deferred.in_layers(_REMAT.get() != "none"))(one, x)

    return run(x, layers)


def scan_decoding(layers: nnx.Module, x, calls: decoding.Calls):
    """The scan of `scan`, over the layers' decoding entries too: each layer's calls take and put theirs. After
    the prefill the stacked entries ride in the scan's carry, each layer writing its new tokens into them in
    place (as the scan's input and output they would be copied whole at every step). A stack whose layers keep
    caches of different kinds (decoding.Kinds: local and global layers) starts from its empty caches, carried."""
    given = calls.take()
    if given is None:
        given = stack_caches(layers, x, calls)
    if given is not None:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def carried(carry, one):
            x, entries, i = carry
            inner = calls.inner(entries, layer=i)
            token = _DECODE.set(inner)
            try:
                return _call(one, x), inner.made, i + 1
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
            return _call(one, x), inner.made
        finally:
            _DECODE.reset(token)

    x, made = run(x, layers, given)
    calls.put(made)
    return x


def _call(one: nnx.Module, x):
    """One layer applied while generating (no backward pass), its weights built first where the run builds them."""
    return deferred.in_layers(checkpointed=True)(one, x)


def stack_caches(layers: nnx.Module, x, calls: decoding.Calls) -> list | None:
    """The empty entries of a stack whose layers keep caches of different kinds (None for any other stack): one
    layer traced abstractly (nothing computed) shows each call's entry, a Kinds already the whole stack's, any
    other one layer's, stacked here on the `layers` axis."""
    graphdef, state = nnx.split(layers)

    def first(state, x):
        probe = calls.inner(None)
        token = _DECODE.set(probe)
        try:
            _call(nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state)), x)
        finally:
            _DECODE.reset(token)
        return probe.made

    made = jax.eval_shape(first, state, x)
    if not any(isinstance(e, decoding.Kinds) for e in made):
        return None
    n = jax.tree.leaves(state)[0].shape[0]
    return [jax.tree.map(lambda a, whole=isinstance(e, decoding.Kinds): jnp.zeros(a.shape if whole else (n, *a.shape),
                                                                                    a.dtype), e) for e in made]


def unrolled(layers: nnx.Module, x):
    """The stacked layers in order as a Python loop over their slices, each through `layer` (a program with every
    layer written out: the compiler schedules across layers, and converters that do not take Flax's scan read it);
    what a layer updates is written back, as by `scan`."""
    graphdef, state = nnx.split(layers)
    apply = layer(deferred.in_layers(_REMAT.get() != "none"))
    updated = []
    for i in range(jax.tree.leaves(state)[0].shape[0]):
        one = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        x = apply(one, x)
        updated.append(nnx.state(one, nnx.Not(nnx.Param)))  # a call changes no parameter: no copy of them
    if jax.tree.leaves(updated[0]):
        nnx.update(layers, jax.tree.map(lambda *a: jnp.stack(a), *updated))
    return x


def recurrence(step, carry, xs):
    """`jax.lax.scan(step, carry, xs)` for a model's recurrence over time (an LSTM's), xs time-major and the
    carry's arrays batch-major: while generating, it goes on from the carry the previous call ended with
    (shard/nn/decoding.py); over packed rows, the carry goes back to the one it started with at each
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


def linear_recurrence(whole, step, carry, xs):
    """A recurrence a model computes for a whole sequence at once while training (`whole(carry, xs)`, a chunked form
    equal to jax.lax.scan(step, carry, xs): a gated DeltaNet's) and token by token where the state must pass between
    calls or restart inside a row: while generating and over packed rows (`recurrence`). Its state runs along the
    sequence, which context parallelism splits: refused in one line there."""
    if (split := _CONTEXT.get()) is not None and split.size > 1:
        raise UserError("mesh.context > 1: a linear-attention (gated DeltaNet) layer's state runs along the whole "
                        "sequence and is not carried across the context devices; use mesh.context=1")
    if _DECODE.get() is not None or _PACKED.get() is not None:
        return recurrence(step, carry, xs)
    return whole(carry, xs)


def generating() -> bool:
    """Whether the model is called to generate (its attention over a cache): a layer whose cheapest form then
    differs asks (latent attention's up-projections absorbed into its queries and output, models/latent.py)."""
    return _DECODE.get() is not None


def layer(fn):
    """Wrap the function that applies one layer with the active activation-checkpointing policy (`train.remat`):
    none keeps every activation, full recomputes the layer in the backward pass, dots keeps only matrix-product
    outputs, qkv attention's query, key and value, attention those and its output, offload the matrix-product
    outputs in host memory (REMAT_POLICIES). A model calls this instead of choosing a policy."""
    policy = REMAT_POLICIES.get(_REMAT.get())
    if policy is None:
        return fn
    return nnx.remat(fn, policy=policy)


# ----------------------------------------------------------------------------- attention
# The kernels, and which one runs, are shard/nn/attention.py's.

def attention(q: jax.Array, k: jax.Array, v: jax.Array | None, *, is_causal: bool, window=None,
              softcap: float | None = None, scale: float | None = None, sinks: jax.Array | None = None,
              chunk=None, keep: str | None = None, reuse: str | None = None, values: int | None = None) -> jax.Array:
    """Scaled dot-product attention over (batch, length, heads, head_dim) arrays with the active kernel
    (`train.attention`: XLA's products, cuDNN's or splash's fused kernel), or over the context devices, the
    packed documents or the generation cache where the run has them. A model calls this instead of choosing a
    kernel; outside the framework it is XLA's. The inputs and output carry the checkpoint names of
    shard/nn/attention.py (QUERY, KEY, VALUE, OUTPUT) for remat policies.

    window: a query sees only the `window` nearest keys, itself included (causal: the latest ones; else that
      many on each side). None or 0: global. Layers that differ inside one scanned stack hand
      `(value, windows)`: `windows` the static tuple of every layer's window in the stack, in order (0 for a
      global layer), `value` this layer's own, a traced int32 scalar (a models.layers.PerLayer read in the
      layer's call). The XLA kernel masks by the traced value; the fused kernels, which take a static window,
      run the call compiled for each distinct window of `windows` that `value` selects (jax.lax.switch);
      the FLOP count weighs each window by how many layers have it.
    softcap: attention-logit soft-capping (Gemma 2's), logits = softcap * tanh(logits / softcap), applied after
      the scale and before the mask and softmax. cuDNN has none: `auto` runs XLA's kernel then, and an
      explicit train.attention=cudnn is refused in one line.
    scale: the factor on q.k (None: 1/sqrt(head_dim)).
    sinks: attention sinks (GPT-OSS's), a (heads,) array with one logit per query head (head = kv_head * groups
      + group): it joins its head's softmax as one more key that weighs no value, so a query may attend to
      nothing: out = sum_j exp(l_j) v_j / (exp(sinks[h]) + sum_j exp(l_j)). Every path takes them, with their
      gradient; cuDNN's kernel has none: `auto` runs XLA's kernel then, an explicit train.attention=cudnn is refused.
    chunk: chunked attention (Llama 4's attention_chunk_size C): causal, and a query at position p sees a key at s
      only if s // C == p // C, positions as `positions` gives them (a packed document's from its start; a cache's
      from the row's first real token). None or 0: unchunked; `(value, chunks)` per layer of a stack, as a window
      (shard/nn/masks.py). Needs is_causal and no sliding window on the same call (one line otherwise); cuDNN has
      no chunk mask: `auto` runs XLA's kernel then, an explicit train.attention=cudnn is refused.
    keep, reuse: keys and values one layer computes and later layers of the same call reuse (Gemma 4's KV sharing):
      the layer that computes them names them with `keep`, each later one hands the same k and v with `reuse` set to
      that name. Only generation needs the names: there the reusing layers attend over the keeper's cache and keep
      none of their own.
    values: the values are the keys' first `values` channels and `v` is None (latent attention's absorbed form: one
      latent per token serves as key and value); the generation cache then holds the keys alone.
    """
    if values is not None:
        if v is not None or window or chunk or keep or reuse:
            raise ValueError("attention with values=N takes the values from the keys (v=None), without a window, "
                             "chunk or shared keys and values")
        if (calls := _DECODE.get()) is not None:
            return decoding.attend_keys(q, checkpoint_name(k, attn.KEY), bool(is_causal), calls, values,
                                        softcap=softcap, scale=scale, sinks=sinks)
        return attention(q, k, k, is_causal=is_causal, softcap=softcap, scale=scale, sinks=sinks)[..., :values]
    if sinks is not None and tuple(jnp.shape(sinks)) != (q.shape[2],):
        raise UserError(f"attention: sinks of shape {tuple(jnp.shape(sinks))}; one logit per query head, "
                        f"({q.shape[2]},)")
    q, k, v = (checkpoint_name(x, name) for x, name in ((q, attn.QUERY), (k, attn.KEY), (v, attn.VALUE)))
    split = _CONTEXT.get()
    options = dict(window=window, softcap=softcap, scale=scale, sinks=sinks, chunk=chunk)
    if (calls := _DECODE.get()) is not None:  # generating: over the cached keys and values
        return decoding.attend(q, k, v, bool(is_causal), calls, keep=keep, reuse=reuse, **options)
    segments = places = None
    if (rows := _PACKED.get()) is not None:
        segments, places = rows
        if segments.shape != q.shape[:2] or k.shape[1] != q.shape[1]:
            raise UserError(f"data.packing=documents: attention over {q.shape[:2]} (batch, length) queries and "
                            f"{k.shape[1]} keys does not match the batch's segment ids {segments.shape}; packed "
                            "rows need self-attention over whole rows (a pipeline's microbatches do not carry them)")
    if split is not None and split.size > 1:  # the sequence is split over the context devices
        out = ring.attention(q, k, v, bool(is_causal), split, segments, places=places, **options)
    else:
        out = attn.run(q, k, v, bool(is_causal), _ATTENTION.get(), segments, places=places, **options)
    return checkpoint_name(out, attn.OUTPUT)


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


# ----------------------------------------------------------------------------- experts

def experts(mlp, x: jax.Array, top_e: jax.Array, top_p: jax.Array, weights: tuple, slack: float = 1.25,
            weigh_inputs: bool = False) -> jax.Array:
    """Dropless mixture-of-experts routing: each token of (batch, length, d) x through each of its experts, top_e
    and top_p (batch, length, k) its choices and their weights; returns their weighted sum, x's shape (weigh_inputs:
    each choice's input weighed instead, its output summed as it is). weights: the experts' arrays, each with the
    experts first (logical name `experts`); mlp(xs, sizes, weights) -> ys runs each expert on its run of xs's rows
    (sorted by expert, sizes[i] rows for expert i: `grouped_matmul`'s groups; rows past the runs must come out zero,
    as it writes them). Under a mesh each device sorts its own tokens, its experts' tokens sent to it by all-to-all
    in buckets of `slack` times a fair share, more rounds where one overflows (shard/nn/dropless.py); outside the
    framework, and inside a pipeline's stages, all on one device."""
    if (active := partition.active()) is None or _PIPELINE.get() is not None:
        return dropless.local(mlp, x, top_e, top_p, weights, weigh_inputs)
    return dropless.split(mlp, x, top_e, top_p, weights, *active, slack=slack, weigh_inputs=weigh_inputs,
                          kernel=_GROUPED.get(), remat=_REMAT.get() != "none",
                          exchange=dropless.resolve(_EXCHANGE.get(), active[0].devices.flat[0]))


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """x (m, k) rows sorted by group times w (g, k, n), sizes[i] rows in group i (jax.lax.ragged_dot's contract)
    with the run's kernel (`train.grouped_matmul`, shard/nn/grouped.py); outside the framework, ragged_dot."""
    active = partition.active()
    return grouped.matmul(x, w, sizes, _GROUPED.get(), active[0].devices.flat[0] if active else None)
