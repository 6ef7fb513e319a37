"""Dropless routing per device (shard/nn/dropless.py) against the one-device computation: the same outputs and
gradients on a mesh whose `expert` and `fsdp` axes split the tokens and `expert` the experts too, each device
sorting only its own tokens and the experts' tokens travelling by all-to-all, in more rounds where routing is
skewed; inputs weighed before the experts (Llama 4). The grouped products (shard/nn/grouped.py) against
jax.lax.ragged_dot, with both gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from shard.nn import dropless, grouped, partition
from shard.plan import hlo

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


def ragged_by_the_docs(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                       axis_index_groups=None):
    """jax.lax.ragged_all_to_all as its documentation specifies it, from all_gather: XLA:CPU has no
    ragged-all-to-all. Where a sender's size for this device is not the size this device says it receives (the
    documented contract), the whole result is poisoned (NaN; -1 for integers), so that the test fails."""
    assert axis_index_groups is None
    # the primitive types its result as `output`: one that does not vary where the rows do would be typed wrong
    assert grouped._varying(output) >= grouped._varying(operand), "output's manual-axis type"
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    per = input_offsets.shape[0] // n
    ops, starts, sizes, ats = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                                       output_offsets))
    rows, result, agree = jnp.arange(output.shape[0]), output, True
    for src in range(n):
        for j in range(per):
            i, mine = src * per + j, me * per + j  # the slice src sends this device, as each side counts it
            start, at, size = starts[src][mine], ats[src][mine], recv_sizes[i]
            agree = agree & (sizes[src][mine] == size)
            hit = ((rows >= at) & (rows < at + size)).reshape(-1, *[1] * (output.ndim - 1))
            result = jnp.where(hit, ops[src][jnp.clip(start + rows - at, 0, operand.shape[0] - 1)], result)
    poison = jnp.nan if jnp.issubdtype(output.dtype, jnp.floating) else -1
    return jnp.where(agree, result, jnp.full_like(result, poison))


def test_the_ragged_exchange_by_the_docs_is_the_docs_example():
    """The stand-in above on the documentation's own example (an axis of 2), and on a wrong receive size."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    args = [[1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1]]
    run = jax.jit(jax.shard_map(lambda *a: ragged_by_the_docs(*a, axis_name="x"), mesh=mesh,
                                in_specs=(PartitionSpec("x"),) * 6, out_specs=PartitionSpec("x")))
    place = lambda a: jax.device_put(jnp.array(a, jnp.int32), NamedSharding(mesh, PartitionSpec("x")))  # noqa
    assert run(*map(place, args)).tolist() == [1, 3, 0, 0, 2, 2, 4, 0]
    args[5] = [1, 1, 2, 2]
    assert run(*map(place, args)).tolist() == [1, 3, 0, 0, -1, -1, -1, -1]


@pytest.fixture(params=["padded", "ragged"])
def exchange(request, monkeypatch):
    """The pairs sent in whole buckets (all-to-all) or only the buckets' pairs (ragged_all_to_all, by the docs,
    into a buffer left unwritten: here NaN, so that an empty slot read as a pair fails the test)."""
    if request.param == "ragged":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", ragged_by_the_docs)
        monkeypatch.setattr(jax.lax, "empty", lambda shape, dtype: jnp.full(shape, jnp.nan, dtype))
    return request.param


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
    if "expert" in shape:  # the pairs go to their experts' devices and back: all-to-all, no other exchange of them
        assert "all-to-all" in hlo and "collective-permute" not in hlo


def test_rows_that_do_not_divide_run_on_one_device(inputs):
    """Generation's single row: no axis splits it, the one-device computation."""
    mesh = make_mesh((1, 1, 1, 4, 2, 1, 1))
    x, top_e, top_p, weights = *(a[:1] for a in inputs[:3]), inputs[3]
    got, want = jax.jit(lambda *a: (dropless.split(mlp, *a, mesh, partition.RULES), dropless.local(mlp, *a)))(
        x, top_e, top_p, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)


EP = (1, 1, 1, 4, 1, 1, 1)  # the experts and the tokens over 4 devices, one expert each


