"""Logical axis names -> mesh axes: the one table of rules, and the helper models use.

Models name the dimensions of their parameters (`out_sharding=("embed", "mlp")` metadata) and
of a few activations (`constrain(x, ("batch", "length", "embed"))`) with the vocabulary below,
and never a mesh axis. Which mesh axes a name maps to is decided here and in mesh presets.

Mapping a tuple of names to a PartitionSpec drops mesh axes of size 1 and mesh axes already
used by an earlier dimension of the same array. So under FSDP an activation named
("batch", "embed") is split on batch only, while a parameter named ("embed", "mlp") is split on
embed: one table serves both, without a second vocabulary for activations.
"""

import contextlib
import contextvars
import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard.errors import UserError

# Logical name -> mesh axis, tuple of mesh axes, or None (replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    # Examples of the global batch. `stage` splits the rows outside a pipeline's stacked layers (embedding,
    # head, loss), each stage holding whole microbatches; it comes second, as in the mesh, so that a
    # process's devices hold neighbouring rows.
    "batch": ("replica", "stage", "data", "expert", "fsdp"),
    "length": "context",        # sequence positions (split only under context parallelism)
    "embed": "fsdp",            # model width (residual stream)
    "mlp": "tensor",            # hidden width of a feed-forward layer
    "heads": "tensor",          # attention (query) heads
    "kv_heads": "tensor",       # key/value heads
    "head_dim": None,           # width of one attention head
    "vocab": "tensor",          # vocabulary (embedding rows, output logits)
    "features": None,           # input features of non-sequence data
    "classes": None,            # output classes / targets
    "layers": "stage",          # stacked (scanned) layers: pipeline stages hold contiguous blocks of them
    "experts": "expert",        # the experts of a mixture-of-experts layer
}


def merged_rules(overrides: dict | None, mesh_axes: Sequence[str]) -> dict:
    """The table with a preset's or the user's single-rule overrides applied, checked."""
    rules = dict(RULES)
    for name, target in (overrides or {}).items():
        targets = axes_of(target)
        bad = [a for a in targets if a not in mesh_axes]
        if bad or not all(isinstance(a, str) for a in targets) or len(set(targets)) != len(targets):
            raise UserError(f"mesh.rules.{name}={target!r}: a rule maps to mesh axes "
                            f"({', '.join(mesh_axes)}), a list of distinct ones, or null")
        rules[name] = None if not targets else targets[0] if len(targets) == 1 else targets
    return rules


def axes_of(target) -> tuple:
    """A rule's target or a PartitionSpec entry (None, an axis, or several) as a tuple of mesh axes."""
    if target is None:
        return ()
    if isinstance(target, (list, tuple)):
        return tuple(target)
    return (target,)


def path_keys(path) -> tuple[str, ...]:
    """A pytree path (jax.tree_util's keys) as the strings of its parts: dict keys, attribute names, indices."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def logical_names(leaf) -> tuple | None:
    """The logical names a variable carries (Flax's `out_sharding` metadata, which
    `nnx.with_partitioning` and `sharding_names` also set), or None."""
    if isinstance(leaf, nnx.Variable):
        return leaf.get_metadata().get("out_sharding")
    return None


# A parameter's `role` metadata where its shape cannot tell that it is no matrix (a per-head bias, a
# projection-wide norm weight: two named dimensions): weight decay and quantization leave these alone.
VECTOR_ROLES = ("bias", "norm")


def plays_vector(leaf) -> bool:
    """Whether a variable's `role` metadata says it is a bias or a norm weight (models/layers.py sets it)."""
    return isinstance(leaf, nnx.Variable) and leaf.get_metadata().get("role") in VECTOR_ROLES


