"""Rotary position embeddings (RoPE) in the half-split layout (channel i pairs with i + rotated/2, as
Llama's Hugging Face weights expect) or the interleaved one (2i with 2i + 1: Llama 4's), over all of a head's
channels or its first few, with the frequency scalings of Llama 3 (smooth stretching of long wavelengths), linear
(every position divided by a factor), LongRoPE (per-frequency factors, short or long by how far the call reaches,
and cos/sin scaled) and YaRN."""

import math
from dataclasses import dataclass, replace

import jax.numpy as jnp

from shard.nn.hooks import positions


@dataclass(frozen=True)
class Rope:
    """theta: the base of the frequencies. scaling: Llama 3's (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) or None: wavelengths longer than the original context are stretched
    by `factor`, short ones kept, and those between blended smoothly. dims: the channels of each head that
    rotate, the first `dims` (0: all; Phi's partial rotary factor). linear: every frequency divided by it.
    longrope: (short factors, long factors, original context, attention factor): each frequency divided by its
    factor, the long ones for a call whose last position is past the original context (as transformers
    decides per call), and cos and sin multiplied by the attention factor. yarn: (factor, original context,
    beta_fast, beta_slow, attention factor, truncate): frequencies turning more than beta_fast times over the
    original context kept, fewer than beta_slow divided by `factor`, a linear ramp between (its ends rounded outwards
    unless truncate is false: GPT-OSS's), and cos and sin multiplied by the attention factor. interleaved: the rotated
    pairs are adjacent channels (2i, 2i + 1), as Llama 4's complex rotation takes them, rather than (i, i + dims/2).
    proportional: the fraction of each head's channel pairs that rotate, the fastest ones, at the frequencies they
    have over the whole head; the others do not turn (0: all rotate; Gemma 4's global layers' proportional RoPE)."""
    theta: float = 10000.0
    scaling: tuple | None = None
    dims: int = 0
    linear: float = 1.0
    longrope: tuple | None = None
    yarn: tuple | None = None
    interleaved: bool = False
    proportional: float = 0.0

    def frequencies(self, half: int):
        freqs = self.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
        if self.proportional:
            freqs = jnp.where(jnp.arange(half) < int(self.proportional * half), freqs, 0.0)
        if self.linear != 1.0:
            freqs = freqs / self.linear
        if self.yarn is not None:
            factor, original, fast, slow, _, rounded = self.yarn

            def pair(turns):  # the channel pair whose frequency turns `turns` times over the original context
                return half * math.log(original / (turns * 2 * math.pi)) / math.log(self.theta)
            low, high = pair(fast), pair(slow)
            if rounded:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, 2 * half - 1)
            high = high + 0.001 if high == low else high  # a ramp of one step, not a division by zero
            kept = 1 - jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0, 1)
            return freqs / factor * (1 - kept) + freqs * kept
        if self.scaling is None:
            return freqs
        factor, low, high, original = self.scaling
        wavelength = 2 * math.pi / freqs
        blend = (original / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short
        blended = (1 - blend) * freqs / factor + blend * freqs
        return jnp.where(wavelength > original / low, freqs / factor,
                         jnp.where(wavelength < original / high, freqs, blended))


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
LONGROPE_KEYS = ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor")
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor")
PROPORTIONAL_KEYS = ("partial_rotary_factor", "factor")


def make(theta: float, scaling: dict | None = None, dims: int = 0, interleaved: bool = False) -> Rope:
    return replace(_make(theta, scaling, dims), interleaved=interleaved)


def _make(theta: float, scaling: dict | None = None, dims: int = 0) -> Rope:
    """A Rope from a GPT's settings. scaling: None or {} for none; Llama 3's four keys (rope_type "llama3" or
    none given); {"rope_type": "linear", "factor"}; or {"rope_type": "longrope", short_factor, long_factor,
    original_max_position_embeddings, attention_factor}; or {"rope_type": "yarn", factor,
    original_max_position_embeddings, beta_fast, beta_slow, attention_factor} and optionally truncate (default
    true); or {"rope_type": "proportional", partial_rotary_factor, factor}."""
    if not scaling:
        return Rope(theta, dims=dims)
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", "llama3")
    keys = {"llama3": LLAMA3_KEYS, "linear": ("factor",), "longrope": LONGROPE_KEYS, "yarn": YARN_KEYS,
            "proportional": PROPORTIONAL_KEYS}.get(kind)
    truncate = scaling.pop("truncate", True) if kind == "yarn" else True
    if keys is None or set(scaling) != set(keys) or not isinstance(truncate, bool):
        raise ValueError(f"rope_scaling={scaling | {'rope_type': kind}}: give rope_type llama3 with "
                         f"{', '.join(LLAMA3_KEYS)}; linear with factor; longrope with {', '.join(LONGROPE_KEYS)}; or "
                         f"yarn with {', '.join(YARN_KEYS)} (and optionally truncate, true or false); or "
                         f"proportional with {', '.join(PROPORTIONAL_KEYS)}")
    if kind == "llama3":
        return Rope(theta, tuple(float(scaling[k]) for k in LLAMA3_KEYS), dims)
    if kind == "linear":
        return Rope(theta, dims=dims, linear=float(scaling["factor"]))
    if kind == "proportional":
        fraction = float(scaling["partial_rotary_factor"])
        if not 0 < fraction <= 1:
            raise ValueError(f"rope_scaling: partial_rotary_factor={fraction}; give a fraction in (0, 1]")
        return Rope(theta, dims=dims, linear=float(scaling["factor"]), proportional=fraction)
    if kind == "yarn":
        return Rope(theta, dims=dims, yarn=(*(float(scaling[k]) for k in YARN_KEYS), truncate))
    short, long = (tuple(float(f) for f in scaling[k]) for k in LONGROPE_KEYS[:2])
    return Rope(theta, dims=dims, longrope=(short, long, int(scaling["original_max_position_embeddings"]),
                                            float(scaling["attention_factor"])))


def rotary(x, rope: "Rope | float"):
    """Rotary position embedding on (batch, length, heads, head_dim): rotate pairs of channels by an
    angle that grows with the position, so q.k depends on relative position. `rope`: a Rope, or its theta."""
    rope = rope if isinstance(rope, Rope) else Rope(rope)
    dims = rope.dims or x.shape[-1]
    half = dims // 2
    freqs = rope.frequencies(half)
    at = positions(x.shape[1]).astype(jnp.float32)  # (length,); packed or decoding: (batch, length)
    scale = rope.yarn[4] if rope.yarn is not None else 1.0
    if rope.longrope is not None:
        short, long, original, scale = rope.longrope
        freqs = freqs / jnp.where(jnp.max(at) + 1 > original, jnp.asarray(long), jnp.asarray(short))
    angles = at[..., None] * freqs  # (length, half); packed: (batch, length, half)
    cos, sin = (f(angles)[..., None, :] * scale for f in (jnp.cos, jnp.sin))  # a heads axis to broadcast over
    if rope.interleaved:
        x1, x2 = x[..., 0:dims:2].astype(jnp.float32), x[..., 1:dims:2].astype(jnp.float32)
        pairs = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(*x.shape[:-1], dims)
        return jnp.concatenate([pairs, x[..., dims:].astype(jnp.float32)], axis=-1).astype(x.dtype)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:dims].astype(jnp.float32)
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., dims:].astype(jnp.float32)]
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)
