"""Building blocks shared by the transformers (gpt, vit, moe): parameters with logical names,
normalisation, rotary positions, attention, the feed-forward block, and layers stacked on a
`layers` axis (run by the framework's `shard.nn.hooks.stack`: a scan, or a pipeline).

Logical names used here: embed (model width), heads / kv_heads / head_dim (attention), mlp
(feed-forward width), vocab. Which mesh axes they map to is decided in `shard.nn.partition`.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from shard.nn.hooks import NOT_MODEL_FLOPS, attention, dense, positions
from shard.nn.partition import constrain

from .rope import Rope, rotary  # noqa: F401  (rotary: here for the models that import it from layers)


def param(rngs: nnx.Rngs, shape: tuple, names: tuple, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), out_sharding=names)


def zeros(shape: tuple, names: tuple, role: str = "bias") -> nnx.Param:
    """A bias (or a norm's weight stored as an offset from 1), zeros at first. Its `role` metadata keeps it out of
    quantization (shard/quant/base.py), which its rank cannot: a per-head bias has two dimensions."""
    return nnx.Param(jnp.zeros(shape), out_sharding=names, role=role)


# Rows of a table at or below which a lookup's gradient is a one-hot matrix product rather than a scatter-add: with
# few rows (a byte vocabulary) every row takes thousands of the batch's updates, which a GPU's scatter serialises
# (gpt_350m on an H200: 25 ms a step, 8.6% of it, bench/RESULTS.md), while the product costs 2 x tokens x rows x
# width FLOPs, under 0.1% of such a model's step. Past ~2k rows the product outgrows the scatter's memory traffic.
ONE_HOT_ROWS = 2048


@jax.custom_vjp
def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids]: rows of an embedding table, with a gradient suited to the table's size (ONE_HOT_ROWS)."""
    return table[ids]


def _lookup_forward(table, ids):
    return table[ids], (ids, jnp.zeros((table.shape[0], 0), table.dtype))  # the table's rows and dtype, no bytes


def _lookup_backward(saved, grad):
    ids, like = saved
    rows = like.shape[0]
    if rows <= ONE_HOT_ROWS:
        table_grad = _one_hot_product(ids, grad, rows)
    else:
        table_grad = jnp.zeros((rows, grad.shape[-1]), jnp.float32).at[ids].add(grad.astype(jnp.float32))
    return table_grad.astype(like.dtype), None


lookup.defvjp(_lookup_forward, _lookup_backward)


def _one_hot_product(ids, grad, rows):
    picks = jax.nn.one_hot(ids, rows, dtype=grad.dtype)
    return jnp.einsum("...v,...d->vd", picks, grad, preferred_element_type=jnp.float32)


_one_hot_product.__name__ = NOT_MODEL_FLOPS  # the FLOP count leaves it out: a lookup is no model work
_one_hot_product = jax.jit(_one_hot_product, static_argnums=2)


class AxesRMSNorm(nnx.Module):
    """RMSNorm over the last axes of its input that its weight spans (the model width; a query head's channels;
    all of a projection's heads and channels), normalised in float32. offset: the weight stored as an offset
    from 1 (x_normed * (1 + scale), as Gemma's)."""

    def __init__(self, shape: tuple, names: tuple, eps: float, offset: bool = False):
        self.eps, self.offset = eps, offset
        self.scale = zeros(shape, names, "norm") if offset else nnx.Param(jnp.ones(shape), out_sharding=names,
                                                                          role="norm")

    def __call__(self, x):
        h = x.astype(jnp.float32)
        axes = tuple(range(-self.scale.ndim, 0))
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=axes, keepdims=True) + self.eps)
        w = self.scale[...].astype(jnp.float32)
        return (h * (1 + w if self.offset else w)).astype(x.dtype)


