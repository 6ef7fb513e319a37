"""A decoder-only transformer language model: GPT-2 style by default, Llama style by its arguments
(rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, tied or untied embeddings).

Parameters carry logical axis names only; `shard` maps them to mesh axes. With the default rules,
attention heads, the MLP width and the vocabulary split over the `tensor` axis (Megatron-style:
Q/K/V and the first MLP matrices by columns, the output projections by rows) and `embed` over `fsdp`.
"""

import math

from flax import nnx

from shard.hooks import positions, stack
from shard.partition import constrain

from .layers import norm as make_norm
from .layers import Attention, Block, MLPBlock, check_choice, param, stacked


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
        check_choice("position", position, ("learned", "rope"))
        check_choice("norm", norm, ("layernorm", "rmsnorm"))
        check_choice("mlp", mlp, ("gelu", "swiglu"))
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if position == "rope" and (d_model // n_heads) % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {d_model // n_heads}")
        d_ff = d_ff or (4 * d_model if mlp == "gelu" else 8 * d_model // 3)
        out_std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2: keep the residual stream's variance flat in depth
        self.max_len = max_len
        self.tok = param(rngs, (vocab_size, d_model), ("vocab", "embed"), 0.02)
        self.pos = param(rngs, (max_len, d_model), (None, "embed"), 0.01) if position == "learned" else None
        rope = rope_theta if position == "rope" else None

        def make_block(rngs):
            attn = Attention(d_model, n_heads, n_kv_heads, rope, out_std, causal=True, rngs=rngs)
            return Block(d_model, norm, attn, self.feed_forward(d_model, d_ff, mlp == "swiglu", out_std, rngs), rngs)

        self.blocks = stacked(n_layers, make_block, rngs)
        self.ln_f = make_norm(norm, d_model, rngs)
        self.head = None if tie_embeddings else param(rngs, (d_model, vocab_size), ("embed", "vocab"), 0.02)

    def feed_forward(self, d_model: int, d_ff: int, swiglu: bool, out_std: float, rngs: nnx.Rngs) -> nnx.Module:
        """The feed-forward part of each block (a subclass may swap it, e.g. for experts)."""
        return MLPBlock(d_model, d_ff, swiglu, out_std, rngs)

    def __call__(self, tokens):
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={self.max_len}")
        # Gather rows from a table whole along `embed`: a lookup into a table split on its columns
        # forces XLA to rematerialise it at every use.
        x = constrain(self.tok[...], ("vocab", None))[tokens]
        if self.pos is not None:
            x = x + self.pos[...][positions(length)]  # in the order the framework holds the tokens
        x = constrain(x, ("batch", "length", "embed"))
        x = self.ln_f(stack(self.blocks, x))
        logits = x @ self.tok[...].T if self.head is None else x @ self.head[...]
        return constrain(logits, ("batch", "length", "vocab"))
