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


def test_moe_router_chooses_from_float32_scores_under_bfloat16():
    from models.moe import MoE

    with nnx.use_eager_sharding(False):
        model = MoE(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_len=16, n_experts=8, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    cast = cast_floats(params, jnp.bfloat16)
    assert cast["blocks"]["ffn"]["router"].get_value().dtype == jnp.float32  # not rounded to bf16
    assert cast["blocks"]["ffn"]["w_in"].get_value().dtype == jnp.bfloat16
    forward = lambda p, x: nnx.merge(graphdef, p, rest, copy=True)(x)
    eqns = all_eqns(jax.make_jaxpr(forward)(cast, jnp.zeros((2, 16), jnp.int32)).jaxpr)
    # The scores (batch, length, experts) come from a float32 product, and top_k reads float32.
    scores = [e for e in eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape == (2, 16, 8)]
    assert scores and all(v.aval.dtype == jnp.float32 for e in scores for v in e.invars)
    top_k = [e for e in eqns if e.primitive.name == "top_k"]
    assert top_k and all(e.invars[0].aval.dtype == jnp.float32 for e in top_k)


def all_eqns(jaxpr) -> list:
    """The equations of a jaxpr and of every jaxpr inside it (scan bodies, remat, ...)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    out += all_eqns(inner)
    return out
