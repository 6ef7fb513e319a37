"""Stacked LSTMs for sequences: a byte-level language model, or a sequence classifier.

Each layer is an LSTM run with a scan over time; the layers are stacked on a `layers` axis and run
with a scan over depth (as the transformers' blocks), so compile time does not grow with either.
The input-to-gate products of a layer are computed for all time steps at once before its time scan:
only the recurrent product h @ W_h is sequential.

Every layer has width d_model (`embed`); gates are split by hidden unit (`mlp`), so under tensor
parallelism each device computes its share of the units and the hidden state is gathered once per
time step (a recurrence cannot avoid one collective per step when its units are split).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shard.nn.hooks import recurrence, stack
from shard.nn.partition import constrain

from .layers import param, stacked


class LSTMLayer(nnx.Module):
    def __init__(self, d_model: int, rngs: nnx.Rngs):
        std = 1 / math.sqrt(d_model)
        # gates (input, forget, cell, output) on a separate axis, so splitting by unit keeps each
        # device's four gates of a unit together
        self.w_x = param(rngs, (d_model, 4, d_model), ("embed", None, "mlp"), std)
        self.w_h = param(rngs, (d_model, 4, d_model), ("embed", None, "mlp"), std)
        # forget gate bias 1: remember by default early in training
        self.b = nnx.Param(jnp.zeros((4, d_model)).at[1].set(1.0), out_sharding=(None, "mlp"), role="bias")

    def __call__(self, x):  # (batch, length, d_model) -> same
        gates_x = constrain(jnp.einsum("btd,dgh->tbgh", x, self.w_x[...]) + self.b[...],
                            ("length", "batch", None, "mlp"))
        w_h = self.w_h[...]

        def step(carry, gx):
            h, c = carry
            g = gx + jnp.einsum("bd,dgh->bgh", h, w_h)
            i, f, u, o = (g[:, k] for k in range(4))
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(u)
            h = (jax.nn.sigmoid(o) * jnp.tanh(c)).astype(x.dtype)  # the cell state stays float32
            return (h, c), h

        zeros = jnp.zeros((x.shape[0], x.shape[2]), x.dtype)
        _, hs = recurrence(step, (zeros, zeros.astype(jnp.float32)), gates_x)
        return constrain(hs.transpose(1, 0, 2), ("batch", "length", "embed"))


class LSTM(nnx.Module):
    """Inputs: int tokens (batch, length) with vocab_size > 0, or float vectors (batch, length,
    in_features). Outputs: next-token logits (batch, length, vocab_size), or with num_classes > 0
    class scores (batch, num_classes) from the last time step's hidden state.
    """

    def __init__(self, vocab_size: int = 256, in_features: int = 0, d_model: int = 128, n_layers: int = 2,
                 num_classes: int = 0, *, rngs: nnx.Rngs):
        if (vocab_size > 0) == (in_features > 0):
            raise ValueError(f"vocab_size={vocab_size}, in_features={in_features}: set exactly one "
                             "(tokens in, or vectors in; the other 0)")
        self.vocab_size, self.num_classes = vocab_size, num_classes
        if vocab_size:
            self.embed = param(rngs, (vocab_size, d_model), ("vocab", "embed"), 0.1)
        else:
            self.embed = param(rngs, (in_features, d_model), ("features", "embed"), 1 / math.sqrt(in_features))
        self.layers = stacked(n_layers, lambda rngs: LSTMLayer(d_model, rngs), rngs)
        out = num_classes or vocab_size
        self.head = param(rngs, (d_model, out), ("embed", "classes" if num_classes else "vocab"),
                          1 / math.sqrt(d_model))
        self.head_bias = nnx.Param(jnp.zeros((out,)), out_sharding=("classes" if num_classes else "vocab",),
                                   role="bias")

    def __call__(self, inputs):
        if self.vocab_size:
            x = constrain(self.embed[...], ("vocab", None))[inputs]  # gather from whole rows (see gpt)
        else:
            x = inputs @ self.embed[...]
        h = stack(self.layers, constrain(x, ("batch", "length", "embed")))
        if self.num_classes:
            return h[:, -1] @ self.head[...] + self.head_bias[...]
        return constrain(h @ self.head[...] + self.head_bias[...], ("batch", "length", "vocab"))
