"""Mixed precision: float32 parameters, computation in the run's dtype (train.dtype).

The train step casts the parameters outside the stacked layers once, and leaves each stacked layer's to
`shard.hooks.layer`, which casts that layer's slice inside its activation checkpoint: the compute-dtype copy of
a layer is then made when the layer runs (and again when its backward recomputes it) rather than for every layer
at once before the first one runs, which kept a bfloat16 copy of all the layers alive for the whole step.
"""

import jax
import jax.numpy as jnp
from flax import nnx

STACKED = "layers"  # the logical name of a stacked layers axis (models/layers.py `stacked`)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def cast_floats(tree, dtype, keep_stacked: bool = False):
    """Floating arrays to the compute dtype; the parameters themselves stay float32.

    A variable created with `full_precision=True` metadata is left as it is: a model asks for it where
    rounding would change a discrete choice (a mixture of experts' router, as in Switch Transformer).
    keep_stacked: leave the variables on a stacked layers axis too (cast per layer by shard.hooks.layer)."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def one(x):
        if not _is_var(x):
            return cast(x)
        meta = x.get_metadata()
        if meta.get("full_precision") or (keep_stacked and tuple(meta.get("out_sharding") or ())[:1] == (STACKED,)):
            return x
        return jax.tree.map(cast, x)

    return jax.tree.map(one, tree, is_leaf=_is_var)


def cast_module(module: nnx.Module, dtype) -> nnx.Module:
    """A copy of `module` whose floating parameters are in `dtype` (its other state shared, so what a call
    updates lands in the original's variables through `write_back`)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return nnx.merge(graphdef, cast_floats(params, dtype), rest)


def write_back(original: nnx.Module, copy: nnx.Module) -> None:
    """What a call on a `cast_module` copy changed besides the parameters, into the original."""
    changed = nnx.state(copy, nnx.Not(nnx.Param))
    if jax.tree.leaves(changed):
        nnx.update(original, changed)
