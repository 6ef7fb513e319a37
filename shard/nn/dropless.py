"""Dropless mixture-of-experts routing: every (token, choice) pair computed by its expert, each device
sorting its own tokens, the experts' tokens sent to the experts' devices by all-to-all.

A token's routing needs no other token's, so the pairs need not be sorted over the whole batch: under a
mesh, a shard_map manual over the axes that split the tokens (the `batch` rule's and `length`'s) has each
device sort its own block by expert, so the sort's temporaries scale with the local batch.

The experts' weights enter as the mesh lays them out, less the manual axes: an axis that splits their
`embed` (fsdp) is gathered, as ZeRO-3 gathers any weight before use; an axis that splits the experts
themselves and the tokens too (`expert`) keeps each device's own experts. There the pairs move, not the work
(expert parallelism as GShard and DeepSeek do it): each device sorts its pairs by expert, which sorts them by
the device holding the expert, and sends each device of its expert group a bucket of the pairs for it
(all-to-all); each device runs the rows it received through its own experts, one grouped product per weight
matrix (shard/nn/grouped.py), and sends the results back the same way. A bucket holds `slack` times a fair
share (the pairs / the group's devices: capacity routing's budget, so one round sends what capacity routing
sends); where some device's pairs for one device overflow it, the exchange repeats (rounds: a loop as long as
the fullest bucket needs, agreed over the mesh), so no pair is dropped. The backward pass does the same with
the pairs' inputs and gradients, each round's first products (up, gate) as the forward pass kept them, in a buffer
for every round the data could ask for (shard/nn/grouped.py's kernels give the weights' gradient grouped); where the
layer is recomputed for its backward pass (train.remat), that pass instead runs each round's experts forward and
backward at once, the pairs' weights applied inside the exchange, and the recomputation runs no round. Axes
the tokens are not split on (`tensor`) stay the partitioner's.

Where the platform has a ragged all-to-all (XLA on TPU and GPU; `train.expert_exchange=auto` takes it on an
NVIDIA GPU, see `resolve`), a bucket's empty slots need not travel: each device's counts for the others are
exchanged once (a tiny all-to-all), and each round sends each bucket's pairs only (jax.lax.ragged_all_to_all), into
the same slots on the receiver as the padded exchange, so everything past the transport is the same. Balanced
routing then sends 1/slack of the padded bytes, and a round past the first only the pairs that overflowed.

`local` is the whole computation on one device: what a model gets outside the framework and, where no axis
splits the experts, each device's part.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shard.errors import UserError
from shard.nn import attention, grouped, partition


def local(mlp, x, top_e, top_p, weights, weigh_inputs: bool = False):
    """x (..., d) tokens; top_e, top_p (..., k) each token's chosen experts and weights; weights: arrays whose first
    axis is the experts. mlp(xs, sizes, weights) -> ys runs each expert on its run of the rows of xs (sorted by
    expert, sizes[i] rows for expert i; rows past the runs its product writes as zeros). Returns each token's
    weighted sum over its choices, (..., d); weigh_inputs: each choice's input is the token times its weight and
    the outputs are summed unweighted (Llama 4)."""
    n, k, d = weights[0].shape[0], top_e.shape[-1], x.shape[-1]
    e = top_e.reshape(-1)                                      # (tokens k): token-major
    order = jnp.argsort(e, stable=True)                        # in token order within an expert
    sizes = jnp.bincount(e, length=n).astype(jnp.int32)
    xs = _inputs(x.reshape(-1, d), top_p.reshape(-1), order, k, weigh_inputs)
    ys = mlp(xs, sizes, weights)[jnp.argsort(order)].reshape(*x.shape[:-1], k, d)
    return _combine(ys, top_p, weigh_inputs, x.dtype)


def split(mlp, x, top_e, top_p, weights, mesh, rules, slack: float = 1.25, weigh_inputs: bool = False,
          kernel: str = "xla", remat: bool = False, exchange: str = "padded"):
    """`local` on each device's own tokens of (batch, length, d) x under the mesh and logical rules (see the
    module's docstring); the plain `local` where no axis splits the tokens this batch divides by. slack: a
    bucket's pairs over a fair share, under expert parallelism; kernel: the grouped products' (shard/nn/grouped.py),
    whose tokamax takes the shard_map manual over every mesh axis. remat: the caller's layer is recomputed for its
    backward pass (train.remat), whose exchange then runs each round's experts forward and backward at once
    (_weighed_exchange) instead of after the forward pass's rounds again. exchange: how the pairs travel, padded
    (every bucket whole: all-to-all) or ragged (only its pairs, the counts exchanged first:
    jax.lax.ragged_all_to_all, which XLA has on TPU and GPU, not CPU)."""
    sizes = dict(mesh.shape)
    batch, length = partition.logical_to_spec(("batch", "length"), rules, sizes)
    batch, length = (_dividing(partition.axes_of(a), n, sizes) for a, n in ((batch, x.shape[0]), (length, x.shape[1])))
    manual = tuple(dict.fromkeys((*batch, *length)))
    if not manual:
        return local(mlp, x, top_e, top_p, weights, weigh_inputs)
    n = weights[0].shape[0]
    owners = tuple(a for a in partition.axes_of(partition.logical_to_spec(("experts",), rules, sizes)[0])
                   if a in batch)
    owners = _dividing(owners, n, sizes)  # the token axes that also split the experts
    group = math.prod(sizes[a] for a in owners)
    tokens = PartitionSpec(batch or None, length or None, None)
    held = PartitionSpec(owners or None)

    def body(x, top_e, top_p, *weights):
        if not owners:
            return local(mlp, x, top_e, top_p, weights, weigh_inputs)
        k, d = top_e.shape[-1], x.shape[-1]
        e = top_e.reshape(-1)
        order = jnp.argsort(e, stable=True)  # by expert, so by the expert's device
        route = Route(e[order], n // group, group, owners, manual, slack, ragged=exchange == "ragged")
        if remat and not weigh_inputs:  # the pairs' inputs taken from the tokens round by round
            return _weighed_exchange(mlp, k, route, x.reshape(-1, d), order // k, top_p.reshape(-1, k), order,
                                     tuple(weights)).reshape(x.shape)
        xs = _inputs(x.reshape(-1, d), top_p.reshape(-1), order, k, weigh_inputs)
        if remat:
            return _weighed_exchange(mlp, k, route, xs, jnp.arange(xs.shape[0]), None, order,
                                     tuple(weights)).reshape(x.shape)
        ys = _exchange(mlp, route, xs, tuple(weights))[jnp.argsort(order)].reshape(*x.shape[:-1], k, d)
        return _combine(ys, top_p, weigh_inputs, x.dtype)

    # Inside a vmap over mesh axes (spmd_axis_name: local SGD's and DiLoCo's replicas, shard/strategies/sync.py),
    # JAX batches this shard_map by adding those axes to its specs, so they must be manual here too; no collective
    # names them, so each replica routes its own tokens. JAX 0.10 cannot yet batch the body's loops (the rounds,
    # the tiled kernel's scan) with their manual axes' types tracked (its while-loop and broadcasting batching rules
    # drop the vmapped axes from the types), so there the body runs untyped (check_vma=False): the weights'
    # gradients are then summed over the manual axes their spec does not name by shard_map's own transpose, where
    # grouped.reduced_like does it when typed (it finds nothing to sum untyped).
    #
    # tokamax's grouped products (shard/nn/grouped.py; Pallas kernels on a TPU) cannot be split by the partitioner
    # over the axes left to it, and tokamax 0.0.12 states no manual-axis types for its outputs (its group metadata
    # fails their checks too): with them, the shard_map is manual over every mesh axis and untyped. The axes that
    # split neither the tokens nor the experts then hold their inputs whole, each of their devices computing the same
    # rows (under `mesh=ep` all of size 1), and shard_map's transpose sums the weights' gradients as above.
    vmapped = {a for a in partition.vmapped_axes() if a in sizes}
    whole = grouped.whole_mesh(kernel, mesh.devices.flat[0])
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, *[held] * len(weights)),
                         out_specs=tokens, axis_names=set(mesh.axis_names) if whole else set(manual) | vmapped,
                         check_vma=not (vmapped or whole))(x, top_e, top_p, *weights)


def resolve(exchange: str, device) -> str:
    """`auto` for a device: ragged on an NVIDIA GPU (the one GPU XLA's ragged all-to-all was compiled for here), else
    padded. XLA:CPU has no ragged all-to-all; on a TPU it has one, but its rows must lie whole in memory, and the TPU
    compiler lays the exchange's (rows, d) buffers out 8 rows to a tile: relaid before and after each ragged
    exchange, which its estimate puts above what the padded exchange costs (Qwen3-30B-A3B on v5p-32: 1267 against
    1187 ms a step, bench/RESULTS.md; the bytes saved are the data's, which no compile-time estimate sees)."""
    if exchange != "auto":
        return exchange
    return "ragged" if attention.family(device) == "nvidia" else "padded"


def check(exchange: str, device) -> None:
    """Fail early, in one line, where an explicit ragged exchange cannot compile on this device."""
    if exchange == "ragged" and attention.family(device) == "cpu":
        raise UserError(f"train.expert_exchange=ragged needs a TPU or GPU (XLA:{device.platform.upper()} has no "
                        "ragged all-to-all); use train.expert_exchange=auto or padded")


def _inputs(x, p, order, k: int, weigh: bool):
    """Each pair's input, in expert order: its token (times its weight where the inputs are weighed)."""
    xs = x[order // k]
    return (xs * p[order][:, None].astype(xs.dtype)) if weigh else xs


def _combine(ys, top_p, weigh_inputs: bool, dtype):
    if weigh_inputs:
        return jnp.sum(ys.astype(jnp.float32), axis=-2).astype(dtype)
    return jnp.einsum("...kd,...k->...d", ys.astype(jnp.float32), top_p).astype(dtype)


@jax.tree_util.register_pytree_node_class
class Route:
    """Where a device's pairs go under expert parallelism: `experts` (pairs,) their experts, sorted; each
    expert's device, the buckets' size and the rounds the fullest bucket needs (the same on every device). A
    pytree: its arrays are arguments of the exchange, not values it closes over."""

    def __init__(self, experts, per_device: int, group: int, owners: tuple, manual: tuple, slack: float,
                 ragged: bool = False):
        self.experts, self.per_device, self.group, self.owners = experts, per_device, group, owners
        self.bucket, self.ragged = max(1, math.ceil(slack * experts.shape[0] / group)), ragged
        self.counts = jnp.bincount(experts // per_device, length=group).astype(jnp.int32)  # for each device
        self.starts = jnp.cumsum(self.counts) - self.counts
        self.rounds = jax.lax.pmax(jnp.max(-(-self.counts // self.bucket)), manual)
        # the pairs each device of the group has for this one: what a ragged exchange receives (counts first)
        self.incoming = jax.lax.all_to_all(self.counts, owners, 0, 0, tiled=True) if ragged else self.counts

    def tree_flatten(self):
        return (self.experts, self.counts, self.starts, self.rounds, self.incoming), (
            self.per_device, self.group, self.owners, self.bucket, self.ragged)

    @classmethod
    def tree_unflatten(cls, static, arrays):
        route = object.__new__(cls)
        route.experts, route.counts, route.starts, route.rounds, route.incoming = arrays
        route.per_device, route.group, route.owners, route.bucket, route.ragged = static
        return route

    def slots(self, r):
        """Round r's buckets: for each device of the group, `bucket` indices into the sorted pairs (pairs: none)."""
        slot = r * self.bucket + jnp.arange(self.bucket)
        index = self.starts[:, None] + slot[None, :]
        return jnp.where(slot[None, :] < self.counts[:, None], index, self.experts.shape[0])  # (group, bucket)

    def send(self, a, r, back: bool = False):
        """Round r's (group, bucket, ...) buckets of each device to the group's devices: what each sent this one, in
        the same layout (back: the rows computed for them, returned). Padded, every slot travels (all-to-all);
        ragged, only each bucket's pairs (its first slots), the empty slots received unwritten."""
        if not self.ragged:
            return jax.lax.all_to_all(a, self.owners, 0, 0, tiled=True)
        first = r * self.bucket
        sent, got = (jnp.clip(c - first, 0, self.bucket) for c in (self.counts, self.incoming))
        sent, got = (got, sent) if back else (sent, got)
        # bucket j's slots, on either side; this device's on each receiver. Made of the sizes: under a vmap over
        # replicas (DiLoCo), JAX 0.10's batching rule of ragged_all_to_all takes only batched offsets and sizes (an
        # unbatched one fails its `assert x.ndim == 2`).
        at = sent * 0 + jnp.arange(self.group, dtype=jnp.int32) * self.bucket
        there = sent * 0 + jax.lax.axis_index(self.owners) * self.bucket
        # The receiving buffer is left unwritten (as MaxText's): its empty slots sort past every expert's run, which
        # the grouped products neither read nor write (tests/test_moe_dropless.py: NaN there changes nothing).
        flat = a.reshape(-1, *a.shape[2:])
        buffer = jax.lax.empty(flat.shape, flat.dtype)
        if extra := tuple(sorted(grouped._varying(flat) - grouped._varying(buffer))):
            buffer = jax.lax.pcast(buffer, extra, to="varying")  # the result is typed as the buffer: as the rows
        out = jax.lax.ragged_all_to_all(flat, buffer, at, sent, there, got, axis_name=self.owners)
        return out.reshape(a.shape)

    def gather(self, a, index, r):
        """The rows of a for buckets `index` (zeros for empty slots), sent: (group x bucket, ...) received, each
        bucket's empty slots zeros (padded) or unwritten (ragged)."""
        rows = jnp.take(a, index.reshape(-1), axis=0, mode="fill", fill_value=0)
        return self.send(rows.reshape(*index.shape, *a.shape[1:]), r).reshape(-1, *a.shape[1:])

    def scatter(self, a, index, r, rows):
        """a with the rows computed for buckets `index` (received order) sent back and set at their pairs."""
        return a.at[index.reshape(-1)].set(self.back(index, r, rows).astype(a.dtype), mode="drop")

    def back(self, index, r, rows):
        """The rows computed for buckets `index` (received order) sent back: (group x bucket, ...) in slot order."""
        return self.send(rows.reshape(*index.shape, *rows.shape[1:]), r, back=True).reshape(-1, *rows.shape[1:])

    def received(self, index):
        """The order by expert of the rows received for buckets `index`, and this device's experts' row counts."""
        pairs = self.experts.shape[0]
        mine = jnp.take(self.experts, index, mode="fill", fill_value=0) % self.per_device
        # empty slots: past every expert's. The experts' numbers travel whole, ragged or not: a few bytes a pair, where
        # the TPU's ragged all-to-all lays an int32 row out 128 wide.
        mine = jax.lax.all_to_all(jnp.where(index < pairs, mine, self.per_device), self.owners, 0, 0, tiled=True)
        order = jnp.argsort(mine.reshape(-1), stable=True)
        return order, jnp.bincount(mine.reshape(-1), length=self.per_device + 1)[:-1].astype(jnp.int32)


def _through_experts(mlp, route: Route, index, rows, weights, replay=None):
    """Rows received for buckets `index` through this device's experts, in the received order; and the outputs of
    the products of the rows themselves (the experts' first: grouped.Tape), or, given `replay`, those taken from it."""
    order, sizes = route.received(index)
    mine = rows[order]
    with grouped.taped(mine, replay) as tape:
        out = mlp(mine, sizes, weights)
    return out[jnp.argsort(order)], tuple(tape.outputs)


# The most rounds whose first products the forward pass keeps (a buffer of them all, zeroed, written round by round).
# The tiny MoE under ep on 4 devices (4 rounds) then executes 1.26x its share of matrix products, 1.39x computing
# them again; Qwen3-30B-A3B under ep on 16 v5p chips (13 rounds) by the TPU cost model: 1402 ms a step kept, 1285 ms
# computed again (bench/RESULTS.md): the buffer's bytes cost more than the products they save.
KEEP_ROUNDS = 4


def _rounds(mlp, route: Route, xs, weights, of=None):
    """Each sorted pair's expert output, (pairs, d): the pairs sent to their experts' devices in rounds. of: each
    sorted pair's row of xs (None: the pairs' own rows)."""
    def one_round(r, ys):
        index = route.slots(r)
        rows = route.gather(xs, index if of is None else jnp.take(of, index, mode="fill", fill_value=xs.shape[0]), r)
        return route.scatter(ys, index, r, _through_experts(mlp, route, index, rows, weights)[0])

    zeros = jnp.zeros_like(xs) if of is None else grouped._zeros((of.shape[0], xs.shape[1]), xs, of).astype(xs.dtype)
    return jax.lax.fori_loop(0, route.rounds, one_round, zeros)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _exchange(mlp, route: Route, xs, weights):
    """_rounds, its backward pass after the forward pass's rounds (below)."""
    return _rounds(mlp, route, xs, weights)


def _exchange_fwd(mlp, route, xs, weights):
    """The rounds, each one's first products' outputs kept for the backward pass, which then computes no product
    of the forward's again: a buffer of every round the data could ask for (all of a device's pairs to one device:
    pairs / bucket, about the group's size / slack), as static shapes need, where that is at most KEEP_ROUNDS;
    past that, the backward pass computes them again."""
    rows = route.group * route.bucket
    sizes = jax.ShapeDtypeStruct((route.per_device,), jnp.int32)
    most = -(-route.experts.shape[0] // route.bucket)
    shapes = () if most > KEEP_ROUNDS else jax.eval_shape(
        lambda a, s, w: _first_products(mlp, a, s, w), jax.ShapeDtypeStruct((rows, xs.shape[1]), xs.dtype), sizes,
        weights)

    def one_round(r, carry):
        ys, kept = carry
        index = route.slots(r)
        out, firsts = _through_experts(mlp, route, index, route.gather(xs, index, r), weights)
        kept = tuple(jax.lax.dynamic_update_index_in_dim(k, f.astype(k.dtype), r, 0) for k, f in zip(kept, firsts))
        return route.scatter(ys, index, r, out), kept

    like = (xs, *jax.tree.leaves(weights))
    kept = tuple(grouped._zeros((most, *s.shape), *like).astype(s.dtype) for s in shapes)
    ys, kept = jax.lax.fori_loop(0, route.rounds, one_round, (jnp.zeros_like(xs), kept))
    return ys, (route, xs, weights, kept)


def _first_products(mlp, rows, sizes, weights):
    with grouped.taped(rows) as tape:
        mlp(rows, sizes, weights)
    return tuple(tape.outputs)


def _exchange_bwd(mlp, saved, dys):
    """The rounds again with the pairs' inputs and their outputs' gradients, each round's first products' outputs
    those the forward pass kept."""
    route, xs, weights, kept = saved

    def one_round(r, grads):
        dxs, dws = grads
        index = route.slots(r)
        douts = route.gather(dys, index, r)
        firsts = tuple(jax.lax.dynamic_index_in_dim(k, r, 0, keepdims=False) for k in kept)
        _, vjp = jax.vjp(lambda a, w: _through_experts(mlp, route, index, a, w, firsts)[0],
                         route.gather(xs, index, r), weights)
        drows, dw = vjp(douts)
        return route.scatter(dxs, index, r, drows), jax.tree.map(jnp.add, dws, dw)

    zeros = (jnp.zeros_like(xs), jax.tree.map(jnp.zeros_like, weights))
    dxs, dws = jax.lax.fori_loop(0, route.rounds, one_round, zeros)
    return None, grouped.reduced_like(dxs, xs), jax.tree.map(grouped.reduced_like, dws, weights)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


# Under activation checkpointing (train.remat) a layer's backward pass computes its forward pass again first, so
# the exchange above ran its rounds three times: the forward pass, its recomputation (the outputs, for their
# weights' gradients), and the backward pass, which computed each round's first products once more (its buffer of
# kept rounds is sized for the most the data could ask for: 13 rounds of Qwen3-30B-A3B's on 16 chips, more memory
# than it saves). Here the pairs' weights and their sum over a token's choices are inside, so that the layer's
# recomputation needs nothing of the exchange but its inputs (XLA drops its rounds there), and the backward pass
# runs each round's experts forward and backward at once, the first products' outputs kept within the round: the
# grouped products of the forward pass twice and of the backward once, as MaxText's single padded exchange under
# full remat, with no buffer past a round's. Each round takes its pairs' inputs and output gradients from the
# tokens' rows and sums their inputs' gradients into them (no array of every pair's), and sends the pairs' inputs
# once for both passes; where the outputs are weighed, they come back for the weights' gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _weighed_exchange(mlp, k: int, route: Route, xs, of, p, order, weights):
    """Each token's sum of its k choices' expert outputs times their weights p (tokens, k) (None: the outputs as
    they are), as _combine sums them: (tokens, d). The sorted pairs' inputs are rows `of` of xs (the tokens, or the
    pairs' own inputs); order: the sorted pairs' places among the token-major pairs (token x k + choice)."""
    ys = _rounds(mlp, route, xs, weights, of)[jnp.argsort(order)].reshape(-1, k, xs.shape[1])
    return _combine(ys, p, p is None, xs.dtype)


def _weighed_fwd(mlp, k, route, xs, of, p, order, weights):
    return _weighed_exchange(mlp, k, route, xs, of, p, order, weights), (route, xs, of, p, order, weights)


def _weighed_bwd(mlp, k, saved, dout):
    """The rounds once, each round's pairs (their inputs and their outputs' gradients) through the experts forward
    and backward, their inputs' gradients summed into xs's rows; where the pairs are weighed, their outputs come
    back too, for their weights' gradient (the output's gradient dot the output)."""
    route, xs, of, p, order, weights = saved
    flat = None if p is None else p.reshape(-1)

    def one_round(r, carry):
        dxs, dp, dws = carry
        index = route.slots(r)
        places = jnp.take(order, index, mode="fill", fill_value=order.shape[0])  # the buckets' pairs, token-major
        dz = jnp.take(dout, places // k, axis=0, mode="fill", fill_value=0)  # their tokens' output gradients
        dys = dz if p is None else (dz.astype(jnp.float32) * jnp.take(flat, places, mode="fill", fill_value=0)[
            ..., None]).astype(xs.dtype)
        rows = jnp.take(of, index, mode="fill", fill_value=xs.shape[0])
        out, vjp = jax.vjp(lambda a, w: _through_experts(mlp, route, index, a, w)[0], route.gather(xs, rows, r),
                           weights)
        drows, dw = vjp(route.send(dys, r).reshape(-1, dys.shape[-1]))
        if p is not None:
            back = route.back(index, r, out).astype(jnp.float32)
            dots = jnp.sum(dz.reshape(back.shape).astype(jnp.float32) * back, axis=-1)
            dp = dp.at[places.reshape(-1)].set(dots.astype(dp.dtype), mode="drop")
        dxs = dxs.at[rows.reshape(-1)].add(route.back(index, r, drows).astype(dxs.dtype), mode="drop")
        return dxs, dp, jax.tree.map(jnp.add, dws, dw)

    zeros = (jnp.zeros_like(xs), None if p is None else jnp.zeros_like(flat), jax.tree.map(jnp.zeros_like, weights))
    dxs, dp, dws = jax.lax.fori_loop(0, route.rounds, one_round, zeros)
    dp = None if p is None else grouped.reduced_like(dp.reshape(p.shape), p)
    return None, grouped.reduced_like(dxs, xs), None, dp, None, jax.tree.map(grouped.reduced_like, dws, weights)


_weighed_exchange.defvjp(_weighed_fwd, _weighed_bwd)


def _dividing(axes: tuple, n: int, sizes: dict) -> tuple:
    """The leading axes of `axes` whose sizes together divide n."""
    kept = ()
    for a in axes:
        if n % math.prod(sizes[b] for b in (*kept, a)):
            break
        kept = (*kept, a)
    return kept
