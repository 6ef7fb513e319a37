"""Dropless routing per device (shard/nn/dropless.py) against the one-device computation: the same outputs and
gradients on a mesh whose `expert` and `fsdp` axes split the tokens and `expert` the experts too, each device
sorting only its own tokens and the experts' tokens travelling by all-gather and reduce-scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from shard.nn import dropless, partition

AXES = ("replica", "stage", "data", "expert", "fsdp", "context", "tensor")
B, T, D, F, N, K = 4, 6, 8, 12, 4, 2


def make_mesh(shape):
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))  # the framework's


def mlp(xs, sizes, weights):
    w_in, w_out = weights
    return jax.lax.ragged_dot(jax.nn.gelu(jax.lax.ragged_dot(xs, w_in, sizes)), w_out, sizes)


@pytest.fixture(scope="module")
def inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (B, T, D))
    top_p, top_e = jax.lax.top_k(jax.nn.softmax(jax.random.normal(keys[1], (B, T, N))), K)
    weights = (jax.random.normal(keys[2], (N, D, F)) / 3, jax.random.normal(keys[3], (N, F, D)) / 3)
    return x, top_e, top_p, weights


def loss(fn, x, top_e, top_p, weights):
    return jnp.sum(jnp.sin(fn(mlp, x, top_e, top_p, weights)))


@pytest.mark.parametrize("shape", [dict(expert=2, fsdp=2, tensor=2), dict(context=2, fsdp=2)])
def test_split_equals_one_device_with_gradients(inputs, shape):
    mesh = make_mesh(tuple(shape.get(a, 1) for a in AXES))
    x, top_e, top_p, weights = inputs
    want = jax.value_and_grad(lambda x, w: loss(dropless.local, x, top_e, top_p, w), argnums=(0, 1))(x, weights)

    # the weights as a train state lays them out: experts on `expert`, embed on `fsdp`, mlp on `tensor`
    place = lambda a, names: jax.device_put(a, NamedSharding(  # noqa: E731
        mesh, partition.logical_to_spec(names, partition.RULES, dict(mesh.shape))))
    weights = (place(weights[0], ("experts", "embed", "mlp")), place(weights[1], ("experts", "mlp", "embed")))
    split = lambda *a: dropless.split(*a, mesh, partition.RULES)  # noqa: E731
    run = jax.jit(jax.value_and_grad(lambda x, w: loss(split, x, top_e, top_p, w), argnums=(0, 1)))
    got = run(x, weights)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)

    hlo = run.lower(x, weights).compile().as_text()
    # each device sorts only a block of tokens the size of its own: B/4 rows x T or B/2 rows x T/2, x K pairs
    local = B * T * K // 4
    assert f"s32[{local}]" in hlo and f"s32[{2 * local}]" not in hlo
    if "expert" in shape:  # the blocks go round the expert devices
        assert "collective-permute" in hlo


def test_rows_that_do_not_divide_run_on_one_device(inputs):
    """Generation's single row: no axis splits it, the one-device computation."""
    mesh = make_mesh((1, 1, 1, 4, 2, 1, 1))
    x, top_e, top_p, weights = *(a[:1] for a in inputs[:3]), inputs[3]
    got, want = jax.jit(lambda *a: (dropless.split(mlp, *a, mesh, partition.RULES), dropless.local(mlp, *a)))(
        x, top_e, top_p, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)