@pytest.mark.parametrize("weigh_inputs", [False, True])
def test_skewed_routing_takes_more_rounds_and_drops_nothing(inputs, weigh_inputs, exchange):
    """Every pair to experts 0 and 1 (one device): its buckets overflow, so the exchange repeats until each pair
    went through its expert; outputs and gradients as on one device, inputs weighed before the experts or not, the
    buckets sent whole or only their pairs (the last round's partly full, the other devices' buckets empty)."""
    mesh = make_mesh(EP)
    x, _, top_p, weights = inputs
    top_e = jnp.broadcast_to(jnp.array([0, 1]), top_p.shape)
    held = NamedSharding(mesh, PartitionSpec("expert"))
    placed = tuple(jax.device_put(w, held) for w in weights)

    def total(fn, x, w, *mesh_args):
        return jnp.sum(jnp.sin(fn(mlp, x, top_e, top_p, w, *mesh_args, weigh_inputs=weigh_inputs, **kw)))

    kw = {}
    want = jax.value_and_grad(lambda x, w: total(dropless.local, x, w), argnums=(0, 1))(x, weights)
    kw = dict(exchange=exchange)
    got = jax.jit(jax.value_and_grad(lambda x, w: total(dropless.split, x, w, mesh, partition.RULES),
                                     argnums=(0, 1)))(x, placed)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)
    # an independent reference for the weighing: each token's weighted choices summed, by hand in NumPy
    xn, pn = np.asarray(x), np.asarray(top_p)
    expert = lambda v, e: np.asarray(jax.nn.gelu(v @ np.asarray(weights[0][e]))) @ np.asarray(weights[1][e])  # noqa
    by_hand = sum((expert(xn * pn[..., c:c + 1], c) if weigh_inputs else expert(xn, c) * pn[..., c:c + 1])
                  for c in range(K))
    np.testing.assert_allclose(np.asarray(dropless.local(mlp, x, top_e, top_p, weights, weigh_inputs)), by_hand,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weigh_inputs", [False, True])
@pytest.mark.parametrize("skewed, exchange", [(False, "padded"), (True, "padded"), (True, "ragged")],
                         indirect=["exchange"])  # ragged: skewed, its buckets empty, full and partly full
def test_a_recomputed_layer_runs_the_rounds_once_in_its_backward_pass(inputs, weigh_inputs, skewed, exchange):
    """Under activation checkpointing (remat: the layer's forward pass computed again for its backward pass) the
    exchange's backward pass runs each round's experts forward and backward at once, and the recomputation needs
    none of its rounds: two loops of rounds in the compiled gradient (the forward pass's, the backward pass's)
    where the exchange that keeps its forward pass's rounds has three (the recomputation's for the outputs, which
    the pairs' weights' gradient needs; bench/RESULTS.md's Qwen3-30B-A3B: 14 grouped products a layer against
    MaxText's 12, its rounds' first products computed a fourth time past 4 rounds' buffer). Outputs and
    gradients (the pairs' weights' too) as on one device, in one round and in more (every pair to one device)."""
    mesh = make_mesh(EP)
    x, top_e, top_p, weights = inputs
    top_e = jnp.broadcast_to(jnp.array([0, 1]), top_e.shape) if skewed else top_e
    placed = tuple(jax.device_put(w, NamedSharding(mesh, PartitionSpec("expert"))) for w in weights)

    def total(fn, remat=None):
        kw = {} if remat is None else dict(remat=remat)
        layer = jax.checkpoint(lambda x, p, w: x + fn(mlp, x, top_e, p, w, weigh_inputs=weigh_inputs, **kw),
                               policy=jax.checkpoint_policies.nothing_saveable)
        return jax.value_and_grad(lambda x, p, w: jnp.sum(jnp.sin(layer(x, p, w))), argnums=(0, 1, 2))

    want = total(dropless.local)(x, top_p, weights)
    loops = {}
    for remat in (True, False):
        run = jax.jit(total(lambda *a, **kw: dropless.split(*a[:5], mesh, partition.RULES, exchange=exchange, **kw),
                            remat))
        for g, w in zip(jax.tree.leaves(run(x, top_p, placed)), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)
        loops[remat] = len(re.findall(r"\swhile\(", run.lower(x, top_p, placed).compile().as_text()))
    # inputs weighed: the outputs' gradient needs no outputs, so the recomputation had none of the rounds either
    assert loops == {True: 2, False: 2 if weigh_inputs else 3}


def replicas(inputs, kernel, exchange):
    """Two replicas' inputs stacked, the second's routing skewed, for `vmapped`; and the step that runs them."""
    mesh = make_mesh((2, 1, 1, 2, 2, 1, 1))
    x, top_e, top_p, weights = inputs
    skewed = jnp.broadcast_to(jnp.array([0, 1]), top_e.shape)  # every pair to experts 0 and 1: buckets overflow
    xs, es, ps = jnp.stack([x, x[::-1]]), jnp.stack([top_e, skewed]), jnp.stack([top_p, top_p])
    ws = jax.tree.map(lambda w: jnp.stack([w, w[::-1]]), weights)

    def mlp_with(xs, sizes, weights):
        h = jax.nn.gelu(grouped.matmul(xs, weights[0], sizes, kernel))
        return grouped.matmul(h, weights[1], sizes, kernel)

    def per_replica(fn):
        total = lambda x, e, p, w: jnp.sum(jnp.sin(fn(mlp_with, x, e, p, w)))  # noqa: E731
        return jax.value_and_grad(total, argnums=(0, 3))

    want = jax.vmap(per_replica(dropless.local))(xs, es, ps, ws)
    rules = partition.without_batch_axes(partition.RULES, ("replica",))  # as sync.local_step's vmap sets them
    split = lambda *a: dropless.split(*a, mesh, rules, exchange=exchange)  # noqa: E731
    ws = jax.tree.map(lambda w: jax.device_put(w, NamedSharding(mesh, PartitionSpec("replica", "expert"))), ws)
    return jax.jit(jax.vmap(per_replica(split), spmd_axis_name="replica")), (xs, es, ps, ws), want


def test_the_ragged_exchange_is_batched_over_replicas_by_jax(inputs):
    """JAX 0.10's batching rule of ragged_all_to_all takes only batched offsets and sizes (an unbatched one failed
    its assertion: DiLoCo's step under ep did not compile for a GPU). Lowered here, where XLA:CPU cannot compile it."""
    step, args, _ = replicas(inputs, "tiled", "ragged")
    assert "ragged_all_to_all" in step.lower(*args).as_text()


@pytest.mark.parametrize("kernel, exchange", [("xla", "padded"), ("tiled", "padded"), ("tiled", "ragged")],
                         indirect=["exchange"])
def test_split_inside_a_vmap_over_replicas_equals_each_replica_on_one_device(inputs, kernel, exchange):
    """Local SGD and DiLoCo run each replica's step under a vmap whose dimension `replica` splits (spmd_axis_name,
    shard/strategies/sync.py): the exchange's shard_map is batched over the replicas (it did not compile). Each
    replica's outputs and gradients as on one device, with fsdp inside the expert group, the tiled kernel's loop,
    and one replica's routing skewed so that it takes more rounds than the other (each round's first products, kept
    by the forward pass, replayed in its backward: another round's fail); the buckets sent whole or only their
    pairs."""
    step, args, want = replicas(inputs, kernel, exchange)
    for g, w in zip(jax.tree.leaves(step(*args)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("sizes", [[10, 20, 30, 0], [0, 0, 37, 0], [0, 0, 0, 0], [3, 1, 4, 1]])
@pytest.mark.parametrize("kernel", ["tiled", "tokamax", "megablox"])
def test_grouped_products_equal_ragged_dot_with_both_gradients(sizes, kernel):
    """Rows past the groups come out zero; the rows' and the matrices' gradients equal those of
    jax.lax.ragged_dot (tokamax: its XLA path here, on CPU; megablox: its TPU kernels interpreted)."""
    pytest.importorskip("tokamax") if kernel == "tokamax" else None
    keys = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(keys[0], (64, 6)), jax.random.normal(keys[1], (4, 6, 5))
    dy, s = jax.random.normal(keys[2], (64, 5)), jnp.array(sizes, jnp.int32)
    want = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, s), x, w)
    got = jax.jit(lambda x, w: (lambda out, vjp: (out, vjp(dy)))(*jax.vjp(
        lambda x, w: grouped.matmul(x, w, s, kernel), x, w)))(x, w)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    for g, r in zip(got[1], want[1](dy)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_tiled_products_do_the_groups_work_not_every_groups():
    """The tiled kernel's matrix products, forward and backward, as the compiler's program counts them: at most
    (tiles + groups - 1) tiles' worth, where XLA's CPU lowering of ragged_dot does every group on every row."""
    m, k, n, g = 256, 16, 32, 8
    x, w, s = jnp.ones((m, k)), jnp.ones((g, k, n)), jnp.full((g,), m // g, jnp.int32)
    step = lambda kernel: jax.jit(jax.grad(lambda x, w: jnp.sum(grouped.matmul(x, w, s, kernel)), (0, 1)))  # noqa
    grouped_work = 3 * 2 * m * k * n  # forward, and the rows' and the matrices' gradients
    tile = grouped.tile_rows(m, g)
    tiled = hlo.dot_flops(step("tiled").lower(x, w).compile().as_text())
    assert tiled <= grouped_work * (m // tile + g - 1) / (m // tile)
    # (XLA:CPU computes one of ragged_dot's three products in a custom fusion the count does not open: still 5x)
    assert hlo.dot_flops(step("xla").lower(x, w).compile().as_text()) > 4 * tiled
