"""Rotary position embeddings (RoPE) in the half-split layout (channel i pairs with i + head_dim/2, as
Llama's Hugging Face weights expect), with Llama 3's frequency scaling for long contexts."""

import math
from dataclasses import dataclass

import jax.numpy as jnp

from shard.hooks import positions


@dataclass(frozen=True)
class Rope:
    """theta: the base of the frequencies. scaling: Llama 3's (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) or None: wavelengths longer than the original context are stretched
    by `factor`, short ones kept, and those between blended smoothly."""
    theta: float = 10000.0
    scaling: tuple | None = None

    def frequencies(self, half: int):
        freqs = self.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
        if self.scaling is None:
            return freqs
        factor, low, high, original = self.scaling
        wavelength = 2 * math.pi / freqs
        blend = (original / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short
        blended = (1 - blend) * freqs / factor + blend * freqs
        return jnp.where(wavelength > original / low, freqs / factor,
                         jnp.where(wavelength < original / high, freqs, blended))


def rotary(x, rope: "Rope | float"):
    """Rotary position embedding on (batch, length, heads, head_dim): rotate pairs of channels by an
    angle that grows with the position, so q.k depends on relative position. `rope`: a Rope, or its theta."""
    rope = rope if isinstance(rope, Rope) else Rope(rope)
    half = x.shape[-1] // 2
    freqs = rope.frequencies(half)
    angles = positions(x.shape[1]).astype(jnp.float32)[..., None] * freqs  # (length, half); packed: (batch, length, half)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # a heads axis to broadcast over
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
