"""Unlike layers: a GPT's layers when they differ in shape or in what each takes, run one after another rather
than scanned (Gemma 4's: global layers with wider heads than the sliding ones, the last layers reusing an earlier
layer's keys and values, each layer fed its own slice of a per-layer embedding).

Each layer is a Block (its attention, MLP and norms) with, where the model has them, a per-layer input (a gate
from the layer's output to the per-layer width, times the layer's slice of the per-layer inputs, projected back
and normed into the residual stream) and a scalar on its output. A layer that shares keys and values projects
none: it attends over those of the last earlier layer with its window, as that layer rotated and normed them.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from shard.nn.hooks import layer as remat_layer
from shard.nn.partition import constrain

from .layers import Block, MLPBlock, lookup, norm, param, stacked

LAYER_TYPES = ("attention", "deltanet")


class Layer(nnx.Module):
    """A Block and what a layer of unlike layers adds: per_layer > 0, the per-layer input's gate (embed ->
    per_layer), projection (per_layer -> embed) and norm; scalar: a learned scalar on the layer's output (Gemma 4's
    layer_scalar); act: the gate's activation."""

    def __init__(self, block: Block, d_model: int, per_layer: int, scalar: bool, norm_kind: str, eps: float,
                 out_std: float, rngs: nnx.Rngs, act=jax.nn.gelu):
        self.block, self.act = block, act
        self.gate = param(rngs, (d_model, per_layer), ("embed", None), 0.02) if per_layer else None
        self.proj = param(rngs, (per_layer, d_model), (None, "embed"), out_std) if per_layer else None
        self.ln_per_layer = norm(norm_kind, d_model, rngs, eps) if per_layer else None
        self.scalar = nnx.Param(jnp.ones((1,)), out_sharding=(None,), role="norm") if scalar else None

    def __call__(self, x, per_layer_input=None, shared=None, keep=None, reuse=None):
        x, kv = self.block.with_kv(x, shared, keep, reuse)
        if self.gate is not None:
            h = self.act(x @ self.gate[...]) * per_layer_input
            x = x + self.ln_per_layer(h @ self.proj[...])
        if self.scalar is not None:
            x = x * self.scalar[...].astype(x.dtype)
        return constrain(x, ("batch", "length", "embed")), kv


class Beside(nnx.Module):
    """Gemma 4's MoE block: a dense MLP and the experts side by side on the residual stream, each with a norm before
    and after it, their outputs summed; the router reads the residual stream itself. It norms its own input (the
    Block has no norm before it, only the one after)."""
    normalizes_input = True

    def __init__(self, dense: MLPBlock, experts: nnx.Module, d_model: int, norm_kind: str, eps: float,
                 rngs: nnx.Rngs):
        self.dense, self.experts = dense, experts
        self.ln_dense, self.ln_dense_post, self.ln_experts, self.ln_experts_post = (
            norm(norm_kind, d_model, rngs, eps) for _ in range(4))

    def __call__(self, x):
        h = self.ln_dense_post(self.dense(self.ln_dense(x)))
        return h + self.ln_experts_post(self.experts(self.ln_experts(x), route_from=x))


def sources(windows: list, shared: int) -> list:
    """For each layer, the earlier layer whose keys and values it reuses (None: its own): the last `shared` layers
    reuse those of the last layer before them with their window (Gemma 4's num_kv_shared_layers)."""
    n = len(windows)
    first = n - shared
    out = [None] * n
    for i in range(first, n):
        same = [j for j in range(first) if windows[j] == windows[i]]
        if not same:
            raise ValueError(f"shared_kv_layers={shared}: layer {i} (window {windows[i]}) reuses the keys and values "
                             f"of an earlier layer with its window, and none of the first {first} layers has it")
        out[i] = same[-1]
    return out


