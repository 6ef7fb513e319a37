"""A vision transformer: the image cut into square patches, each patch a token (a linear map of its
pixels plus a learned position), a stack of non-causal transformer blocks (scanned, as in gpt), the
tokens averaged, and a linear classifier.
"""

import math

import jax.numpy as jnp
from flax import nnx

from shard.nn.hooks import stack
from shard.nn.partition import constrain

from .layers import Attention, Block, MLPBlock, check_choice, norm, param, stacked


class ViT(nnx.Module):
    """Images (batch, height, width[, channels]) -> class scores. The image sides must be multiples of `patch`."""

    def __init__(self, image_size: int = 8, in_channels: int = 1, patch: int = 2, num_classes: int = 10,
                 d_model: int = 64, n_layers: int = 4, n_heads: int = 4, d_ff: int = 0, norm_kind: str = "layernorm",
                 *, rngs: nnx.Rngs):
        check_choice("norm_kind", norm_kind, ("layernorm", "rmsnorm"))
        if image_size % patch:
            raise ValueError(f"image_size={image_size} is not a multiple of patch={patch}")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.patch, self.image_size, self.in_channels = patch, image_size, in_channels
        n_patches, patch_dim = (image_size // patch) ** 2, patch * patch * in_channels
        out_std = 0.02 / math.sqrt(2 * n_layers)
        self.embed = param(rngs, (patch_dim, d_model), ("features", "embed"), 1 / math.sqrt(patch_dim))
        self.pos = param(rngs, (n_patches, d_model), (None, "embed"), 0.02)

        def make_block(rngs):
            attn = Attention(d_model, n_heads, n_heads, None, out_std, causal=False, rngs=rngs)
            return Block(d_model, norm_kind, attn, MLPBlock(d_model, d_ff or 4 * d_model, False, out_std, rngs), rngs)

        self.blocks = stacked(n_layers, make_block, rngs)
        self.ln_f = norm(norm_kind, d_model, rngs)
        self.head = param(rngs, (d_model, num_classes), ("embed", "classes"), 0.02)

    def __call__(self, images):
        x = images if images.ndim == 4 else images[..., None]
        b, h, w, c = x.shape
        if (h, w, c) != (self.image_size, self.image_size, self.in_channels):
            raise ValueError(f"images of shape {images.shape[1:]}; the model was built for "
                             f"image_size={self.image_size}, in_channels={self.in_channels}")
        p = self.patch
        patches = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = constrain(patches @ self.embed[...] + self.pos[...], ("batch", "length", "embed"))
        x = self.ln_f(stack(self.blocks, x))
        return jnp.mean(x, axis=1) @ self.head[...]