def logical_to_spec(names: Sequence[str | None], rules: dict, mesh_shape: dict[str, int]) -> PartitionSpec:
    used: set[str] = set()
    spec = []
    for name in names:
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise UserError(f"logical axis {name!r} has no rule; known names: {', '.join(rules)} "
                            "(add one with mesh.rules.NAME=AXIS)")
        axes = tuple(a for a in axes_of(rules[name]) if mesh_shape.get(a, 1) > 1 and a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


# ----------------------------------------------------------------------------- parameters

# Mesh axes that split parameters, in the order the automatic split offers them a dimension
# (`data` only ever splits the batch).
MODEL_AXES = ("fsdp", "tensor", "expert")


def param_spec(shape: Sequence[int], names: Sequence[str | None] | None, rules: dict, mesh_shape: dict[str, int],
               auto_min_size: int | None) -> tuple[PartitionSpec, str]:
    """A parameter's PartitionSpec and how it was decided: "named" (its logical names alone split it),
    "auto" (the fallback below split some dimension) or "replicated".

    The fallback, for any model (`mesh.auto_shard`): a parameter with at least `auto_min_size`
    elements that carries no names gets, from each model axis larger than 1 in turn (fsdp, then
    tensor, then expert only if nothing else split it), the largest dimension that axis divides and
    no other axis splits yet. A named parameter gets the same from ZeRO-3's axes alone (`zero_axes`:
    fsdp, and those the `embed` rule adds, such as ep's expert) where no rule splits it over them, as
    ZeRO-3 shards every tensor (MLA's q_b and kv_b have no `embed` dimension); its `layers` dimension is
    never taken (scanned layers are sliced one at a time). `auto_min_size=None` turns the fallback off.
    """
    spec = list(logical_to_spec(names, rules, mesh_shape)) if names is not None else [None] * len(shape)
    used = {a for entry in spec for a in axes_of(entry)}
    kind = "named" if used else "replicated"
    if auto_min_size is None or math.prod(shape) < auto_min_size:
        return PartitionSpec(*spec), kind
    for axis in MODEL_AXES if names is None else zero_axes(rules):
        if mesh_shape.get(axis, 1) == 1 or axis in used:
            continue
        if names is None and axis == "expert" and used:  # expert is the last resort: it also splits the batch
            continue
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % mesh_shape[axis] == 0
                and (names is None or names[d] != "layers")]
        if free:
            dim = max(free, key=lambda d: (shape[d], -d))  # the largest; the first of equals
            spec[dim] = axis
            used.add(axis)
            kind = "auto"
    return PartitionSpec(*spec), kind


def zero_axes(rules: dict) -> tuple[str, ...]:
    """The model axes ZeRO-3 splits every parameter over: fsdp, and the others the `embed` rule maps the model's
    width to (ep's preset: expert, so that the rest of the model is sharded inside the expert group)."""
    return ("fsdp", *(a for a in axes_of(rules.get("embed")) if a in MODEL_AXES and a != "fsdp"))


# ----------------------------------------------------------------------------- active rules

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("shard_active_rules", default=None)


@contextlib.contextmanager
def activate(mesh: jax.sharding.Mesh | None, rules: dict | None):
    """While tracing, `constrain` maps names through these rules onto this mesh (no mesh: no constraints)."""
    token = _ACTIVE.set(None if mesh is None else (mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def batch_axes(rules: dict, mesh_shape: dict[str, int]) -> tuple:
    """The mesh axes that split a batch's rows (the `batch` rule's larger than 1), in order."""
    return axes_of(logical_to_spec(("batch",), rules, mesh_shape)[0])


def batch_shards(rules: dict, mesh_shape: dict[str, int]) -> int:
    """How many pieces the batch axes (the `batch` rule, as the preset and mesh.rules set it) cut a global batch
    into."""
    return math.prod(mesh_shape[a] for a in batch_axes(rules, mesh_shape))


def without_batch_axes(rules: dict, axes) -> dict:
    """The rules inside a vmap whose dimension `axes` split (`spmd_axis_name`): "batch" names the rest."""
    return {**rules, "batch": tuple(a for a in axes_of(rules["batch"]) if a not in axes) or None}


def microbatches(a: jax.Array, k: int) -> jax.Array:
    """(B, ...) -> (k, B/k, ...): microbatch m holds examples m, m+k, m+2k, ..., so each keeps the batch's
    split over the batch axes (a contiguous cut would put whole microbatches on single devices)."""
    return a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1)


def from_microbatches(a: jax.Array) -> jax.Array:
    """The inverse of `microbatches`: (k, B/k, ...) -> (B, ...)."""
    return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def vmapped_axes() -> frozenset:
    """The mesh axes that the vmaps being traced split their mapped dimension over (`spmd_axis_name`: each
    replica's step under local SGD and DiLoCo, each data shard's gradient, each pipeline stage). A shard_map
    inside such a vmap must count them among its manual axes (`axis_names`): JAX's batching of it puts the
    mapped dimension on them in its specs, and an axis a value varies over there must be manual (JAX 0.10
    raises "Axes mentioned in `manual_axis_type` ... should be of type `Manual`" otherwise). Read from JAX's
    axis environment, which is what its own shard_map consults; empty where that cannot be read."""
    try:
        from jax._src import core  # not public API: the vmaps' spmd names live only here
        return frozenset(core.get_axis_env().spmd_axis_names)
    except (ImportError, AttributeError):  # pragma: no cover - another JAX release
        return frozenset()


def active() -> tuple | None:
    """(mesh, rules) while a step is traced under `activate`, else None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Ask for activation `x` to be sharded as its logical `names` map under the active rules.

    The one sharding helper model code uses. Outside the framework (no active rules) it does nothing,
    so a model stays an ordinary Flax module.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules, mesh.shape)))
