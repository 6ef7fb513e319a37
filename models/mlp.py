"""A multilayer perceptron for vectors: regression, binary or multiclass outputs.

The output is a linear unit per target; the loss decides what it means (mean squared error for
regression, a sigmoid for binary, a softmax over classes for multiclass).
Hidden widths alternate the logical names `mlp` and `embed`, so consecutive layers pair up
Megatron-style under tensor parallelism (the first split by columns, the next by rows) and `embed`
shards under FSDP.
"""

import jax
from flax import nnx

from shard.nn.partition import constrain

ACTIVATIONS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jax.nn.tanh, "silu": jax.nn.silu}


class MLP(nnx.Module):
    def __init__(self, in_features: int = 16, out_features: int = 10, hidden: list = (64, 64),
                 activation: str = "relu", *, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.activation = activation
        widths = [in_features, *hidden, out_features]
        names = ["features"] + [("mlp", "embed")[i % 2] for i in range(len(hidden))] + ["classes"]
        self.names = names
        self.layers = nnx.List([
            nnx.Linear(widths[i], widths[i + 1], rngs=rngs,
                       kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (names[i], names[i + 1])),
                       bias_init=nnx.with_partitioning(nnx.initializers.zeros, (names[i + 1],)))
            for i in range(len(widths) - 1)])

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)  # images or any other shape: one feature vector per example
        act = ACTIVATIONS[self.activation]
        for i, layer in enumerate(self.layers):
            x = constrain(layer(x), ("batch", self.names[i + 1]))
            if i < len(self.layers) - 1:
                x = act(x)
        return x