class PerLayerInputs(nnx.Module):
    """Gemma 4's per-layer embeddings: each token's row of a second table (n_layers x width wide, scaled by
    sqrt(width)) added to the embedded token projected to the same width (scaled by 1/sqrt(d_model), normed over
    each layer's slice), the sum over sqrt(2): (batch, length, n_layers, width)."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, width: int, norm_kind: str, eps: float,
                 rngs: nnx.Rngs):
        self.n_layers, self.width, self.d_model = n_layers, width, d_model
        self.tok = param(rngs, (vocab, n_layers * width), ("vocab", None), 0.02)
        self.proj = param(rngs, (d_model, n_layers * width), ("embed", None), 0.02)
        self.ln = norm(norm_kind, width, rngs, eps)

    def __call__(self, tokens, x):
        rows = lookup(constrain(self.tok[...], ("vocab", None)), tokens) * jnp.asarray(self.width ** 0.5, x.dtype)
        shape = (*tokens.shape, self.n_layers, self.width)
        mixed = (x @ self.proj[...]) * jnp.asarray(self.d_model ** -0.5, x.dtype)
        mixed = self.ln(mixed.reshape(shape))
        return (mixed + rows.reshape(shape).astype(mixed.dtype)) * jnp.asarray(2 ** -0.5, mixed.dtype)


def run(layers: nnx.List, x, sources: list, per_layer=None):
    """The layers in order, each through the run's activation checkpointing (shard.nn.hooks.layer), the keys and
    values of each layer some later one reuses handed to it (and named, for generation's caches)."""
    kept = {}
    reused = set(s for s in sources if s is not None)
    for i, one in enumerate(layers):
        source = sources[i]
        name = f"layer{source if source is not None else i}"
        shared = kept.get(source)
        extra = None if per_layer is None else per_layer[:, :, i]
        apply = _applying(name if i in reused else None, name if source is not None else None)
        x, kv = remat_layer(apply)(one, x, extra, shared)
        if i in reused:
            kept[i] = kv
    return x


def _applying(keep, reuse):
    """A layer's call with its names bound (activation checkpointing takes array arguments alone)."""
    def apply(one, x, per_layer_input, shared):
        return one(x, per_layer_input, shared, keep, reuse)
    return apply


def layers(make_block, n_layers: int, d_model: int, d_ff: int, rngs: nnx.Rngs, *, windows: list, rotations, rope,
           local_rope, head_dim: int, kv_heads: int, norm: str, eps: float, out_std: float, act, global_head_dim: int,
           global_kv_heads: int, values_from_keys: bool, shared_kv_layers: int, wide_shared_mlp: bool,
           per_layer_dim: int, layer_scalar: bool) -> tuple[nnx.Module, list | None]:
    """(the layers, each one's source of keys and values): `make_block(rngs, ...)` builds each layer's Block with its
    own window, rotation, head size and key/value heads; the GPT's docstring says what each option does. Layers that
    reuse no other's keys and take no per-layer inputs are stacked a period of their pattern at a time (a scan: Gemma
    4's five sliding layers and a global one; `periodic`), with no sources (None); the others are a list."""
    if not 0 <= shared_kv_layers < n_layers:
        raise ValueError(f"shared_kv_layers={shared_kv_layers}: give fewer than the {n_layers} layers (at least one "
                         "computes the keys and values the others reuse)")
    source = sources(windows, shared_kv_layers)
    turns = [1] * n_layers if rotations is None else list(rotations)

    def build(rngs, i):
        wide = not windows[i]  # a global layer: Gemma 4's full attention
        block = make_block(rngs, windows=None, fixed_window=windows[i],
                           rope={0: None, 1: rope, 2: local_rope}[turns[i]],
                           head_dim=(global_head_dim if wide else 0) or head_dim,
                           kv_heads=(global_kv_heads if wide else 0) or kv_heads,
                           values_from_keys=values_from_keys and wide and source[i] is None,
                           own_kv=source[i] is None,
                           dense_ff=2 * d_ff if wide_shared_mlp and source[i] is not None else 0)
        return Layer(block, d_model, per_layer_dim, layer_scalar, norm, eps, out_std, rngs, act)

    if not shared_kv_layers and not per_layer_dim:
        kinds = list(zip(windows, turns))
        return periodic(build, [kinds.index(k) for k in kinds], rngs), None
    return nnx.List([build(rngs, i) for i in range(n_layers)]), source


# ----------------------------------------------------------------------------- a repeating pattern, scanned
# Layers that differ in a pattern that repeats (Qwen3.5: three gated DeltaNet layers, then a full attention one) scan
# one period at a time: the compiled program holds one period, whatever the depth, each layer in it its own kind.

class Period(nnx.Module):
    """One period of a pattern of unlike layers, applied in order: the unit a stack scans."""

    def __init__(self, layers: list):
        self.layers = nnx.List(layers)

    def __call__(self, x):
        for one in self.layers:
            x = one(x)
            if isinstance(x, tuple):  # a Layer of unlike layers: (its output, its keys and values)
                x = x[0]
        return x


def period(types: list) -> int:
    """The shortest period of a pattern: the least p dividing its length with types[i] == types[i % p] for every i."""
    n = len(types)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(t == types[i % p] for i, t in enumerate(types)))


def check_types(types: list, n_layers: int, deltanet: dict | None) -> None:
    if not isinstance(types, (list, tuple)) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types={types}: give one of {', '.join(LAYER_TYPES)} per layer, {n_layers} in all")
    if "deltanet" in types and deltanet is None:
        raise ValueError("layer_types has deltanet layers: give their sizes with deltanet")


def periodic(make, types: list, rngs: nnx.Rngs) -> nnx.Module:
    """The layers of `types` as a stack of periods (`make(rngs, kind)` builds one layer), stacked on `layers`: one
    entry per period, so the stack's layers axis counts periods."""
    p = period(list(types))
    return stacked(len(types) // p, lambda rngs: Period([make(rngs, kind) for kind in types[:p]]), rngs)
