"""The train state: its abstract shape, its shardings from the logical-axis rules, and sharded init.

The state is never materialised whole on one device: we trace the initialiser abstractly
(`jax.eval_shape`), derive every array's sharding from its logical names, and run the
initialiser under `jax.jit` with those output shardings, so each device only ever computes and
holds its own shards. Optimizer moments are Param-shaped trees carrying the same metadata as the
parameters, so they get the same sharding (FSDP shards Adam's moments too).
"""

import math
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard.errors import UserError
from shard.core.blame import blamed
from shard.nn.partition import MODEL_AXES, axes_of, batch_shards, logical_names, logical_to_spec, param_spec


@flax.struct.dataclass
class TrainState:
    step: jax.Array        # optimizer steps taken
    params: nnx.State      # trainable parameters (nnx.Param), float32
    rest: nnx.State        # every other model variable (e.g. normalisation statistics)
    opt_state: optax.OptState
    # low-communication training's state (shard/strategies/sync.py): the last sync's parameters and outer optimizer;
    # it predates `extra` and keeps its own field so that its checkpoints read as they always have
    outer: Any = None
    extra: Any = None      # other strategies' state beside the model, by strategy name (e.g. ema: averaged weights)


def build_model(model_cls: type, kwargs: dict, seed: int) -> nnx.Module:
    # Annotations are logical names, mapped by us through the rules; Flax's eager sharding would
    # read them as mesh axes.
    with nnx.use_eager_sharding(False):
        return model_cls(**kwargs, rngs=nnx.Rngs(seed))


def abstract_state(model_cls: type, kwargs: dict, tx: optax.GradientTransformation, seed: int,
                   model_name: str) -> tuple[nnx.GraphDef, TrainState, Callable[[], TrainState]]:
    """The model's graph, the state's shapes (no memory allocated) and the function that builds it."""

    def init() -> TrainState:
        _, params, rest = nnx.split(build_model(model_cls, kwargs, seed), nnx.Param, ...)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest, opt_state=tx.init(params))

    with blamed(f"model {model_name!r} could not be built with {kwargs}"):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(model_cls, kwargs, seed)))
        abstract = jax.eval_shape(init)
    return graphdef, abstract, init


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def path_name(path) -> str:
    """`params/blocks/0/attn/qkv` for a parameter; optimizer state keeps its own prefix."""
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    return name.removeprefix("params/")


def auto_min_size(mesh_cfg) -> int | None:
    """The automatic split's size threshold as the config sets it; None when `mesh.auto_shard=false`."""
    return mesh_cfg.auto_shard_min_size if mesh_cfg.auto_shard else None


def state_shardings(abstract, mesh: jax.sharding.Mesh, rules: dict, auto_min_size: int | None, zero: int = 0):
    """A NamedSharding for every array of `abstract`, checked for divisibility.

    Variables map their logical names through the rules, with the automatic split for what the
    names leave whole (`partition.param_spec`); optimizer moments carry their parameter's names and
    shape, so they land on the same devices, and under ZeRO (`zero` >= 1) are split over the data
    axis as well (`over_data`). Arrays outside Variables (step counters, Adam's count) are replicated.
    """

    def one(path, leaf):
        if not _is_variable(leaf):
            return NamedSharding(mesh, PartitionSpec())
        spec, _ = variable_spec(path, leaf, dict(mesh.shape), rules, auto_min_size)
        if zero and path[0].name == "opt_state":
            spec = over_data(spec, jax.tree.leaves(leaf)[0].shape, dict(mesh.shape))
        return leaf.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, abstract, is_leaf=_is_variable)


def update_shardings(abstract_params, mesh: jax.sharding.Mesh, rules: dict, auto_min_size: int | None):
    """Under ZeRO, the layout the gradients are reduced into and the update is computed in: the optimizer
    moments' (each device updates its slice of the parameters)."""
    def one(path, var):
        spec, _ = variable_spec(path, var, dict(mesh.shape), rules, auto_min_size)
        return var.replace(NamedSharding(mesh, over_data(spec, jax.tree.leaves(var)[0].shape, dict(mesh.shape))))

    return jax.tree_util.tree_map_with_path(one, abstract_params, is_leaf=_is_variable)


