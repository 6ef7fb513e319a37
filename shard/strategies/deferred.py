"""A stacked layer's weight built inside the stack, one layer at a time (LoRA on a base stored bfloat16 or quantized).

Dequantizing a quantized base and adding the adapters to it before the model would hold the whole stack's weights
in float32 at once, more than the stored base saves (the compiler's peak for the 8B shape grew, bench/RESULTS.md).
Instead each stacked weight the model sees is a `Built`: its stored value (codes or bfloat16), the scales and the
adapters of every layer, a pytree whose arrays all keep the `layers` axis first. The stack (shard/hooks.py's
`scan`, `unrolled`, a pipeline's stage) slices it with the layers and calls `build()` for the one layer it runs,
under a checkpoint that saves nothing, so the backward pass rebuilds the layer's weight from its codes instead of
keeping every layer's; only the layer in hand exists as floats. The arithmetic is the whole-stack merge's
(shard/strategies/adapters.py's `adapted`, shard/quant/base.py's `dequantize_value`), a layer at a time.
"""

import jax
from flax import nnx

from shard.quant import base as quant
from shard.strategies import adapters


@jax.tree_util.register_pytree_node_class
class Built:
    """One stacked weight of the model: stored value (+ scale) and adapter pairs, built per layer by `build()`."""

    def __init__(self, stored, scale, pairs: tuple, kind: str, sites: tuple, factor: float, dtype=None):
        # sites: the adapted parts of the weight (adapters.Site, of the stacked weight)
        self.stored, self.scale, self.pairs = stored, scale, pairs
        self.kind, self.sites, self.factor, self.dtype = kind, sites, factor, dtype

    def tree_flatten(self):
        return (self.stored, self.scale, self.pairs), (self.kind, self.sites, self.factor, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def compute_in(self, dtype) -> "Built":
        """The same weight, built in the compute dtype (shard/core/precision.py's cast, done after the build)."""
        return Built(self.stored, self.scale, self.pairs, self.kind, self.sites, self.factor, dtype)

    def build(self):
        """The weight of the layer in hand (every array sliced to one layer): dequantized, adapters added, cast.
        The layer's arrays get back a `layers` axis of one for the adapters' product, so that it is a batched
        matrix product: activation checkpointing's policies that keep matrix products (train.remat=dots) keep
        those without batch dimensions, and A @ B is a weight's size, per layer."""
        w = quant.dequantize_value(self.stored, self.scale, self.kind)
        pairs = tuple((a[None], b[None]) for a, b in self.pairs)
        w = adapters.adapted(w[None], pairs, self.sites, self.factor)[0]
        return w if self.dtype is None else w.astype(self.dtype)


def stacked(names) -> bool:
    """Whether a weight's logical names say it is a stack's (its first axis `layers`)."""
    return bool(names) and names[0] == "layers"


def build_all(tree):
    """`tree` with every `Built` value replaced by the weight it builds (a layer's, inside a stack)."""
    return jax.tree.map(lambda v: v.build() if isinstance(v, Built) else v, tree,
                        is_leaf=lambda v: isinstance(v, Built))


def any_built(tree) -> bool:
    return any(isinstance(v, Built) for v in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, Built)))


def in_layers(fn, checkpointed: bool):
    """fn(layer, x) with the layer's `Built` weights built first. What the call updates besides the parameters
    (normalisation statistics) is written back to the layer the stack handed in. The backward pass builds each
    layer's weights again rather than keeping them: under activation checkpointing (`checkpointed`, train.remat)
    no policy keeps a built weight (none is a matrix product without batch dimensions, nor named); without it,
    such a layer runs as under train.remat=dots, keeping its matrix products' outputs."""
    def run(one, x):
        graphdef, params, rest = nnx.split(one, nnx.Param, ...)
        build = jax.checkpoint(build_all, policy=jax.checkpoint_policies.nothing_saveable)
        built = nnx.merge(graphdef, build(params), rest)
        out = fn(built, x)
        nnx.update(one, nnx.state(built, nnx.Not(nnx.Param)))
        return out

    def maybe(one, x):
        if not any_built(nnx.state(one, nnx.Param)):
            return fn(one, x)
        if checkpointed:
            return run(one, x)
        return nnx.remat(run, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)(one, x)

    return maybe
