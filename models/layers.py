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

from shard.hooks import attention, dense, positions
from shard.partition import constrain


def param(rngs: nnx.Rngs, shape: tuple, names: tuple, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), out_sharding=names)


def norm(kind: str, dim: int, rngs: nnx.Rngs) -> nnx.Module:
    scale = nnx.with_partitioning(nnx.initializers.ones, ("embed",))
    if kind == "rmsnorm":
        return nnx.RMSNorm(dim, rngs=rngs, scale_init=scale)
    return nnx.LayerNorm(dim, rngs=rngs, scale_init=scale,
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))


def check_choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; choose one of {', '.join(allowed)}")


def rotary(x, theta: float):
    """Rotary position embedding on (batch, length, heads, head_dim): rotate pairs of channels by an
    angle that grows with the position, so q.k depends on relative position."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions(x.shape[1]).astype(jnp.float32)[..., None] * freqs  # (length, half); packed: (batch, length, half)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # a heads axis to broadcast over
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Self-attention, causal or not; with n_kv_heads < n_heads, groups of query heads share key/value heads."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope_theta: float | None, out_std: float,
                 causal: bool, rngs: nnx.Rngs):
        head_dim = d_model // n_heads
        self.rope_theta, self.causal = rope_theta, causal
        self.q = param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), 0.02)
        self.kv = param(rngs, (d_model, 2, n_kv_heads, head_dim), ("embed", None, "kv_heads", "head_dim"), 0.02)
        self.out = param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"), out_std)

    def __call__(self, x):
        q = constrain(jnp.einsum("bte,ehd->bthd", x, self.q[...]), ("batch", "length", "heads", "head_dim"))
        k, v = (constrain(t, ("batch", "length", "kv_heads", "head_dim"))
                for t in jnp.einsum("bte,eshd->sbthd", x, self.kv[...]))
        if self.rope_theta:
            q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        y = attention(q, k, v, is_causal=self.causal)  # handles grouped K/V heads itself
        return jnp.einsum("bthd,hde->bte", y, self.out[...])


class MLPBlock(nnx.Module):
    """GELU MLP, or SwiGLU (silu(x W_gate) * x W_up, then W_down) as in Llama."""

    def __init__(self, d_model: int, d_ff: int, swiglu: bool, out_std: float, rngs: nnx.Rngs):
        self.w_in = param(rngs, (d_model, d_ff), ("embed", "mlp"), 0.02)
        self.w_gate = param(rngs, (d_model, d_ff), ("embed", "mlp"), 0.02) if swiglu else None
        self.w_out = param(rngs, (d_ff, d_model), ("mlp", "embed"), out_std)

    def __call__(self, x):
        h = dense(x, self.w_in[...])
        h = jax.nn.silu(dense(x, self.w_gate[...])) * h if self.w_gate is not None else jax.nn.gelu(h)
        return dense(constrain(h, ("batch", "length", "mlp")), self.w_out[...])


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x)); `ffn` is any module
    from (batch, length, embed) to the same (an MLPBlock, or a mixture of experts)."""

    def __init__(self, d_model: int, norm_kind: str, attn: Attention, ffn: nnx.Module, rngs: nnx.Rngs):
        self.ln1 = norm(norm_kind, d_model, rngs)
        self.attn = attn
        self.ln2 = norm(norm_kind, d_model, rngs)
        self.ffn = ffn

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.ffn(self.ln2(x))
        return constrain(x, ("batch", "length", "embed"))


def stacked(n_layers: int, make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """`n_layers` copies of `make(rngs)`, each with its own random init, as one module whose arrays
    have a leading `layers` axis: the compiled program then holds one layer whatever the depth."""

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_all(rngs):
        return make(rngs)

    return make_all(rngs)
