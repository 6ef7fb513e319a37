"""A decoder-only transformer language model: GPT-2 style by default, Llama style by its arguments
(rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, tied or untied embeddings).

Parameters carry logical axis names only; `shard` maps them to mesh axes. With the default rules,
attention heads, the MLP width and the vocabulary split over the `tensor` axis (Megatron-style:
Q/K/V and the first MLP matrices by columns, the output projections by rows) and `embed` over `fsdp`.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shard.partition import constrain, layer


def _param(rngs: nnx.Rngs, shape: tuple, names: tuple, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), out_sharding=names)


def _norm(kind: str, dim: int, rngs: nnx.Rngs) -> nnx.Module:
    scale = nnx.with_partitioning(nnx.initializers.ones, ("embed",))
    if kind == "rmsnorm":
        return nnx.RMSNorm(dim, rngs=rngs, scale_init=scale)
    return nnx.LayerNorm(dim, rngs=rngs, scale_init=scale,
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))


def rotary(x, theta: float):
    """Rotary position embedding on (batch, length, heads, head_dim): rotate pairs of channels by an
    angle that grows with the position, so q.k depends on relative position."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # (length, half)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal self-attention; with n_kv_heads < n_heads, groups of query heads share key/value heads."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope_theta: float | None, out_std: float,
                 rngs: nnx.Rngs):
        head_dim = d_model // n_heads
        self.rope_theta = rope_theta
        self.q = _param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), 0.02)
        self.kv = _param(rngs, (d_model, 2, n_kv_heads, head_dim), ("embed", None, "kv_heads", "head_dim"), 0.02)
        self.out = _param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"), out_std)

    def __call__(self, x):
        q = constrain(jnp.einsum("bte,ehd->bthd", x, self.q[...]), ("batch", "length", "heads", "head_dim"))
        k, v = (constrain(t, ("batch", "length", "kv_heads", "head_dim"))
                for t in jnp.einsum("bte,eshd->sbthd", x, self.kv[...]))
        if self.rope_theta:
            q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # handles grouped K/V heads itself
        return jnp.einsum("bthd,hde->bte", y, self.out[...])


class MLPBlock(nnx.Module):
    """GELU MLP, or SwiGLU (silu(x W_gate) * x W_up, then W_down) as in Llama."""

    def __init__(self, d_model: int, d_ff: int, swiglu: bool, out_std: float, rngs: nnx.Rngs):
        self.w_in = _param(rngs, (d_model, d_ff), ("embed", "mlp"), 0.02)
        self.w_gate = _param(rngs, (d_model, d_ff), ("embed", "mlp"), 0.02) if swiglu else None
        self.w_out = _param(rngs, (d_ff, d_model), ("mlp", "embed"), out_std)

    def __call__(self, x):
        h = x @ self.w_in[...]
        h = jax.nn.silu(x @ self.w_gate[...]) * h if self.w_gate is not None else jax.nn.gelu(h)
        return constrain(h, ("batch", "length", "mlp")) @ self.w_out[...]


class Block(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, norm: str, swiglu: bool,
                 rope_theta: float | None, out_std: float, rngs: nnx.Rngs):
        self.ln1 = _norm(norm, d_model, rngs)
        self.attn = Attention(d_model, n_heads, n_kv_heads, rope_theta, out_std, rngs)
        self.ln2 = _norm(norm, d_model, rngs)
        self.mlp = MLPBlock(d_model, d_ff, swiglu, out_std, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return constrain(x, ("batch", "length", "embed"))


class GPT(nnx.Module):
    """Causal LM: int tokens (batch, length) -> logits (batch, length, vocab).

    position: "learned" (GPT-2) or "rope"; norm: "layernorm" or "rmsnorm"; mlp: "gelu" or "swiglu";
    n_kv_heads: key/value heads (0 = n_heads; fewer = grouped-query attention); tie_embeddings: the
    output layer reuses the token embedding. d_ff=0 means 4 x d_model (8/3 x d_model for SwiGLU).
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                 d_ff: int = 0, max_len: int = 512, n_kv_heads: int = 0, position: str = "learned",
                 norm: str = "layernorm", mlp: str = "gelu", tie_embeddings: bool = False,
                 rope_theta: float = 10000.0, *, rngs: nnx.Rngs):
        n_kv_heads = n_kv_heads or n_heads
        for name, value, allowed in (("position", position, ("learned", "rope")), ("norm", norm, ("layernorm", "rmsnorm")),
                                     ("mlp", mlp, ("gelu", "swiglu"))):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}; choose one of {', '.join(allowed)}")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if position == "rope" and (d_model // n_heads) % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {d_model // n_heads}")
        d_ff = d_ff or (4 * d_model if mlp == "gelu" else 8 * d_model // 3)
        out_std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2: keep the residual stream's variance flat in depth
        self.max_len = max_len
        self.tok = _param(rngs, (vocab_size, d_model), ("vocab", "embed"), 0.02)
        self.pos = _param(rngs, (max_len, d_model), (None, "embed"), 0.01) if position == "learned" else None
        rope = rope_theta if position == "rope" else None

        # All blocks are created at once, stacked on a leading `layers` axis, and run with a scan: the
        # compiled program holds one block whatever the depth.
        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(d_model, n_heads, n_kv_heads, d_ff, norm, mlp == "swiglu", rope, out_std, rngs)

        self.blocks = make_blocks(rngs)
        self.ln_f = _norm(norm, d_model, rngs)
        self.head = None if tie_embeddings else _param(rngs, (d_model, vocab_size), ("embed", "vocab"), 0.02)

    def __call__(self, tokens):
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={self.max_len}")
        # Gather rows from a table whole along `embed`: a lookup into a table split on its columns
        # forces XLA to rematerialise it at every use.
        x = constrain(self.tok[...], ("vocab", None))[tokens]
        if self.pos is not None:
            x = x + self.pos[...][:length]
        x = constrain(x, ("batch", "length", "embed"))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run_blocks(x, block):
            return layer(lambda block, x: block(x))(block, x)

        x = self.ln_f(run_blocks(x, self.blocks))
        logits = x @ self.tok[...].T if self.head is None else x @ self.head[...]
        return constrain(logits, ("batch", "length", "vocab"))
