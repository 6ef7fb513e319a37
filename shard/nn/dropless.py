"""Dropless mixture-of-experts routing: every (token, choice) pair computed by its expert, each device
sorting its own tokens.

A token's routing needs no other token's, so the pairs need not be sorted over the whole batch: under a
mesh, a shard_map manual over the axes that split the tokens (the `batch` rule's and `length`'s) has each
device sort its own block by expert and run the grouped product on it, so the sort's temporaries scale with
the local batch. (Sorting the flattened global batch, the partitioner handed every device all of it.)

The experts' weights enter as the mesh lays them out, less the manual axes: an axis that splits their
`embed` (fsdp) is gathered, as ZeRO-3 gathers any weight before use; an axis that splits the experts
themselves and the tokens too (`expert`) keeps each device's own experts. There the tokens go to them, round
a ring: each device's block of tokens, with the sum of its experts' results so far, passes from device to
device of its `expert` group (collective permutes), each computing the pairs routed to its own experts (the
others sorted past the groups, where the grouped product writes zeros), until it is back home with every
expert's. A device holds one block at a time, of the local batch's size (gathering the group's tokens at once
would hold them all, the whole batch under mesh=ep); it sends each block once and its sum once per device of
the group, as an all-gather and a reduce-scatter would. Axes the tokens are not split on (`tensor`) stay the
partitioner's.

`local` is the whole computation on one device: what a model gets outside the framework and, in the
split version, each device's part.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shard.nn import partition


def local(mlp, x, top_e, top_p, weights, first: int | jax.Array = 0):
    """x (..., d) tokens; top_e, top_p (..., k) each token's chosen experts and weights; weights: arrays whose first
    axis is the experts (this device's n of them, numbered from `first`). mlp(xs, sizes, weights) -> ys runs each
    expert on its run of the rows of xs (sorted by expert, sizes[i] rows for expert i; rows past the runs its
    product writes as zeros). Returns each token's weighted sum over its choices among these experts, (..., d)."""
    n, k, d = weights[0].shape[0], top_e.shape[-1], x.shape[-1]
    e = top_e.reshape(-1) - first                              # (tokens k): token-major
    mine = (e >= 0) & (e < n)
    e = jnp.where(mine, e, n)                                  # another device's expert: after the groups
    order = jnp.argsort(e, stable=True)                        # in token order within an expert
    sizes = jnp.bincount(e, length=n + 1)[:n].astype(jnp.int32)
    xs = x.reshape(-1, d)[order // k]                          # each pair's token, in expert order
    ys = mlp(xs, sizes, weights)[jnp.argsort(order)].reshape(*x.shape[:-1], k, d)
    p = jnp.where(mine.reshape(top_p.shape), top_p, 0.0)
    return jnp.einsum("...kd,...k->...d", ys.astype(jnp.float32), p).astype(x.dtype)


def split(mlp, x, top_e, top_p, weights, mesh, rules):
    """`local` on each device's own tokens of (batch, length, d) x under the mesh and logical rules (see the
    module's docstring); the plain `local` where no axis splits the tokens this batch divides by."""
    sizes = dict(mesh.shape)
    batch, length = partition.logical_to_spec(("batch", "length"), rules, sizes)
    batch, length = (_dividing(partition.axes_of(a), n, sizes) for a, n in ((batch, x.shape[0]), (length, x.shape[1])))
    manual = set(batch) | set(length)
    if not manual:
        return local(mlp, x, top_e, top_p, weights)
    n = weights[0].shape[0]
    owners = tuple(a for a in partition.axes_of(partition.logical_to_spec(("experts",), rules, sizes)[0])
                   if a in batch)
    owners = _dividing(owners, n, sizes)  # the token axes that also split the experts
    group = math.prod(sizes[a] for a in owners)
    tokens = PartitionSpec(batch or None, length or None, None)
    held = PartitionSpec(owners or None)

    def body(x, top_e, top_p, *weights):
        if not owners:
            return local(mlp, x, top_e, top_p, weights)
        first = jax.lax.axis_index(owners) * (n // group)
        ring = [(i, (i + 1) % group) for i in range(group)]
        send = lambda *a: tuple(jax.lax.ppermute(b, owners, ring) for b in a)  # noqa: E731

        @jax.checkpoint  # keep a visit's tokens only: its pairs are recomputed in the backward pass
        def visit(carry, _):
            x, top_e, top_p, y = carry
            return send(x, top_e, top_p, y + local(mlp, x, top_e, top_p, weights, first)), None

        # each device's tokens visit the group's devices in turn, each adding its experts' results, then go home
        (x, top_e, top_p, y), _ = jax.lax.scan(visit, (x, top_e, top_p, jnp.zeros_like(x)), length=group - 1)
        return send(y + local(mlp, x, top_e, top_p, weights, first))[0]

    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, *[held] * len(weights)),
                         out_specs=tokens, axis_names=manual)(x, top_e, top_p, *weights)


def _dividing(axes: tuple, n: int, sizes: dict) -> tuple:
    """The leading axes of `axes` whose sizes together divide n."""
    kept = ()
    for a in axes:
        if n % math.prod(sizes[b] for b in (*kept, a)):
            break
        kept = (*kept, a)
    return kept
