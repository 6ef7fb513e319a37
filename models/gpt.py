"""A decoder-only transformer language model: GPT-2 style by default, Llama style by its arguments
(rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, tied or untied embeddings).

Parameters carry logical axis names only; `shard` maps them to mesh axes. With the default rules,
attention heads, the MLP width and the vocabulary split over the `tensor` axis (Megatron-style:
Q/K/V and the first MLP matrices by columns, the output projections by rows) and `embed` over `fsdp`.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from shard.nn.hooks import positions, stack
from shard.nn.partition import constrain

from .layers import norm as make_norm
from .layers import Attention, Block, MLPBlock, check_choice, lookup, param, stacked
from . import mixed
from . import rope as rope_lib
from .deltanet import GatedDeltaNet
from .latent import LatentAttention
from .mtp import MultiToken


class GPT(nnx.Module):
    """Causal LM: int tokens (batch, length) -> logits (batch, length, vocab).

    position: "learned" (GPT-2) or "rope"; norm: "layernorm", "rmsnorm" or "rmsnorm+1" (the weight stored
    as an offset from 1, Gemma's); mlp: "gelu", "swiglu" or "geglu"; n_kv_heads: key/value heads (0 =
    n_heads; fewer = grouped-query attention); tie_embeddings: the output layer reuses the token embedding.
    d_ff=0 means 4 x d_model (8/3 x d_model for the gated MLPs). head_dim: each head's width (0 = d_model /
    n_heads). qkv_bias: biases on queries, keys and values (Qwen2); attn_bias: on those and the attention's output
    (Llama's attention_bias; GPT-OSS); bias: on every linear layer but a gated MLP's gate (GPT-2); mlp_bias: on
    every MLP layer, the gate's included (Llama's mlp_bias). attn_sinks: a learned logit per query head joining each
    attention softmax's denominator (GPT-OSS's sinks). rope_interleaved: RoPE rotates adjacent channel pairs (Llama
    4's). chunks: one chunk size per layer, a query seeing only the keys of its own chunk of positions (0 = none;
    Llama 4's chunked layers). attn_temperature_floor: the queries of the layers that do not rotate (rope_layers 0)
    scaled by 1 + attn_temperature_scale x log(1 + floor((position + 1) / floor)) (0 = none; Llama 4's).
    norm_eps: the norms' epsilon. embed_scale: multiply the embeddings by sqrt(d_model) (Gemma).
    rope_scaling: Llama 3's {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}, or with
    rope_type linear ({factor}), longrope or yarn (models/rope.py's make). rotary_dim: the channels of each head
    that rotate, its first ones (0 = all; Phi's partial rotary factor). rope_layers: one 1 (rotates) or 0 (no
    positions at all) per layer (SmolLM3's), or 2 (rotates by local_rope_theta, unscaled: Gemma 3's and OLMo 3's
    local layers); None = every layer rotates.
    qk_norm: none, head (a norm on each query and key head before rotation: Qwen3) or projection (over all heads
    together: OLMo 2). norms: each block's norms before its attention and MLP (pre), after them before the residual
    sum (post: OLMo 2), or both (Gemma 2).
    windows: one sliding window per layer, a query seeing that many latest keys, itself included (0 = the layer
    attends globally; Mistral's, Qwen2's and Gemma 2's local layers); None = every layer global.
    attn_softcap: attention logits soft-capped, cap * tanh(logits / cap) (0 = none; Gemma 2); attn_scale: the factor
    on q.k (0 = 1/sqrt(head_dim); Gemma's query_pre_attn_scalar ** -0.5); logit_softcap: the output logits
    soft-capped so (0 = none; Gemma 2's final_logit_softcapping).
    Gemma 4's layers, which differ from one another and so run one after another, unscanned (models/mixed.py):
    global_head_dim, global_kv_heads: the head size and key/value heads of the layers without a window (0 = as the
    others); values_from_keys: those layers' values are their keys' projection (attention_k_eq_v); v_norm: the values
    divided by their RMS (every layer); shared_kv_layers: the last so many layers project no keys or values and
    reuse those of the last earlier layer with their window (num_kv_shared_layers), their MLP twice as wide with
    wide_shared_mlp; per_layer_dim, per_layer_vocab: per-layer embeddings of that width (a table of per_layer_vocab
    rows, 0 = vocab_size) fed to every layer (hidden_size_per_layer_input); layer_scalar: a learned scalar on each
    layer's output.
    layer_types: one per layer, "attention" or "deltanet" (gated DeltaNet linear attention, models/deltanet.py, of the
    sizes `deltanet` gives: Qwen3.5's and Qwen3-Next's linear layers); the stack scans one period of the pattern at a
    time (models/mixed.py's Period: three DeltaNet layers and a full one). attn_gate: the attention's output times the
    sigmoid of a second projection of the token, per channel (their full layers).
    mtp_depth: that many multi-token-prediction modules after the stack (models/mtp.py: DeepSeek-V3's and GLM-4.5's),
    module k trained to predict the token k + 1 places past the next, their mean loss times mtp_weight added to the
    training loss (0 = none; scanned layers only).
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                 d_ff: int = 0, max_len: int = 512, n_kv_heads: int = 0, position: str = "learned",
                 norm: str = "layernorm", mlp: str = "gelu", tie_embeddings: bool = False,
                 rope_theta: float = 10000.0, head_dim: int = 0, qkv_bias: bool = False, bias: bool = False,
                 norm_eps: float = 1e-6, embed_scale: bool = False, rope_scaling: dict | None = None,
                 mlp_bias: bool = False, qk_norm: str = "none", norms: str = "pre", rotary_dim: int = 0,
                 rope_layers: list | None = None, windows: list | None = None, local_rope_theta: float = 0.0,
                 attn_softcap: float = 0.0, attn_scale: float = 0.0, logit_softcap: float = 0.0,
                 attn_bias: bool = False, attn_sinks: bool = False, rope_interleaved: bool = False,
                 chunks: list | None = None, attn_temperature_floor: float = 0.0, attn_temperature_scale: float = 0.1,
                 global_head_dim: int = 0, global_kv_heads: int = 0, values_from_keys: bool = False,
                 v_norm: bool = False, shared_kv_layers: int = 0, wide_shared_mlp: bool = False,
                 per_layer_dim: int = 0, per_layer_vocab: int = 0, layer_scalar: bool = False,
                 latent: dict | None = None, layer_types: list | None = None, deltanet: dict | None = None,
                 attn_gate: bool = False, mtp_depth: int = 0, mtp_weight: float = 0.3, *, rngs: nnx.Rngs):
        n_kv_heads = n_kv_heads or n_heads
        check_choice("position", position, ("learned", "rope"))
        check_choice("norm", norm, ("layernorm", "rmsnorm", "rmsnorm+1"))
        check_choice("mlp", mlp, ("gelu", "swiglu", "geglu"))
        if not head_dim and d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads} (or set head_dim)")
        head_dim = head_dim or d_model // n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if position == "rope" and (rotary_dim or head_dim) % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary embeddings need an even number of channels up to head_dim={head_dim}, got "
                             f"{rotary_dim or head_dim}")
        if rope_layers is not None and (position != "rope" or len(rope_layers) != n_layers
                                        or not set(rope_layers) <= ({0, 1, 2} if local_rope_theta else {0, 1})):
            raise ValueError(f"rope_layers={rope_layers}: give one 1 (rotate), 0 (not) or with local_rope_theta 2 "
                             f"(rotate by it) per layer, {n_layers} in all, with position=rope")
        if windows is not None and (len(windows) != n_layers or any(
                not isinstance(w, int) or isinstance(w, bool) or w < 0 for w in windows)):
            raise ValueError(f"windows={windows}: give one window per layer, {n_layers} in all, each a number of keys "
                             ">= 1 or 0 for a global layer")
        if chunks is not None and (len(chunks) != n_layers or any(
                not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in chunks)):
            raise ValueError(f"chunks={chunks}: give one chunk size per layer, {n_layers} in all, each a number of "
                             "positions >= 1 or 0 for an unchunked layer")
        if attn_temperature_floor < 0 or attn_temperature_floor and rope_layers is None:
            raise ValueError(f"attn_temperature_floor={attn_temperature_floor} scales the queries of the layers "
                             "without RoPE: give a floor > 0 with rope_layers naming them (0), or 0 for none")
        d_ff = d_ff or (4 * d_model if mlp == "gelu" else 8 * d_model // 3)
        out_std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2: keep the residual stream's variance flat in depth
        self.max_len, self.embed_scale = max_len, math.sqrt(d_model) if embed_scale else None
        self.logit_softcap = logit_softcap or None
        # read by feed_forward, whose signature subclasses share
        self.mlp_bias, self.norm_eps, self.norm_kind = mlp_bias, norm_eps, norm
        self.tok = param(rngs, (vocab_size, d_model), ("vocab", "embed"), 0.02)
        self.pos = param(rngs, (max_len, d_model), (None, "embed"), 0.01) if position == "learned" else None
        rope = rope_lib.make(rope_theta, rope_scaling, rotary_dim, rope_interleaved) if position == "rope" else None
        local_rope = rope_lib.Rope(local_rope_theta, dims=rotary_dim) if local_rope_theta and rope else None
        settings = {} if rope_layers is None else dict(rotate=rope_layers)
        windows = tuple(windows) if windows and any(windows) else None
        if windows is not None:
            settings["window"] = windows
        chunks = tuple(chunks) if chunks and any(chunks) else None
        if chunks is not None:
            settings["chunk"] = chunks
        temperature = (attn_temperature_floor, attn_temperature_scale) if attn_temperature_floor else None
        # LongRoPE picks its factors by how far a call reaches: a cache made before it passes the original context
        # is made again after (shard/use/generate.py)
        self.refill_at = rope.longrope[2] if rope is not None and rope.longrope else None
        if mtp_depth < 0 or mtp_depth and (layer_types or settings or any(
                (global_head_dim, global_kv_heads, values_from_keys, shared_kv_layers, per_layer_dim, layer_scalar))):
            raise ValueError(f"mtp_depth={mtp_depth}: multi-token prediction takes a depth >= 0 and one stack of like "
                             "layers (no layer_types, windows, chunks, rope_layers or Gemma 4's unlike layers)")

        if latent is not None and (position != "rope" or windows or chunks or rope_layers or qk_norm != "none"
                                   or attn_sinks or attn_softcap or temperature or v_norm):
            raise ValueError("latent attention takes position=rope and none of windows, chunks, rope_layers, qk_norm, "
                             "attn_sinks, attn_softcap, attention temperature or v_norm")

        def make_block(rngs, rotate=None, window=None, windows=windows, chunk=None, chunks=chunks, dense_ff=0,
                       **unlike):
            if latent is not None:
                attn = LatentAttention(d_model, n_heads, latent, rope, out_std, rngs, attn_scale, bias=attn_bias)
            else:
                attn = Attention(d_model, n_heads, unlike.pop("kv_heads", n_kv_heads), unlike.pop("rope", rope),
                                 out_std, causal=True, rngs=rngs, head_dim=unlike.pop("head_dim", head_dim),
                                 qkv_bias=qkv_bias or bias or attn_bias, out_bias=bias or attn_bias, qk_norm=qk_norm,
                                 norm_kind=norm, eps=norm_eps,
                                 rotate=rotate, window=window, windows=windows, local_rope=local_rope,
                                 softcap=attn_softcap, scale=attn_scale, sinks=attn_sinks, temperature=temperature,
                                 chunk=chunk, chunks=chunks, v_norm=v_norm, gate=attn_gate, **unlike)
            ffn = (GPT.feed_forward(self, d_model, dense_ff, mlp, out_std, rngs, bias) if dense_ff
                   else self.feed_forward(d_model, d_ff, mlp, out_std, rngs, bias))
            return Block(d_model, norm, attn, ffn, rngs, norm_eps, norms)

        def make_layer(rngs, kind):  # a layer of a period of layer_types
            if kind == "attention":
                return make_block(rngs)
            linear = GatedDeltaNet(d_model, deltanet, out_std, rngs, norm_eps)
            return Block(d_model, norm, linear, self.feed_forward(d_model, d_ff, mlp, out_std, rngs, bias), rngs,
                         norm_eps, norms)

        if layer_types is not None:
            mixed.check_types(layer_types, n_layers, deltanet)
            given = dict(windows=windows, chunks=chunks, rope_layers=rope_layers, latent=latent,
                         attn_temperature_floor=attn_temperature_floor, global_head_dim=global_head_dim,
                         shared_kv_layers=shared_kv_layers, per_layer_dim=per_layer_dim,
                         dense_layers=self.dense_first(n_layers, d_ff)[0])
            if any(given.values()):
                raise ValueError(f"layer_types takes none of {', '.join(k for k, v in given.items() if v)}")
            self.layers = self.per_layer = self.dense_blocks = self.mtp = None
            self.blocks = mixed.periodic(make_layer, layer_types, rngs)
            self.ln_f = make_norm(norm, d_model, rngs, norm_eps)
            self.head = None if tie_embeddings else param(rngs, (d_model, vocab_size), ("embed", "vocab"), 0.02)
            return

        unlike = dict(global_head_dim=global_head_dim, global_kv_heads=global_kv_heads,
                      values_from_keys=values_from_keys, shared_kv_layers=shared_kv_layers,
                      wide_shared_mlp=wide_shared_mlp, per_layer_dim=per_layer_dim, layer_scalar=layer_scalar)
        if any(unlike.values()):
            if chunks or temperature or self.dense_first(n_layers, d_ff)[0]:
                raise ValueError(f"{', '.join(k for k, v in unlike.items() if v)} run the layers unscanned, which "
                                 "takes no chunks, attention temperature or dense first layers")
            layers, self.sources = mixed.layers(
                make_block, n_layers, d_model, d_ff, rngs, windows=list(windows or [0] * n_layers),
                rotations=rope_layers, rope=rope, local_rope=local_rope, head_dim=head_dim, kv_heads=n_kv_heads,
                norm=norm, eps=norm_eps, out_std=out_std, act=jax.nn.silu if mlp == "swiglu" else jax.nn.gelu,
                **unlike)
            self.per_layer = mixed.PerLayerInputs(per_layer_vocab or vocab_size, d_model, n_layers, per_layer_dim,
                                                  norm, norm_eps, rngs) if per_layer_dim else None
            self.dense_blocks = self.mtp = None
            # (scanned a period at a time where no layer reuses another's keys: mixed.layers)
            self.blocks, self.layers = (layers, None) if self.sources is None else (None, layers)
            self.ln_f = make_norm(norm, d_model, rngs, norm_eps)
            self.head = None if tie_embeddings else param(rngs, (d_model, vocab_size), ("embed", "vocab"), 0.02)
            return

        self.layers = self.per_layer = None
        first, first_ff = self.dense_first(n_layers, d_ff)
        # with dense first layers, two stacks: each layer's settings (and the static windows) in the one that holds it
        part = lambda cut: {k: v[cut] for k, v in settings.items()}  # noqa: E731
        cut = lambda fixed, where: fixed and fixed[where]  # noqa: E731
        early, late = slice(first), slice(first, None)
        self.dense_blocks = stacked(first, partial(make_block, windows=cut(windows, early), chunks=cut(chunks, early),
                                                   dense_ff=first_ff), rngs, **part(early)) if first else None
        self.blocks = stacked(n_layers - first, partial(make_block, windows=cut(windows, late),
                                                        chunks=cut(chunks, late)), rngs, **part(late)) \
            if first else stacked(n_layers, make_block, rngs, **settings)
        self.ln_f = make_norm(norm, d_model, rngs, norm_eps)
        self.head = None if tie_embeddings else param(rngs, (d_model, vocab_size), ("embed", "vocab"), 0.02)
        # (each module's layer of the stack's last layers' kind: the experts')
        self.mtp = MultiToken(mtp_depth, mtp_weight, d_model, norm, norm_eps, make_block, rngs) if mtp_depth else None

    def feed_forward(self, d_model: int, d_ff: int, mlp: str, out_std: float, rngs: nnx.Rngs,
                     bias: bool = False) -> nnx.Module:
        """The feed-forward part of each block (a subclass may swap it, e.g. for experts)."""
        gated = mlp != "gelu"
        return MLPBlock(d_model, d_ff, mlp, out_std, rngs, bias or self.mlp_bias, gate_bias=self.mlp_bias and gated)

    def dense_first(self, n_layers: int, d_ff: int) -> tuple[int, int]:
        """(k, width): the first k of the n_layers layers have the dense MLP of this width, stacked apart
        (`dense_blocks`) before the others, whose MLP is `feed_forward`'s (a mixture of experts' first dense
        layers); the GPT's layers are all one kind."""
        return 0, d_ff

    def __call__(self, tokens):
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={self.max_len}")
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos[...][positions(length)]  # in the order the framework holds the tokens
        x = constrain(x, ("batch", "length", "embed"))
        if self.layers is not None:
            per_layer = None if self.per_layer is None else self.per_layer(tokens, x)
            x = self.ln_f(mixed.run(self.layers, x, self.sources, per_layer))
        else:
            if self.dense_blocks is not None:
                x = stack(self.dense_blocks, x)
            x = self.ln_f(stack(self.blocks, x))
        if self.mtp is not None:  # (its losses recorded while training, else nothing runs)
            self.mtp(x, self.embed, self.unembed)
        return self.unembed(x)

    def embed(self, tokens):
        # Gather rows from a table whole along `embed`: a lookup into a table split on its columns
        # forces XLA to rematerialise it at every use.
        x = lookup(constrain(self.tok[...], ("vocab", None)), tokens)
        if self.embed_scale is not None:
            x = x * jnp.asarray(self.embed_scale, x.dtype)  # rounded to the compute dtype first, as Gemma's
        return x

    def unembed(self, x):
        """The logits of final hidden states x (after ln_f)."""
        logits = x @ self.tok[...].T if self.head is None else x @ self.head[...]
        if self.logit_softcap is not None:
            logits = self.logit_softcap * jnp.tanh(logits / self.logit_softcap)
        return constrain(logits, ("batch", "length", "vocab"))

