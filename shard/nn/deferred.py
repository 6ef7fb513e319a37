"""Weights a run builds one layer at a time inside a stack, and the stack's call of a layer that builds them.

A run may hand a model, in place of a stacked weight, a `Deferred`: a pytree whose arrays all keep the `layers`
axis first and whose `build()` makes the weight of the one layer in hand (a quantized base plus LoRA's adapters:
shard/strategies/deferred.py's `Built`). The stack (shard/nn/hooks.py) slices it with the layers and calls a layer
through `in_layers`, so only the layer in hand exists as floats; the backward pass builds it again rather than
keeping every layer's.
"""

import jax
from flax import nnx


class Deferred:
    """A stacked weight built per layer: `build()`, on the layer's slice, gives the weight the layer uses."""

    def build(self):
        raise NotImplementedError(f"{type(self).__name__} builds no weight")


def build_all(tree):
    """`tree` with every `Deferred` value replaced by the weight it builds (a layer's, inside a stack)."""
    return jax.tree.map(lambda v: v.build() if isinstance(v, Deferred) else v, tree,
                        is_leaf=lambda v: isinstance(v, Deferred))


def any_built(tree) -> bool:
    return any(isinstance(v, Deferred) for v in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, Deferred)))


def in_layers(checkpointed: bool):
    """A stack's call of one layer, layer(x), with the layer's `Deferred` weights built first. What the call updates
    besides the parameters (normalisation statistics) is written back to the layer the stack handed in. The backward
    pass builds each layer's weights again rather than keeping them: under activation checkpointing (`checkpointed`,
    train.remat) no policy keeps a built weight (none is a matrix product without batch dimensions, nor named);
    without it, such a layer runs as under train.remat=dots, keeping its matrix products' outputs."""
    def run(one, x):
        graphdef, params, rest = nnx.split(one, nnx.Param, ...)
        # a fresh function each trace: jax.checkpoint caches a function's trace, and as_used's layout is the mesh's
        build = jax.checkpoint(lambda p: build_all(p), policy=jax.checkpoint_policies.nothing_saveable)
        built = nnx.merge(graphdef, build(params), rest)
        out = built(x)
        nnx.update(one, nnx.state(built, nnx.Not(nnx.Param)))
        return out

    def maybe(one, x):
        if not any_built(nnx.state(one, nnx.Param)):
            return one(x)
        if checkpointed:
            return run(one, x)
        return nnx.remat(run, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)(one, x)

    return maybe
