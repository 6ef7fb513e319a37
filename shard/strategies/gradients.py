"""How the train step's gradients are computed and reduced over the devices that split the batch.

By default the batch runs as one program and XLA's partitioner reduces each gradient inside the
backward pass, where it is produced: an all-reduce under data parallelism, a reduce-scatter under
fsdp, in whatever dtype the backward pass makes it. Three knobs change that:

- `train.grad_accum=K`: the batch runs as K microbatches in a scan, gradients summed in
  `train.accum_dtype`, one update.
- `train.grad_dtype=bfloat16`: the sum across the data axis runs in bfloat16 (half the bytes).
- ZeRO (`mesh.zero`): gradients are reduced into the optimizer state's split layout, so each
  device updates its slice; stage 2 keeps the microbatch sum split too.

The last two, and a reduction once per step rather than once per microbatch, need each device's
gradient before the reduction. We get it by running the model under `jax.vmap` over the batch's
shards along the mesh's pure data axes (`spmd_axis_name`): every device computes its own shard's
gradient, kept apart on a leading dimension split over those axes, and one sum over that dimension
is the reduction, placed where we want it and in the dtype we want. That is exact only for models
whose examples do not meet inside the forward pass; batch statistics (BatchNorm), random streams
(dropout) and auxiliary losses over the batch (a router's balance) would be computed per shard, so
those models keep the global gradient (`separable`), as does a model whose class says
`examples_interact = True` (a loss or layer over the whole batch that holds no such state). Where the
per-device path was wanted, the run's log and the plan say that it was not taken, and why.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from shard.nn import partition, recorded


@dataclass(frozen=True)
class Reduction:
    accum: int = 1                  # microbatches per step (train.grad_accum)
    accum_dtype: Any = jnp.float32  # what the microbatches' gradients are summed in
    wire_dtype: Any = jnp.float32   # what the data axes' reduction runs in (train.grad_dtype)
    local_axes: tuple = ()          # the data axes each device keeps its own gradient over; () = XLA's reduction
    update_shardings: Any = None    # ZeRO: the layout gradients are reduced into (the optimizer moments')
    param_shardings: Any = None     # the parameters' layout (each gradient's, past its per-shard dimension)
    split_sum: bool = False         # ZeRO-2: each microbatch reduced into a split sum (1/N of the bytes)
    fallback: str = ""              # why the per-device path was wanted but not taken, and what that costs


def interaction(model_cls, abstract_rest) -> str:
    """What makes the model's examples meet in its forward pass ("" if nothing): its own word
    (`examples_interact = True` on the class), or the state it carries: batch statistics, random streams
    or auxiliary losses (these are computed over the whole batch)."""
    if getattr(model_cls, "examples_interact", False):
        return "its class declares examples_interact = True"
    mixing = {nnx.BatchStat: "batch statistics", nnx.RngState: "random streams (dropout)",
              recorded.AuxLoss: "an auxiliary loss over the batch"}
    leaves = jax.tree.leaves(abstract_rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
    found = [name for kind, name in mixing.items() if any(isinstance(v, kind) for v in leaves)]
    return f"it carries {' and '.join(found)}" if found else ""


def local_axes(rules: dict, mesh_shape: dict, param_axes: set) -> tuple:
    """The batch axes (the batch rule's, in its order) that split no parameter: over these a device's gradient
    is its own until it is summed. A pipeline's `stage` splits the batch and the stacked layers, so it is not
    one: the data shards' gradients are each summed over their stages inside the step."""
    return tuple(a for a in partition.batch_axes(rules, mesh_shape) if a not in param_axes)


def build(gradient: Callable, red: Reduction) -> Callable:
    """`gradient(params, rest, batch) -> ((total, (rest, loss, stats)), grads)` (jax.value_and_grad of
    the objective) turned into the same for the whole batch, with `red`'s accumulation and reduction."""
    shard_grad = per_shard(gradient, red.local_axes) if red.local_axes else gradient

    def reduce(grads):  # the cross-device sum, where it was left to us; into ZeRO's layout if any
        if red.local_axes:
            grads = mean_over_shards(grads, red)
        return constrain(grads, red.update_shardings)

    if red.accum == 1:
        def whole(params, rest, batch):
            out, grads = shard_grad(params, rest, batch)
            return combine(out, red.local_axes), cast_like(reduce(grads), params)
        return whole

    reduce_each = red.split_sum or not red.local_axes  # XLA reduces each microbatch's gradient anyway

    def accumulated(params, rest, batch):
        """K microbatches (example m, m+K, ...: each keeps the batch's split over the devices). Losses and
        gradients are summed per shard, and combined over the shards once, after the last microbatch."""
        micro = jax.tree.map(lambda a: partition.microbatches(a, red.accum), batch)
        first = jax.tree.map(lambda a: a[0], micro)
        out0, grads0 = jax.eval_shape(shard_grad, params, rest, first)
        grads0 = jax.eval_shape(reduce, grads0) if reduce_each else grads0
        zeros = (jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), (out0[0], out0[1][1:])),
                 jax.tree.map(lambda a: jnp.zeros(a.shape, red.accum_dtype), grads0))

        def one(carry, mb):
            old, (sums, acc) = carry
            (total, (new_rest, loss, stats)), grads = shard_grad(params, old, mb)
            new_rest = jax.tree.map(lambda n, o: n.astype(o.dtype), combine(new_rest, red.local_axes), old)
            sums = jax.tree.map(lambda s, x: s + x.astype(jnp.float32), sums, (total, (loss, stats)))
            grads = reduce(grads) if reduce_each else grads
            acc = jax.tree.map(lambda a, g: a + g.astype(red.accum_dtype), acc, grads)
            return (new_rest, (sums, constrain(acc, red.update_shardings) if reduce_each else acc)), None

        (rest, (sums, acc)), _ = jax.lax.scan(one, (rest, zeros), micro)
        total, (loss, stats) = jax.tree.map(lambda x: x / red.accum, combine(sums, red.local_axes))
        grads = acc if reduce_each else reduce(acc)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / red.accum, grads)
        return (total, (rest, loss, stats)), cast_like(grads, params)

    return accumulated