def rms(x, eps: float):
    """x over the RMS of its last axis, computed in float32, without a weight (Llama 4's query and key norm)."""
    h = x.astype(jnp.float32)
    return (h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def norm(kind: str, dim: int, rngs: nnx.Rngs, eps: float = 1e-6) -> nnx.Module:
    """layernorm (with bias), rmsnorm, or rmsnorm+1 (the weight an offset from 1)."""
    if kind == "rmsnorm+1":
        return AxesRMSNorm((dim,), ("embed",), eps, offset=True)
    scale = nnx.with_partitioning(nnx.initializers.ones, ("embed",))
    if kind == "rmsnorm":
        return nnx.RMSNorm(dim, epsilon=eps, rngs=rngs, scale_init=scale)
    return nnx.LayerNorm(dim, epsilon=eps, rngs=rngs, scale_init=scale,
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))


def check_choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; choose one of {', '.join(allowed)}")


QK_NORMS = ("none", "head", "projection", "l2")


class Attention(nnx.Module):
    """Self-attention, causal or not; with n_kv_heads < n_heads, groups of query heads share key/value heads.
    qkv_bias: biases on the query, key and value projections (Qwen2); out_bias: on the output one (GPT-2).
    qk_norm: RMSNorm (of kind `norm_kind`) on queries and keys before rotation, over each head's channels
    ("head": Qwen3, Gemma 3) or over the whole projection, all heads together ("projection": OLMo 2); "l2": without
    a weight, on the layers that rotate, after the rotation (Llama 4's; the same up to rounding: a rotation keeps
    each head's norm). rotate:
    this layer's traced flag (stacked's setting) whether it rotates positions at all (SmolLM3's rope-less
    layers); None: it does where the model has a rope. window: this layer's traced sliding window (stacked's
    setting; 0 = global) and windows every layer's, static (shard.nn.hooks.attention's (value, windows)); None:
    global. local_rope: the rotation of layers whose `rotate` is 2 (Gemma 3's local layers' own base). softcap:
    attention-logit soft-capping (0: none); scale: the factor on q.k (0: 1/sqrt(head_dim)). sinks: one learned logit
    per query head that joins the softmax's denominator and weighs no value (GPT-OSS's attention sinks).
    temperature: (floor, scale) or None: the queries of the layers that do not rotate multiplied by
    1 + scale x log(1 + floor((position + 1) / floor)), sharper attention far into a long context (Llama 4's
    attention temperature tuning). chunk: this layer's traced chunk size (stacked's setting; 0 = none) and chunks
    every layer's, static: a query sees only the keys of its own chunk of positions (Llama 4's chunked attention;
    shard.nn.hooks.attention's (value, chunks)). fixed_window: a window of this layer alone, static (a layer outside a
    scanned stack). values_from_keys: the values are the keys' projection as it comes out, before the keys' norm and
    rotation (no value projection: Gemma 4's attention_k_eq_v). v_norm: the values divided by their RMS over each
    head's channels, without a weight (Gemma 4's). own_kv: False for a layer that projects no keys or values and
    attends over an earlier layer's (`with_kv`'s shared: Gemma 4's KV sharing). gate: the output multiplied by the
    sigmoid of a second projection of the token, one per query channel (Qwen3.5's and Qwen3-Next's gated attention)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope: "Rope | float | None", out_std: float,
                 causal: bool, rngs: nnx.Rngs, head_dim: int = 0, qkv_bias: bool = False, out_bias: bool = False,
                 qk_norm: str = "none", norm_kind: str = "rmsnorm", eps: float = 1e-6, rotate=None, window=None,
                 windows: tuple | None = None, local_rope: "Rope | None" = None, softcap: float = 0.0,
                 scale: float = 0.0, sinks: bool = False, temperature: tuple | None = None, chunk=None,
                 chunks: tuple | None = None, fixed_window: int = 0, values_from_keys: bool = False,
                 v_norm: bool = False, own_kv: bool = True, gate: bool = False):
        head_dim = head_dim or d_model // n_heads
        check_choice("qk_norm", qk_norm, QK_NORMS)
        if values_from_keys and qkv_bias:
            raise ValueError("values_from_keys takes the values from the keys' projection: give no qkv biases")
        self.rope = Rope(rope) if isinstance(rope, (int, float)) and rope else rope
        self.causal = causal
        self.q = param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), 0.02)
        kv_names = ("embed", "kv_heads", "head_dim")
        self.k = param(rngs, (d_model, n_kv_heads, head_dim), kv_names, 0.02) if own_kv and values_from_keys else None
        self.kv = param(rngs, (d_model, 2, n_kv_heads, head_dim), ("embed", None, *kv_names[1:]), 0.02) \
            if own_kv and not values_from_keys else None
        self.out = param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"), out_std)
        self.gate = param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), 0.02) if gate else None
        self.q_bias = zeros((n_heads, head_dim), ("heads", "head_dim")) if qkv_bias else None
        self.kv_bias = zeros((2, n_kv_heads, head_dim), (None, "kv_heads", "head_dim")) if qkv_bias and own_kv else None
        self.out_bias = zeros((d_model,), ("embed",)) if out_bias else None
        self.q_norm, self.k_norm = (self.qk_norm(qk_norm, heads, axis, head_dim, norm_kind, eps)
                                    for heads, axis in ((n_heads, "heads"), (n_kv_heads, "kv_heads")))
        if not own_kv:
            self.k_norm = None
        self.v_eps, self.fixed_window = eps if v_norm else None, fixed_window
        self.l2_eps = eps if qk_norm == "l2" else None
        self.temperature = temperature
        self.rotate = None if rotate is None else per_layer(rotate)
        self.window, self.windows = (None, None) if window is None else (per_layer(window), tuple(windows))
        self.chunk, self.chunks = (None, None) if chunk is None else (per_layer(chunk), tuple(chunks))
        self.local_rope, self.softcap, self.scale = local_rope, softcap or None, scale or None
        # a logit beside the scores: float32 under bfloat16 training, as the softmax it joins (and zeros at first:
        # the sink then weighs as one key of logit 0 would)
        self.sinks = nnx.Param(jnp.zeros((n_heads,)), out_sharding=("heads",), full_precision=True,
                               role="bias") if sinks else None

    def __call__(self, x):
        return self.with_kv(x)[0]

    def with_kv(self, x, shared: tuple | None = None, keep: str | None = None, reuse: str | None = None):
        """(output, (keys, values)): the keys and values as attention took them (normed, rotated). shared: an
        earlier layer's, for a layer without its own (own_kv=False), with `reuse` naming them as that layer's
        `keep` did (shard.nn.hooks.attention's)."""
        q = jnp.einsum("bte,ehd->bthd", x, self.q[...])
        if self.q_bias is not None:
            q = q + self.q_bias[...]
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.rope:
            q = self.rotated(q)
        k, v = self.keys_values(x) if shared is None else shared
        if self.l2_eps is not None:
            q = self.where_rotating(rms(q, self.l2_eps), q)
        if self.temperature is not None:
            q = self.where_rotating(q, q * self.temperature_factor(q.shape[1]).astype(q.dtype))
        window = (self.window[...], self.windows) if self.window is not None else self.fixed_window or None
        sinks = None if self.sinks is None else self.sinks[...]
        more = {} if self.chunk is None else dict(chunk=(self.chunk[...], self.chunks))
        y = attention(q, k, v, is_causal=self.causal, window=window, softcap=self.softcap, scale=self.scale,
                      sinks=sinks, keep=keep, reuse=reuse, **more)  # handles grouped K/V heads itself
        if self.gate is not None:
            y = y * jax.nn.sigmoid(jnp.einsum("bte,ehd->bthd", x, self.gate[...]))
        y = jnp.einsum("bthd,hde->bte", y, self.out[...])
        return (y if self.out_bias is None else y + self.out_bias[...]), (k, v)

    def keys_values(self, x):
        """This layer's keys (normed, rotated) and values (normed where v_norm) of x."""
        if self.kv is None and self.k is None:
            raise ValueError("this attention layer has no keys or values of its own: hand it an earlier layer's")
        if self.k is not None:  # the values are the keys' projection, before the keys' norm and rotation
            k = v = jnp.einsum("bte,ehd->bthd", x, self.k[...])
        else:
            kv = jnp.einsum("bte,eshd->sbthd", x, self.kv[...])
            if self.kv_bias is not None:
                kv = kv + self.kv_bias[...][:, None, None]
            k, v = kv
        k, v = (constrain(t, ("batch", "length", "kv_heads", "head_dim")) for t in (k, v))
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.rope:
            k = self.rotated(k)
        if self.l2_eps is not None:
            k = self.where_rotating(rms(k, self.l2_eps), k)
        return k, v if self.v_eps is None else rms(v, self.v_eps)

    @staticmethod
    def qk_norm(kind: str, heads: int, axis: str, head_dim: int, norm_kind: str, eps: float):
        if kind in ("none", "l2"):
            return None
        if kind == "projection":  # the weight spans the heads too: the mean is over all of them
            return AxesRMSNorm((heads, head_dim), (axis, "head_dim"), eps, norm_kind == "rmsnorm+1")
        return AxesRMSNorm((head_dim,), ("head_dim",), eps, norm_kind == "rmsnorm+1")

    def where_rotating(self, rotating, still):
        """`rotating` on a layer that rotates positions, `still` on one that does not (every layer rotates where the
        model gives no per-layer setting)."""
        return rotating if self.rotate is None else jnp.where(self.rotate[...] != 0, rotating, still)

    def temperature_factor(self, length: int):
        """Llama 4's query scale by position, (length, 1, 1) or packed/decoding (batch, length, 1, 1)."""
        floor, scale = self.temperature
        at = positions(length).astype(jnp.float32)
        return (jnp.log1p(jnp.floor((at + 1.0) / floor)) * scale + 1.0)[..., None, None]

    def rotated(self, x):
        if self.rotate is None:
            return rotary(x, self.rope)
        y = jnp.where(self.rotate[...] != 0, rotary(x, self.rope), x)
        return y if self.local_rope is None else jnp.where(self.rotate[...] == 2, rotary(x, self.local_rope), y)


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


NORM_PLACES = ("pre", "post", "both")


class Block(nnx.Module):
    """Transformer block: x + attn(norm(x)), then x + ffn(norm(x)); `ffn` is any module from (batch, length,
    embed) to the same (an MLPBlock, or a mixture of experts). norms: where each sublayer's norms stand: "pre"
    (on its input: ln1, ln2), "post" (on its output, before the residual sum: ln1_post, ln2_post; OLMo 2) or
    "both" (Gemma 2 and 3)."""

    def __init__(self, d_model: int, norm_kind: str, attn: Attention, ffn: nnx.Module, rngs: nnx.Rngs,
                 eps: float = 1e-6, norms: str = "pre"):
        check_choice("norms", norms, NORM_PLACES)
        pre, post = norms != "post", norms != "pre"
        self.ln1 = norm(norm_kind, d_model, rngs, eps) if pre else None
        self.ln1_post = norm(norm_kind, d_model, rngs, eps) if post else None
        self.attn = attn
        # (an ffn that norms its own input, as Gemma 4's MoE block, has no norm before it here)
        self.ln2 = norm(norm_kind, d_model, rngs, eps) if pre and not getattr(ffn, "normalizes_input", False) else None
        self.ln2_post = norm(norm_kind, d_model, rngs, eps) if post else None
        self.ffn = ffn

    def __call__(self, x):
        return self.with_kv(x)[0]

    def with_kv(self, x, shared: tuple | None = None, keep: str | None = None, reuse: str | None = None):
        """(output, the attention's (keys, values)): Attention.with_kv's, through the block."""
        h, kv = self.attn.with_kv(x if self.ln1 is None else self.ln1(x), shared, keep, reuse)
        x = x + (h if self.ln1_post is None else self.ln1_post(h))
        x = x + _around(self.ffn, self.ln2, self.ln2_post, x)
        return constrain(x, ("batch", "length", "embed")), kv


def _around(sublayer, before, after, x):
    x = sublayer(x if before is None else before(x))
    return x if after is None else after(x)


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
