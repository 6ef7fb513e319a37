"""train.dtype=bfloat16 computes in bf16 while the parameters and optimizer state stay float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shard.core.step import cast_floats

from conftest import TINY_GPT


class _Traced(Exception):
    """Raised by the spy once it holds the train step's program: nothing more of the run is needed."""


def trained_step_program(monkeypatch, finish: bool):
    """Spy on the trainer's `shard.core.step.compile_step`: get() is the jaxpr of the train step function the
    trainer hands it to compile into Result.train_step, traced again there (under the run's mesh, rules
    and remat policy). With finish=False the run stops there (raising _Traced): nothing is compiled."""
    from shard.core import step

    compile_step, seen = step.compile_step, []

    def spy(fn, abstract_state, state_shardings, abstract_batch, *args, **kwargs):
        if kwargs.get("returns_state"):  # the train step, not the eval step
            seen.append(jax.make_jaxpr(fn)(abstract_state, abstract_batch).jaxpr)
            if not finish:
                raise _Traced
        return compile_step(fn, abstract_state, state_shardings, abstract_batch, *args, **kwargs)

    monkeypatch.setattr(step, "compile_step", spy)

    def get():
        assert len(seen) == 1, "the trainer compiled no train step through shard.core.step.compile_step"
        return seen[0]

    return get


def products(jaxpr) -> list:
    """The matrix products (and convolutions) of a program, loops and checkpointed layers included."""
    return [e for e in all_eqns(jaxpr) if e.primitive.name in ("dot_general", "conv_general_dilated")]


def test_bfloat16_compute_with_float32_parameters(train, monkeypatch):
    program = trained_step_program(monkeypatch, finish=True)
    result = train(*TINY_GPT, "train.dtype=bfloat16", "train.steps=20", "run.log_every=1", "optimizer.lr=1e-2",
                   "run.cpu_devices=8", "mesh=fsdp_tp")
    curve = [r["loss"] for r in result.history]
    assert np.all(np.isfinite(curve)) and np.mean(curve[-3:]) < np.mean(curve[:3]) - 0.3
    dtypes = {x.dtype for x in jax.tree.leaves((result.state.params, result.state.opt_state)) if x.ndim}
    assert dtypes == {jnp.dtype("float32")}
    # The program that was trained computes its products in bf16: every matrix product, forward and
    # backward, takes a bf16 operand (the attention backward multiplies a float32 cotangent of the
    # float32 softmax logits by bf16 values). We read the traced program, not the compiled HLO: XLA's
    # CPU backend rewrites bf16 products as float32 ones with converts around them.
    bf16 = jnp.dtype("bfloat16")
    dots = products(program())
    assert len(dots) >= 6  # q, kv, out, MLP in, MLP out, head: at least their forward products
    assert all(any(v.aval.dtype == bf16 for v in e.invars) for e in dots), \
        [tuple(str(v.aval.dtype) for v in e.invars) for e in dots]
    assert sum(all(v.aval.dtype == bf16 for v in e.invars) for e in dots) >= len(dots) / 2


def test_float32_step_has_no_bfloat16(train, monkeypatch):
    """The other side: train.dtype=float32 (the default) puts no bf16 anywhere in the step."""
    program = trained_step_program(monkeypatch, finish=False)
    with pytest.raises(_Traced):
        train(*TINY_GPT, "train.dtype=float32", "run.cpu_devices=8", "mesh=fsdp_tp")
    eqns = all_eqns(program())
    assert len(products(program())) >= 6
    assert not [e for e in eqns for v in (*e.invars, *e.outvars)
                if hasattr(v, "aval") and getattr(v.aval, "dtype", None) == jnp.dtype("bfloat16")]


def test_moe_router_chooses_from_float32_scores_under_bfloat16():
    from shard.models.moe import MoE

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
