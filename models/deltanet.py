"""Gated DeltaNet linear attention (Qwen3-Next's and Qwen3.5's linear layers): a fixed-size state per head instead
of a cache that grows with the context.

Each token's queries, keys and values go through a short causal depthwise convolution and SiLU; queries and keys are
L2-normed (the queries then scaled by 1/sqrt(key_dim)). Each value head keeps a state S (key_dim x value_dim), decayed
by exp(g) and corrected towards the token's value by the delta rule, at the rate beta:

    S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  out = S^T q

with beta = sigmoid(x W_b) and g = -exp(A_log) softplus(x W_a + dt_bias). The output is RMS-normed per head, times
the norm's weight and SiLU of a gate from the token (z), then projected back. Groups of value heads share a key head
(the value heads of key head n are n*g .. n*g + g-1), so the value-side weights are stored (key heads, group, ...).

Training computes the state in chunks (`chunked`: the delta rule within a chunk solved as one triangular system, the
state carried from chunk to chunk by a scan); generating and packed rows run it token by token (`recurrent`, which is
also the reference the tests hold the chunks to), through the framework's hook (shard.nn.hooks.linear_recurrence)
which keeps the convolution's window and the state per row while generating.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from shard.nn.hooks import linear_recurrence
from shard.nn.partition import constrain

from .layers import param

DELTANET_KEYS = ("key_heads", "value_heads", "key_dim", "value_dim", "conv")
CHUNK = 64  # tokens a chunk solves at once: its triangular system is CHUNK x CHUNK per head


def check(sizes: dict) -> dict:
    """The DeltaNet's sizes (DELTANET_KEYS), one ValueError line where they are not positive ints or the value heads
    are no multiple of the key heads."""
    if set(sizes) != set(DELTANET_KEYS) or any(not isinstance(v, int) or isinstance(v, bool) or v < 1
                                               for v in sizes.values()):
        raise ValueError(f"deltanet={sizes}: give {', '.join(DELTANET_KEYS)}, each an int >= 1")
    if sizes["value_heads"] % sizes["key_heads"]:
        raise ValueError(f"deltanet={sizes}: value_heads must be a multiple of key_heads")
    return sizes


def l2_normed(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _expand(x, groups: int):
    """(..., key heads, dim) -> (..., key heads, groups, dim): each key head's for its group of value heads."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], groups, x.shape[-1]))


def delta_step(state, q, k, v, beta, g):
    """One token of the gated delta rule: state (..., key_dim, value_dim); q, k (..., key_dim); v (..., value_dim);
    beta, g (...). Returns the new state and the token's output (..., value_dim)."""
    state = state * jnp.exp(g)[..., None, None]
    remembered = jnp.einsum("...kv,...k->...v", state, k)
    state = state + k[..., :, None] * ((v - remembered) * beta[..., None])[..., None, :]
    return state, jnp.einsum("...kv,...k->...v", state, q)


def recurrent(state, q, k, v, beta, g):
    """The delta rule token by token over time-major inputs (time, ...): the reference form. Returns (the last
    state, the outputs)."""
    def step(s, x):
        return delta_step(s, *x)
    return jax.lax.scan(step, state, (q, k, v, beta, g))