def over_data(spec: PartitionSpec, shape, mesh_shape: dict) -> PartitionSpec:
    """ZeRO's split of optimizer state: the data axis added on the largest dimension it divides, a free one
    first, else one already split whose other axes and data divide it together. Arrays it divides nowhere
    (small vectors) stay as they are."""
    n = mesh_shape["data"]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if n == 1 or not shape:
        return spec
    ways = lambda d: math.prod(mesh_shape[a] for a in axes_of(entries[d]))
    free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % n == 0]
    shared = [d for d in range(len(shape)) if entries[d] is not None and shape[d] % (ways(d) * n) == 0]
    for choice in (free, shared):
        if choice:
            dim = max(choice, key=lambda d: (shape[d], -d))
            # data after the axes already there: the order a reduce-scatter of the local shards gives
            entries[dim] = (*axes_of(entries[dim]), "data") if entries[dim] else "data"
            return PartitionSpec(*entries)
    return spec


def variable_spec(path, var, mesh_shape: dict, rules: dict, auto_min_size: int | None) -> tuple[PartitionSpec, str]:
    names, shape = logical_names(var), tuple(jax.tree.leaves(var)[0].shape)
    if names is not None:
        if len(names) != len(shape):
            raise UserError(f"parameter {path_name(path)} has shape {shape} but "
                            f"{len(names)} logical axis names {tuple(names)}")
        check_divisible(f"parameter {path_name(path)}", shape, names,
                        logical_to_spec(names, rules, mesh_shape), mesh_shape)
    return param_spec(shape, names, rules, mesh_shape, auto_min_size)


def split_report(abstract_params, mesh_shape: dict, rules: dict, auto_min_size: int | None) -> list[dict]:
    """Per parameter: its path, shape, bytes, PartitionSpec and how it was split (named, auto, replicated)."""
    rows = []
    for path, var in jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=_is_variable)[0]:
        if not _is_variable(var):
            continue
        value = jax.tree.leaves(var)[0]
        spec, kind = variable_spec(path, var, mesh_shape, rules, auto_min_size)
        rows.append({"param": path_name(path), "shape": tuple(value.shape), "kind": kind,
                     "named": logical_names(var) is not None,
                     "bytes": math.prod(value.shape) * value.dtype.itemsize, "spec": spec})
    return rows


def split_summary(rows: list[dict]) -> str:
    """One line: how many parameters (and what share of their bytes) each way of splitting covers."""
    total = sum(r["bytes"] for r in rows) or 1
    parts = []
    for kind, words in (("named", "split by logical names"), ("auto", "split automatically"),
                        ("replicated", "replicated")):
        chosen = [r for r in rows if r["kind"] == kind]
        share = sum(r["bytes"] for r in chosen) / total
        parts.append(f"{len(chosen)} {words} ({share:.0%} of bytes)")
    return "parameters: " + ", ".join(parts)


def idle_axes(rows: list[dict], mesh_shape: dict) -> list[str]:
    """Model axes larger than 1 that split no parameter: devices that only repeat work."""
    used = {a for r in rows for entry in r["spec"] for a in axes_of(entry)}
    return [a for a in MODEL_AXES if mesh_shape[a] > 1 and a not in used]


