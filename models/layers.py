"""Building blocks shared by the transformers (gpt, vit, moe): parameters with logical names,
normalisation, rotary positions, attention, the feed-forward block, and layers stacked on a
`layers` axis (run by the framework's `shard.hooks.stack`: a scan, or a pipeline).

Logical names used here: embed (model width), heads / kv_heads / head_dim (attention), mlp
(feed-forward width), vocab. Which mesh axes they map to is decided in `shard.partition`.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from shard.hooks import attention, dense
from shard.partition import constrain

from .rope import Rope, rotary  # noqa: F401  (rotary: here for the models that import it from layers)


def param(rngs: nnx.Rngs, shape: tuple, names: tuple, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), out_sharding=names)


def zeros(shape: tuple, names: tuple) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape), out_sharding=names)


class OffsetRMSNorm(nnx.Module):
    """RMSNorm whose weight is stored as an offset from 1 (x_normed * (1 + scale), as Gemma's), normalised
    in float32."""

    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.scale = zeros((dim,), ("embed",))

    def __call__(self, x):
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * (1 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def norm(kind: str, dim: int, rngs: nnx.Rngs, eps: float = 1e-6) -> nnx.Module:
    """layernorm (with bias), rmsnorm, or rmsnorm+1 (the weight an offset from 1)."""
    if kind == "rmsnorm+1":
        return OffsetRMSNorm(dim, eps)
    scale = nnx.with_partitioning(nnx.initializers.ones, ("embed",))
    if kind == "rmsnorm":
        return nnx.RMSNorm(dim, epsilon=eps, rngs=rngs, scale_init=scale)
    return nnx.LayerNorm(dim, epsilon=eps, rngs=rngs, scale_init=scale,
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))


def check_choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; choose one of {', '.join(allowed)}")


class Attention(nnx.Module):
    """Self-attention, causal or not; with n_kv_heads < n_heads, groups of query heads share key/value heads.
    qkv_bias: biases on the query, key and value projections (Qwen2); out_bias: on the output one (GPT-2)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope: "Rope | float | None", out_std: float,
                 causal: bool, rngs: nnx.Rngs, head_dim: int = 0, qkv_bias: bool = False, out_bias: bool = False):
        head_dim = head_dim or d_model // n_heads
        self.rope = Rope(rope) if isinstance(rope, (int, float)) and rope else rope
        self.causal = causal
        self.q = param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), 0.02)
        self.kv = param(rngs, (d_model, 2, n_kv_heads, head_dim), ("embed", None, "kv_heads", "head_dim"), 0.02)
        self.out = param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"), out_std)
        self.q_bias = zeros((n_heads, head_dim), ("heads", "head_dim")) if qkv_bias else None
        self.kv_bias = zeros((2, n_kv_heads, head_dim), (None, "kv_heads", "head_dim")) if qkv_bias else None
        self.out_bias = zeros((d_model,), ("embed",)) if out_bias else None

    def __call__(self, x):
        q = jnp.einsum("bte,ehd->bthd", x, self.q[...])
        kv = jnp.einsum("bte,eshd->sbthd", x, self.kv[...])
        if self.q_bias is not None:
            q, kv = q + self.q_bias[...], kv + self.kv_bias[...][:, None, None]
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k, v = (constrain(t, ("batch", "length", "kv_heads", "head_dim")) for t in kv)
        if self.rope:
            q, k = rotary(q, self.rope), rotary(k, self.rope)
        y = attention(q, k, v, is_causal=self.causal)  # handles grouped K/V heads itself
        y = jnp.einsum("bthd,hde->bte", y, self.out[...])
        return y if self.out_bias is None else y + self.out_bias[...]


class MLPBlock(nnx.Module):
    """GELU MLP (tanh approximation, as GPT-2's), SwiGLU (silu(x W_gate) * x W_up, then W_down) as in Llama,
    or GeGLU (the gate's activation the tanh GELU, as Gemma's). bias: biases on the input and output layers
    (GPT-2); gate_bias: on the gate too (Llama's mlp_bias)."""

    def __init__(self, d_model: int, d_ff: int, kind: "str | bool", out_std: float, rngs: nnx.Rngs,
                 bias: bool = False, gate_bias: bool = False):
        kind = {True: "swiglu", False: "gelu"}.get(kind, kind)
        check_choice("mlp", kind, ("gelu", "swiglu", "geglu"))
        self.gate_act = {"swiglu": jax.nn.silu, "geglu": jax.nn.gelu}.get(kind)
        self.w_in = param(rngs, (d_model, d_ff), ("embed", "mlp"), 0.02)
        self.w_gate = param(rngs, (d_model, d_ff), ("embed", "mlp"), 0.02) if self.gate_act else None
        if gate_bias and not self.gate_act:
            raise ValueError(f"a gate bias needs a gated MLP (swiglu or geglu), not mlp={kind!r}")
        self.b_gate = zeros((d_ff,), ("mlp",)) if gate_bias else None
        self.w_out = param(rngs, (d_ff, d_model), ("mlp", "embed"), out_std)
        self.b_in = zeros((d_ff,), ("mlp",)) if bias else None
        self.b_out = zeros((d_model,), ("embed",)) if bias else None

    def __call__(self, x):
        h = dense(x, self.w_in[...])
        if self.b_in is not None:
            h = h + self.b_in[...]
        if self.w_gate is not None:
            gate = dense(x, self.w_gate[...])
            h = self.gate_act(gate if self.b_gate is None else gate + self.b_gate[...]) * h
        else:
            h = jax.nn.gelu(h)
        y = dense(constrain(h, ("batch", "length", "mlp")), self.w_out[...])
        return y if self.b_out is None else y + self.b_out[...]


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x)); `ffn` is any module
    from (batch, length, embed) to the same (an MLPBlock, or a mixture of experts)."""

    def __init__(self, d_model: int, norm_kind: str, attn: Attention, ffn: nnx.Module, rngs: nnx.Rngs,
                 eps: float = 1e-6):
        self.ln1 = norm(norm_kind, d_model, rngs, eps)
        self.attn = attn
        self.ln2 = norm(norm_kind, d_model, rngs, eps)
        self.ffn = ffn

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.ffn(self.ln2(x))
        return constrain(x, ("batch", "length", "embed"))


class PerLayer(nnx.Variable):
    """A layer's own setting that is no weight (its attention window, whether it rotates positions): an int array
    stacked on the `layers` axis with the weights, so that a scan, a pipeline's stage or an unrolled loop hands
    each layer its own while the compiled program still holds one layer. Never trained, never changed by a call."""


def per_layer(value) -> PerLayer:
    return PerLayer(jnp.asarray(value, jnp.int32))  # no axis names: a few ints, whole on every device


def stacked(n_layers: int, make: Callable[..., nnx.Module], rngs: nnx.Rngs, **settings) -> nnx.Module:
    """`n_layers` copies of `make(rngs)`, each with its own random init, as one module whose arrays
    have a leading `layers` axis: the compiled program then holds one layer whatever the depth.
    `settings`: name -> one int per layer, handed to `make(rngs, name=...)` as that layer's traced value
    (store it with `per_layer`), for layers that differ (a local or a global attention window)."""
    for name, values in settings.items():
        if len(values) != n_layers:
            raise ValueError(f"{name}: {len(values)} values for {n_layers} layers")
    settings = {k: jnp.asarray(v, jnp.int32) for k, v in settings.items()}

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0, 0), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_all(rngs, settings):
        return make(rngs, **settings)

    return make_all(rngs, settings)
