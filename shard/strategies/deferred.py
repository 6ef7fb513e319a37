"""A stacked layer's weight built inside the stack, one layer at a time (LoRA on a base stored bfloat16 or quantized).

Dequantizing a quantized base and adding the adapters to it before the model would hold the whole stack's weights in
float32 at once, more than the stored base saves (the compiler's peak for the 8B shape grew, bench/RESULTS.md).
Instead each stacked weight the model sees is a `Built`: its stored value (codes or bfloat16), the scales and the
adapters of every layer, a pytree whose arrays all keep the `layers` axis first (shard/nn/deferred.py's `Deferred`).
The stack (shard/nn/hooks.py's `scan`, `unrolled`, a pipeline's stage, and generation's `scan_decoding` and
`stack_caches`) slices it with the layers and calls `build()` for the one layer it runs, under a checkpoint that
saves nothing, so the backward pass rebuilds the layer's weight from its codes instead of keeping every layer's;
only the layer in hand exists as floats. The arithmetic is the whole-stack merge's (shard/strategies/adapters.py's
`adapted`, shard/quant/base.py's `dequantize_value`), a layer at a time. A quantized base's parts are laid out for
the layer's products before it (`as_used`), so that fsdp gathers the codes rather than the floats they stand for.
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shard.nn import partition
from shard.nn.deferred import Deferred
from shard.quant import base as quant
from shard.strategies import adapters


@jax.tree_util.register_pytree_node_class
class Built(Deferred):
    """One stacked weight of the model: stored value (+ scale) and adapter pairs, built per layer by `build()`.
    `names`: the logical names of one layer's stored value, scale and adapter pairs ((A's, B's) each), which say
    how the layer's products use them (`as_used`)."""

    def __init__(self, stored, scale, pairs: tuple, kind: str, sites: tuple, factor: float, names: tuple,
                 dtype=None):
        # sites: the adapted parts of the weight (adapters.Site, of the stacked weight)
        self.stored, self.scale, self.pairs = stored, scale, pairs
        self.kind, self.sites, self.factor, self.names, self.dtype = kind, sites, factor, names, dtype

    def tree_flatten(self):
        return (self.stored, self.scale, self.pairs), (self.kind, self.sites, self.factor, self.names, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def compute_in(self, dtype) -> "Built":
        """The same weight, built in the compute dtype (shard/core/precision.py's cast, done after the build)."""
        return Built(self.stored, self.scale, self.pairs, self.kind, self.sites, self.factor, self.names, dtype)

    def build(self):
        """The weight of the layer in hand (every array sliced to one layer): dequantized, adapters added, cast.

        A quantized base's codes, scales and adapters are first laid out as the layer's products use the weight
        (`as_used`): left to itself, the compiler dequantizes each device's piece of an fsdp-split weight and
        gathers the float result. Gathering the parts instead moves the codes (h100x8, the 8B shape, nf4: 9.8 GB
        of all-gathers a device a step against 28.8, plus 5.9 GB of all-to-alls gone), at the cost of all-reducing
        each weight's gradient before it reaches the adapters (13.3 GB; 31.9 GB on the wire against 42.1 in all,
        bench/RESULTS.md). A bfloat16 base gains nothing by it (its gathers are the weights' own bytes either way)
        and would pay the all-reduces: it is left as it is. The layer's arrays get back a `layers` axis of one for
        the adapters' product, so that it is a batched matrix product: activation checkpointing's policies that
        keep matrix products (train.remat=dots) keep those without batch dimensions, and A @ B is a weight's
        size, per layer."""
        stored, scale, pairs = self.stored, self.scale, self.pairs
        if scale is not None:  # a quantized base; a float one is gathered as it is, the compiler's own choice
            stored_names, scale_names, pair_names = self.names
            stored, scale = as_used(stored, stored_names), as_used(scale, scale_names)
            pairs = tuple((as_used(a, an), as_used(b, bn)) for (a, b), (an, bn) in zip(pairs, pair_names))
        w = quant.dequantize_value(stored, scale, self.kind)
        w = adapters.adapted(w[None], tuple((a[None], b[None]) for a, b in pairs), self.sites, self.factor)[0]
        return w if self.dtype is None else w.astype(self.dtype)


def as_used(x, names):
    """x laid out as a layer's products use a weight: split over the mesh axes that split the model (tensor; expert,
    for the experts' axis), whole over those that split the batch (fsdp, data), as the compiler gathers a weight
    split over them before its product. Outside a step (no active mesh), and on TPU, x as it is: the TPU compiler
    fused the gathered codes' dequantization into a kernel larger than a core's vector memory (v5p-8, the 8B shape:
    76 of 64 MiB of VMEM), so there the gathers stay its own choice."""
    if (active := partition.active()) is None or names is None:
        return x
    mesh, rules = active
    if mesh.devices.flat[0].platform == "tpu":
        return x
    batch = set(partition.batch_axes(rules, mesh.shape))
    spec = partition.logical_to_spec(names, rules, mesh.shape)
    kept = [entry if name == "experts" else tuple(a for a in partition.axes_of(entry) if a not in batch) or None
            for name, entry in zip(names, spec)]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*kept)))


def stacked(names) -> bool:
    """Whether a weight's logical names say it is a stack's (its first axis `layers`)."""
    return bool(names) and names[0] == "layers"