def idle_axis_warning(axes: list[str], rows: list[dict], mesh_shape: dict, auto: bool) -> str:
    largest = sorted((r for r in rows if r["kind"] == "replicated"), key=lambda r: -r["bytes"])[:3]
    shown = ", ".join(f"{r['param']} {r['shape']}" for r in largest) or "none"
    if not auto:
        fix = ", or set mesh.auto_shard=true to split them automatically"
    elif any(not r["named"] for r in largest):
        fix = ", or lower mesh.auto_shard_min_size (none is both that large and divisible by the axis)"
    else:  # named parameters: the automatic split adds only ZeRO-3's axes to them (partition.zero_axes)
        fix = " with names whose rules map to this axis, or leave the axis out of the mesh"
    return (f"mesh axis {', '.join(f'{a}={mesh_shape[a]}' for a in axes)} splits no parameter, so its devices "
            f"hold whole copies; largest unsplit: {shown}. Name their dimensions, e.g. "
            f"nnx.with_partitioning(init, ('embed', 'mlp')) or nnx.Param(..., out_sharding=('embed', 'mlp')){fix}")


def check_divisible(what: str, shape, names, spec: PartitionSpec, mesh_shape: dict) -> None:
    for dim, (size, name, entry) in enumerate(zip(shape, names, spec)):
        axes = axes_of(entry)
        if not axes:
            continue
        ways = math.prod(mesh_shape[a] for a in axes)
        if size % ways:
            shown = " x ".join(f"{a}={mesh_shape[a]}" for a in axes)
            raise UserError(f"{what} of shape {tuple(shape)}: dimension {dim} ({name}) has size {size}, "
                            f"not divisible by mesh axis {shown}; use sizes divisible by {ways} or a smaller "
                            f"{'/'.join(axes)} axis")


def batch_shardings(example_batch: dict, mesh, rules: dict) -> dict:
    """Shardings for a global batch: the leading (example) dimension over the batch axes."""

    def one(x):
        spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), rules, mesh.shape)
        shards = batch_shards(rules, mesh.shape)
        if x.shape[0] % shards:
            shown = " x ".join(f"{a}={mesh.shape[a]}" for a in axes_of(spec[0]))
            raise UserError(f"data.batch_size={x.shape[0]} is not divisible by the {shards} batch shards "
                            f"({shown}); use a multiple of {shards}")
        return NamedSharding(mesh, spec)

    return {name: one(x) for name, x in example_batch.items()}


def init_state(init: Callable[[], TrainState], shardings) -> TrainState:
    """Run the initialiser so that each device computes only its own shards."""
    return jax.jit(init, out_shardings=shardings)()


def shard_bytes(tree) -> int:
    """Bytes of one device's shards of an abstract tree (shape-dtype structs with shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def count_params(params) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------- host offload

def check_offload(what: str, device) -> None:
    """`train.offload` needs the devices to address pinned host memory (JAX's memory kinds)."""
    kinds = {m.kind for m in device.addressable_memories()}
    if what != "none" and "pinned_host" not in kinds:
        raise UserError(f"train.offload={what} keeps state in pinned host memory, which this {device.platform} "
                        f"backend does not offer (its memories: {', '.join(sorted(kinds))}); it works on GPU and "
                        "TPU (and on CPU from jax 0.10); use train.offload=none here")


def host_shardings(shardings, what: str):
    """The state's shardings with the offloaded part in pinned host memory: the optimizer state, and with
    `what="params"` the parameters too (the rest, such as normalisation statistics, stays on the device)."""
    host = lambda tree: jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), tree)
    if what == "none":
        return shardings
    shardings = shardings.replace(opt_state=host(shardings.opt_state))
    return shardings.replace(params=host(shardings.params)) if what == "params" else shardings


def device_memory(shardings):
    """The shardings with what lives in host memory moved to the device's (the rest left as they are)."""
    return jax.tree.map(lambda s: s.with_memory_kind("device") if s.memory_kind == "pinned_host" else s, shardings)


def in_device_memory(tree):
    """Arrays offloaded to host memory, copied back to the device's (for code outside the train step)."""
    def one(x):
        kind = getattr(x.sharding, "memory_kind", None)
        return jax.device_put(x, x.sharding.with_memory_kind("device")) if kind == "pinned_host" else x
    return jax.tree.map(one, tree)
