"""Mixed precision: float32 parameters, computation in the run's dtype (train.dtype).

The step casts every floating parameter once, before the model runs. Casting each stacked layer's slice inside
the layer instead (as MaxText's layers do) was tried and measured by the TPU and GPU compilers: a scanned
Llama-3-8B shape on v5p-8 grew from 40.1 to 44.3 GiB a chip and its step by 2% (the all-gathers then move
float32), so the cast stays in front (bench/RESULTS.md, issue 46). The exception: a weight LoRA builds inside
its stack from a stored base (shard/strategies/deferred.py) is cast there, after it is built (`compute_in`).
"""

import jax
import jax.numpy as jnp
from flax import nnx


def cast_floats(tree, dtype):
    """Floating arrays to the compute dtype; the parameters themselves stay float32.

    A variable created with `full_precision=True` metadata is left as it is: a model asks for it where
    rounding would change a discrete choice (a mixture of experts' router, as in Switch Transformer)."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    is_var = lambda x: isinstance(x, nnx.Variable)

    def one(x):
        if not is_var(x):
            return cast(x)
        if x.get_metadata().get("full_precision"):
            return x
        value = x.get_value()
        if hasattr(value, "compute_in"):  # a weight built inside its stack (shard/strategies/deferred.py), cast there
            return x.replace(value.compute_in(dtype))
        return jax.tree.map(cast, x)

    return jax.tree.map(one, tree, is_leaf=is_var)
