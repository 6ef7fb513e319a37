"""train.dtype=bfloat16 computes in bf16 while the parameters and optimizer state stay float32."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shard.step import cast_floats

from conftest import TINY_GPT


def test_bfloat16_compute_with_float32_parameters(train):
    result = train(*TINY_GPT, "train.dtype=bfloat16", "train.steps=20", "run.log_every=1", "optimizer.lr=1e-2",
                   "run.cpu_devices=8", "mesh=fsdp_tp")
    curve = [r["loss"] for r in result.history]
    assert np.all(np.isfinite(curve)) and np.mean(curve[-3:]) < np.mean(curve[:3]) - 0.3
    dtypes = {x.dtype for x in jax.tree.leaves((result.state.params, result.state.opt_state)) if x.ndim}
    assert dtypes == {jnp.dtype("float32")}
    # The step casts parameters and float inputs to bf16 before the forward pass (on CPU, XLA may then
    # upcast the products internally, so we check the traced program rather than the compiled one).
    params = cast_floats(result.state.params, jnp.bfloat16)
    forward = lambda p, x: nnx.merge(result.graphdef, p, result.state.rest)(x)
    jaxpr = str(jax.make_jaxpr(forward)(params, jnp.zeros((2, 32), jnp.int32)))
    assert "bf16" in jaxpr and "f32[" not in jaxpr.split("dot_general")[1][:200]
    assert jax.jit(forward)(params, jnp.zeros((2, 32), jnp.int32)).dtype == jnp.bfloat16