def chunked(state, q, k, v, beta, g, chunk: int = CHUNK):
    """The same as `recurrent`, a chunk of tokens at a time. Within a chunk (cumulative log-decay c_r from its start,
    state S0 before it) the corrections d_r = beta_r (v_r - exp(c_r) S0^T k_r - sum_{s<r} exp(c_r - c_s) (k_r.k_s) d_s)
    are one unit lower-triangular system (I + A) d = beta (v - exp(c) K S0), solved as U - W S0 with U and W from the
    chunk alone; the outputs are exp(c_r) S0^T q_r + sum_{s<=r} exp(c_r - c_s) (q_r.k_s) d_s and the state after the
    chunk exp(c_last) S0 + sum_s exp(c_last - c_s) k_s d_s^T. Only the state passes from chunk to chunk (a scan).
    Time-major inputs; the length need not be a multiple of `chunk` (padding with k = 0 and g = 0 leaves S as is)."""
    length = q.shape[0]
    pad = -length % chunk
    pads = lambda x: jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
    n = (length + pad) // chunk
    # (chunks, chunk, ...) -> the chunk's tokens next to the head axes: (chunks, ..., chunk[, dim])
    blocks = lambda x, tail: jnp.moveaxis(pads(x).reshape(n, chunk, *x.shape[1:]), 1, -1 - tail)  # noqa: E731
    q, k, v = (blocks(x, 1) for x in (q, k, v))
    beta, g = blocks(beta, 0), blocks(g, 0)
    c = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    decay = jnp.exp(jnp.where(lower | jnp.eye(chunk, dtype=bool), c[..., :, None] - c[..., None, :], -jnp.inf))
    a = jnp.where(lower, jnp.einsum("...rd,...sd->...rs", k, k) * decay * beta[..., :, None], 0.0)
    system = a + jnp.eye(chunk, dtype=a.dtype)
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)  # noqa: E731
    u = solve(v * beta[..., None])
    w = solve(k * (beta * jnp.exp(c))[..., None])
    scores = jnp.einsum("...rd,...sd->...rs", q, k) * decay  # (decay is 0 above the diagonal)
    q_decayed = q * jnp.exp(c)[..., None]
    k_left = k * jnp.exp(c[..., -1:] - c)[..., None]
    last = jnp.exp(c[..., -1])[..., None, None]

    def step(s, x):
        u, w, scores, q_decayed, k_left, last = x
        d = u - jnp.einsum("...rk,...kv->...rv", w, s)
        out = jnp.einsum("...rk,...kv->...rv", q_decayed, s) + jnp.einsum("...rs,...sv->...rv", scores, d)
        return last * s + jnp.einsum("...sk,...sv->...kv", k_left, d), out

    state, out = jax.lax.scan(step, state, (u, w, scores, q_decayed, k_left, last))
    out = jnp.moveaxis(out, -2, 1).reshape(n * chunk, *out.shape[1:-2], out.shape[-1])
    return state, out[:length]


def conv_window(window, x, w):
    """One token through the causal depthwise convolution: window (batch, conv - 1, ...) the previous inputs, x
    (batch, ...) the new one, w (conv, ...). Returns (the next window, the convolution's output)."""
    full = jnp.concatenate([window, x[:, None]], axis=1)
    return full[:, 1:], jnp.sum(full * w, axis=1)


def conv_sequence(x, w, window):
    """The causal depthwise convolution over time-major x (time, batch, ...), `window` (batch, conv - 1, ...) the
    inputs before the first token (zeros at a sequence's start)."""
    padded = jnp.concatenate([jnp.moveaxis(window, 1, 0), x])
    return sum(padded[j:j + x.shape[0]] * w[j] for j in range(w.shape[0]))


