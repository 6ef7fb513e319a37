"""Multi-head latent attention (DeepSeek-V2's and V3's MLA): keys and values made from one small latent per token.

Each token's keys and values come from a compressed latent (`kv_rank` wide, normed) expanded per head by one matrix
into a key part without positions (`nope` wide) and the value (`v_dim` wide), plus one rotated key part (`rope_dim`
wide) shared by every head; the queries the same two parts per head, straight from the token or through a latent of
their own (`q_rank`, normed). A head's key is its `nope` part and the shared rotated part side by side, so q.k sums
both products. The attention hook takes keys and values of one width: the values are padded with zeros to the keys'
and the output cut back (the padding adds no term to any output). While generating, the up-projections are absorbed
(`_absorbed`): the cache holds the latent and the rotated key, kv_rank + rope_dim values a token a layer (DeepSeek-V3's
576, against 2 x 128 heads x 192 expanded).
"""

import jax.numpy as jnp
from flax import nnx

from shard.nn.hooks import attention, generating
from shard.nn.partition import constrain

from .layers import AxesRMSNorm, param
from .rope import Rope, rotary

LATENT_KEYS = ("q_rank", "kv_rank", "nope_dim", "rope_dim", "v_dim")


def check(latent: dict) -> dict:
    """The latent attention's sizes (LATENT_KEYS; q_rank 0: queries straight from the token), one ValueError line
    where they are not whole numbers of the right signs."""
    if set(latent) != set(LATENT_KEYS) or any(not isinstance(v, int) or isinstance(v, bool) for v in latent.values()):
        raise ValueError(f"latent={latent}: give {', '.join(LATENT_KEYS)}, each an int")
    if latent["q_rank"] < 0 or min(latent[k] for k in LATENT_KEYS[1:]) < 1 or latent["rope_dim"] % 2 or \
            latent["v_dim"] > latent["nope_dim"] + latent["rope_dim"]:
        raise ValueError(f"latent={latent}: q_rank >= 0 (0: none), the others >= 1, rope_dim even, v_dim at most "
                         "nope_dim + rope_dim")
    return latent


class LatentAttention(nnx.Module):
    """Causal multi-head latent attention over (batch, length, d_model); `latent` its sizes (LATENT_KEYS), `rope` the
    rotation of the positional parts, `scale` the factor on q.k (0: 1/sqrt(nope_dim + rope_dim)), `eps` the latents'
    norms' epsilon, `bias` biases on the token's two down-projections and the output (DeepSeek's attention_bias)."""

    def __init__(self, d_model: int, n_heads: int, latent: dict, rope: Rope, out_std: float, rngs: nnx.Rngs,
                 scale: float = 0.0, eps: float = 1e-6, bias: bool = False):
        q_rank, kv_rank, nope, rot, v_dim = (check(latent)[k] for k in LATENT_KEYS)
        self.nope, self.rot, self.v_dim, self.rope = nope, rot, v_dim, rope
        self.scale = scale or (nope + rot) ** -0.5
        heads = ("heads", "head_dim")
        self.q = param(rngs, (d_model, n_heads, nope + rot), ("embed", *heads), 0.02) if not q_rank else None
        self.q_a = param(rngs, (d_model, q_rank), ("embed", None), 0.02) if q_rank else None
        self.q_a_bias = nnx.Param(jnp.zeros((q_rank,)), out_sharding=(None,), role="bias") if q_rank and bias else None
        self.q_norm = AxesRMSNorm((q_rank,), (None,), eps) if q_rank else None
        self.q_b = param(rngs, (q_rank, n_heads, nope + rot), (None, *heads), 0.02) if q_rank else None
        self.kv_a = param(rngs, (d_model, kv_rank + rot), ("embed", None), 0.02)
        self.kv_a_bias = nnx.Param(jnp.zeros((kv_rank + rot,)), out_sharding=(None,), role="bias") if bias else None
        self.kv_norm = AxesRMSNorm((kv_rank,), (None,), eps)
        self.kv_b = param(rngs, (kv_rank, n_heads, nope + v_dim), (None, *heads), 0.02)
        self.out = param(rngs, (n_heads, v_dim, d_model), (*heads, "embed"), out_std)
        self.out_bias = nnx.Param(jnp.zeros((d_model,)), out_sharding=("embed",), role="bias") if bias else None

    def __call__(self, x):
        return self.with_kv(x)[0]

    def with_kv(self, x, shared: tuple | None = None, keep: str | None = None, reuse: str | None = None):
        """(output, (keys, values)), as models/layers.py's Attention.with_kv (no layer shares a latent's keys)."""
        if shared is not None:
            raise ValueError("latent attention makes its own keys and values; it reuses no other layer's")
        if self.q is not None:
            q = jnp.einsum("bte,ehd->bthd", x, self.q[...])
        else:
            down = x @ self.q_a[...] + (0 if self.q_a_bias is None else self.q_a_bias[...])
            q = jnp.einsum("btr,rhd->bthd", self.q_norm(down), self.q_b[...])
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        q = jnp.concatenate([q[..., :self.nope], rotary(q[..., self.nope:], self.rope)], axis=-1)
        down = x @ self.kv_a[...] + (0 if self.kv_a_bias is None else self.kv_a_bias[...])
        latent, k_rot = self.kv_norm(down[..., :-self.rot]), rotary(down[..., None, -self.rot:], self.rope)
        if generating():
            return self._absorbed(q, latent, k_rot, keep, reuse)
        kv = constrain(jnp.einsum("btr,rhd->bthd", latent, self.kv_b[...]), ("batch", "length", "heads", "head_dim"))
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (*k_nope.shape[:-1], self.rot))], axis=-1)
        wide = jnp.pad(v, ((0, 0),) * 3 + ((0, self.nope + self.rot - self.v_dim),))
        y = attention(q, k, wide, is_causal=True, scale=self.scale, keep=keep, reuse=reuse)[..., :self.v_dim]
        y = jnp.einsum("bthd,hde->bte", y, self.out[...])
        return (y if self.out_bias is None else y + self.out_bias[...]), (k, wide)

    def _absorbed(self, q, latent, k_rot, keep, reuse):
        """While generating: the key up-projection folded into the queries (q_nope . W_k is a query over the latent)
        and the value up-projection applied after attention over the latents, so the cache holds one normed latent
        and one rotated key a token (kv_rank + rope_dim values) rather than every head's keys and values."""
        if keep or reuse:
            raise ValueError("latent attention makes its own keys and values; it reuses no other layer's")
        w = self.kv_b[...]
        q_latent = jnp.einsum("bthd,rhd->bthr", q[..., :self.nope], w[..., :self.nope])
        q = constrain(jnp.concatenate([q_latent, q[..., self.nope:]], axis=-1), ("batch", "length", "heads", None))
        k = jnp.concatenate([latent, k_rot[:, :, 0].astype(latent.dtype)], axis=-1)[:, :, None]
        y = attention(q, k, None, is_causal=True, scale=self.scale, values=latent.shape[-1])
        y = jnp.einsum("bthr,rhd->bthd", y, w[..., self.nope:])
        y = jnp.einsum("bthd,hde->bte", y, self.out[...])
        return (y if self.out_bias is None else y + self.out_bias[...]), None