def per_shard(gradient: Callable, axes: tuple) -> Callable:
    """`gradient` run by each shard of the batch along `axes` on its own examples: its outputs gain a leading
    dimension (one entry per shard, split over `axes`), the gradients unreduced."""

    def run(params, rest, batch):
        mesh, rules = partition.active()
        present = partition.batch_axes(rules, mesh.shape)
        split = jax.tree.map(lambda a: shards_first(a, present, axes, mesh.shape), batch)
        with partition.activate(mesh, partition.without_batch_axes(rules, axes)):
            return jax.vmap(gradient, in_axes=(None, None, 0), spmd_axis_name=axes)(params, rest, split)

    return run


def shards_first(a: jax.Array, present: tuple, axes: tuple, mesh_shape) -> jax.Array:
    """(B, ...) split over the batch axes `present` -> (shards along `axes`, the rest, ...): each device's rows
    stay on it, the other batch axes (a pipeline's `stage` before `data`) keeping their order in the rest."""
    assert set(axes) <= set(present), (axes, present)  # the reduction chose them from these rules' batch axes
    sizes = [mesh_shape[x] for x in present]
    blocks = a.reshape(*sizes, a.shape[0] // math.prod(sizes), *a.shape[1:])
    mine = [i for i, x in enumerate(present) if x in axes]
    others = [i for i, x in enumerate(present) if x not in axes]
    moved = blocks.transpose(*mine, *others, *range(len(present), blocks.ndim))
    n = math.prod(sizes[i] for i in mine)
    return moved.reshape(n, a.shape[0] // n, *a.shape[1:])


def combine(out, axes: tuple):
    """Per-shard (total, (rest, loss, stats)) to the batch's: the mean over shards (equal-sized shards of a
    per-example mean); integer state (counters) from the first shard."""
    if not axes:
        return out
    return jax.tree.map(lambda x: jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.floating) else x[0], out)


def mean_over_shards(grads, red: Reduction):
    """Per-shard gradients (a leading dimension split over `red.local_axes`) to their mean, summed across the
    devices in `red.wire_dtype`. Under ZeRO the sum over `data` is a reduce-scatter into the optimizer state's
    layout (each device receives only the slice it updates), written out with shard_map: XLA's CPU backend
    would otherwise all-reduce and then slice. The shard_map is manual over every mesh axis, each gradient
    entering in its parameter's layout: a partly manual one crashes XLA's CPU compiler on a bfloat16 sum
    (jaxlib 0.10.2: its all-reduce promotion meets the manual-sharding copy JAX puts in the reducer)."""
    mesh, _ = partition.active()
    axes, n = red.local_axes, math.prod(mesh.shape[a] for a in red.local_axes)
    leaves, tree = jax.tree.flatten(grads)
    layouts = [padded(s.spec, x.ndim - 1) for s, x in zip(jax.tree.leaves(red.param_shardings), leaves)]
    targets = jax.tree.leaves(red.update_shardings) if red.update_shardings is not None else [None] * len(leaves)
    dims = [scatter_dim(t) if t is not None and "data" in axes else None for t in targets]

    def body(*local):
        out = []
        for x, dim in zip(local, dims):
            x = (x[0] / n).astype(red.wire_dtype)
            summed = tuple(a for a in axes if dim is None or a != "data")
            x = jax.lax.psum(x, summed) if summed else x
            x = jax.lax.psum_scatter(x, "data", scatter_dimension=dim, tiled=True) if dim is not None else x
            out.append(x.astype(jnp.float32))
        return out

    in_specs = tuple(PartitionSpec(axes, *layout) for layout in layouts)
    out_specs = [PartitionSpec(*layout) if dim is None else
                 PartitionSpec(*layout[:dim], (*partition.axes_of(layout[dim]), "data"), *layout[dim + 1:])
                 for layout, dim in zip(layouts, dims)]
    reduced = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*leaves)
    return jax.tree.unflatten(tree, reduced)


def padded(spec: PartitionSpec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def scatter_dim(sharding) -> int | None:
    """The dimension ZeRO splits over `data` in a gradient's target layout, if any."""
    for dim, entry in enumerate(sharding.spec):
        if "data" in partition.axes_of(entry):
            return dim
    return None


def constrain(tree, shardings):
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def cast_like(grads, params):
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