def after(window, x):
    """The window after time-major x: the last conv - 1 inputs of the window and x together."""
    return jnp.concatenate([window, jnp.moveaxis(x, 0, 1)], axis=1)[:, window.shape[1]:]


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet over (batch, length, d_model); `sizes` its DELTANET_KEYS, `eps` the output norm's epsilon."""

    def __init__(self, d_model: int, sizes: dict, out_std: float, rngs: nnx.Rngs, eps: float = 1e-6):
        nk, nv, dk, dv, conv = (check(sizes)[key] for key in DELTANET_KEYS)
        self.groups, self.eps = nv // nk, eps
        g = self.groups
        self.query = param(rngs, (d_model, nk, dk), ("embed", "kv_heads", "head_dim"), 0.02)
        self.key = param(rngs, (d_model, nk, dk), ("embed", "kv_heads", "head_dim"), 0.02)
        self.value = param(rngs, (d_model, nk, g, dv), ("embed", "kv_heads", None, "head_dim"), 0.02)
        self.z = param(rngs, (d_model, nk, g, dv), ("embed", "kv_heads", None, "head_dim"), 0.02)
        self.b = param(rngs, (d_model, nk, g), ("embed", "kv_heads", None), 0.02)
        self.a = param(rngs, (d_model, nk, g), ("embed", "kv_heads", None), 0.02)
        # (the convolution's taps are no matrix: kept out of quantization as a bias is)
        self.conv_q = nnx.Param(conv ** -0.5 * jax.random.normal(rngs.params(), (conv, nk, dk)),
                                out_sharding=(None, "kv_heads", "head_dim"), role="bias")
        self.conv_k = nnx.Param(conv ** -0.5 * jax.random.normal(rngs.params(), (conv, nk, dk)),
                                out_sharding=(None, "kv_heads", "head_dim"), role="bias")
        self.conv_v = nnx.Param(conv ** -0.5 * jax.random.normal(rngs.params(), (conv, nk, g, dv)),
                                out_sharding=(None, "kv_heads", None, "head_dim"), role="bias")
        # decay rates exp(A_log) spread over [1, 16] as Qwen3-Next's initialisation; softplus(dt_bias) ~ 1.3
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (nk, g), minval=1.0, maxval=16.0)),
                               out_sharding=("kv_heads", None), role="bias")
        self.dt_bias = nnx.Param(jnp.ones((nk, g)), out_sharding=("kv_heads", None), role="bias")
        self.norm = nnx.Param(jnp.ones((dv,)), out_sharding=("head_dim",), role="norm")
        self.proj = param(rngs, (nk, g, dv, d_model), ("kv_heads", None, "head_dim", "embed"), out_std)

    def __call__(self, x):
        return self.with_kv(x)[0]

    def with_kv(self, x, shared=None, keep=None, reuse=None):
        """(output, None): a Block's call (models/layers.py); a linear layer has no keys or values to share."""
        if shared is not None or keep is not None or reuse is not None:
            raise ValueError("a gated DeltaNet layer keeps no keys or values for other layers, nor reuses theirs")
        heads = ("batch", "length", "kv_heads")
        q = constrain(jnp.einsum("bte,end->btnd", x, self.query[...]), (*heads, "head_dim"))
        k = constrain(jnp.einsum("bte,end->btnd", x, self.key[...]), (*heads, "head_dim"))
        v = constrain(jnp.einsum("bte,engd->btngd", x, self.value[...]), (*heads, None, "head_dim"))
        z = constrain(jnp.einsum("bte,engd->btngd", x, self.z[...]), (*heads, None, "head_dim"))
        f32 = jnp.float32
        beta = jax.nn.sigmoid(jnp.einsum("bte,eng->btng", x, self.b[...]).astype(f32))
        a = jnp.einsum("bte,eng->btng", x, self.a[...]).astype(f32)
        g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(a + self.dt_bias[...].astype(f32))
        taps = tuple(w[...].astype(f32) for w in (self.conv_q, self.conv_k, self.conv_v))
        scale = q.shape[-1] ** -0.5

        def features(cq, ck, cv):  # the convolutions' outputs -> the rule's queries, keys and values
            q, k = l2_normed(jax.nn.silu(cq)), l2_normed(jax.nn.silu(ck))
            return _expand(q * scale, self.groups), _expand(k, self.groups), jax.nn.silu(cv)

        def whole(carry, xs):
            windows, state = carry
            *qkv, beta, g = xs
            convolved = (conv_sequence(t, w, win) for t, w, win in zip(qkv, taps, windows))
            state, out = chunked(state, *features(*convolved), beta, g)
            return (tuple(after(win, t) for win, t in zip(windows, qkv)), state), out

        def step(carry, xs):
            windows, state = carry
            q, k, v, beta, g = xs
            moved = [conv_window(win, t, w) for win, t, w in zip(windows, (q, k, v), taps)]
            state, out = delta_step(state, *features(*(m[1] for m in moved)), beta, g)
            return (tuple(m[0] for m in moved), state), out

        batch, nk, dk = x.shape[0], q.shape[2], q.shape[3]
        dv = v.shape[-1]
        conv = taps[0].shape[0]
        carry = (tuple(jnp.zeros((batch, conv - 1, *t.shape[2:]), f32) for t in (q, k, v)),
                 jnp.zeros((batch, nk, self.groups, dk, dv), f32))
        time_major = tuple(jnp.moveaxis(t.astype(f32), 1, 0) for t in (q, k, v, beta, g))
        _, out = linear_recurrence(whole, step, carry, time_major)
        out = jnp.moveaxis(out, 0, 1)  # (batch, length, key heads, group, value_dim)
        normed = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + self.eps)
        y = (self.norm[...].astype(f32) * normed.astype(x.dtype).astype(f32)) * jax.nn.silu(z.astype(f32))
        return jnp.einsum("btngd,ngde->bte", y.astype(x.dtype), self.proj[...]), None
