"""A decoder-only transformer language model (GPT-2 style: learned positions, pre-norm blocks).

Parameters carry logical axis names only; `shard` maps them to mesh axes. With the default rules,
attention heads, the MLP width and the vocabulary split over the `tensor` axis (Megatron-style:
QKV and the first MLP matrix by columns, the output projections by rows) and `embed` over `fsdp`.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shard.partition import constrain


def _param(rngs: nnx.Rngs, shape: tuple, names: tuple, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), out_sharding=names)


def _layer_norm(dim: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(dim, rngs=rngs,
                         scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))


class Attention(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, out_std: float, rngs: nnx.Rngs):
        head_dim = d_model // n_heads
        self.qkv = _param(rngs, (d_model, 3, n_heads, head_dim), ("embed", None, "heads", "head_dim"), 0.02)
        self.out = _param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"), out_std)

    def __call__(self, x):
        qkv = jnp.einsum("bte,eshd->sbthd", x, self.qkv[...])
        q, k, v = (constrain(t, ("batch", "length", "heads", "head_dim")) for t in qkv)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.einsum("bthd,hde->bte", y, self.out[...])


class MLPBlock(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, out_std: float, rngs: nnx.Rngs):
        self.w_in = _param(rngs, (d_model, d_ff), ("embed", "mlp"), 0.02)
        self.w_out = _param(rngs, (d_ff, d_model), ("mlp", "embed"), out_std)

    def __call__(self, x):
        h = jax.nn.gelu(constrain(x @ self.w_in[...], ("batch", "length", "mlp")))
        return h @ self.w_out[...]


class Block(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, out_std: float, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(d_model, rngs)
        self.attn = Attention(d_model, n_heads, out_std, rngs)
        self.ln2 = _layer_norm(d_model, rngs)
        self.mlp = MLPBlock(d_model, d_ff, out_std, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return constrain(x, ("batch", "length", "embed"))


class GPT(nnx.Module):
    """Byte- or token-level causal LM: int tokens (batch, length) -> logits (batch, length, vocab)."""

    def __init__(self, vocab_size: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                 d_ff: int = 0, max_len: int = 512, *, rngs: nnx.Rngs):
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        d_ff = d_ff or 4 * d_model
        out_std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2: keep the residual stream's variance flat in depth
        self.max_len = max_len
        self.tok = _param(rngs, (vocab_size, d_model), ("vocab", "embed"), 0.02)
        self.pos = _param(rngs, (max_len, d_model), (None, "embed"), 0.01)
        self.blocks = nnx.List([Block(d_model, n_heads, d_ff, out_std, rngs) for _ in range(n_layers)])
        self.ln_f = _layer_norm(d_model, rngs)
        self.head = _param(rngs, (d_model, vocab_size), ("embed", "vocab"), 0.02)

    def __call__(self, tokens):
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={self.max_len}")
        # Gather rows from a table whole along `embed`: a lookup into a table split on its columns
        # forces XLA to rematerialise it at every use.
        table = constrain(self.tok[...], ("vocab", None))
        x = table[tokens] + self.pos[...][:length]
        x = constrain(x, ("batch", "length", "embed"))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.head[...]
        return constrain(logits, ("batch", "length", "vocab"))
