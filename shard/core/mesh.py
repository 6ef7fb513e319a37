"""The device mesh: canonical axes, presets, sizes with -1, and the devices it is laid over.

Every canonical axis always exists (size 1 unless set), so rules and models can name any of
them under any preset. Axes are of type Auto: sharding comes from annotations, and XLA's
partitioner inserts the collectives.
"""

import importlib.resources
import math

import jax
from shard.paths import yaml_load
from jax.experimental import mesh_utils

from shard.errors import UserError

PRESETS = "shard.meshes"  # the package of preset YAML files (the repository's meshes/ folder)
AXES = ("replica", "stage", "data", "expert", "fsdp", "context", "tensor")  # mesh axis order, slowest-varying first
# (replicas outermost: under local SGD / DiLoCo they exchange parameters only every few steps; pipeline stages
# next: only activations at stage boundaries cross them, so they suit slow links; context and tensor innermost:
# they exchange activations inside every layer)


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in importlib.resources.files(PRESETS).iterdir()
                  if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict:
    path = importlib.resources.files(PRESETS) / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown mesh preset {name!r}; presets are: {', '.join(preset_names())}")
    preset = yaml_load(path.read_text()) or {}
    unknown = set(preset) - set(AXES) - {"rules", "zero"}
    if unknown:
        raise UserError(f"mesh preset {name!r} has unknown keys {sorted(unknown)}; "
                        f"allowed: {', '.join(AXES)}, rules, zero")
    if preset.get("zero", 0) not in (0, 1, 2):
        raise UserError(f"mesh preset {name!r}: zero={preset['zero']!r}; ZeRO stages over the data axis are 0, 1 or 2")
    return preset


def resolve_sizes(sizes: dict[str, int], n_devices: int) -> dict[str, int]:
    """Replace the one -1 axis by the remaining devices and check the product is the device count."""
    for axis, size in sizes.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise UserError(f"mesh.{axis}={size!r}: axis sizes must be positive integers or -1 (the remaining devices)")
    wild = [a for a, s in sizes.items() if s == -1]
    if len(wild) > 1:
        raise UserError(f"mesh axes {' and '.join('mesh.' + a for a in wild)} are both -1; at most one axis may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    shown = " x ".join(f"{a}={s}" for a, s in sizes.items())
    if wild:
        if n_devices % fixed:
            raise UserError(f"mesh {shown}: the fixed axes multiply to {fixed}, which does not divide the "
                            f"{n_devices} devices; pick sizes whose product divides {n_devices}")
        sizes = {**sizes, wild[0]: n_devices // fixed}
    elif fixed != n_devices:
        raise UserError(f"mesh {shown} needs {fixed} devices but {n_devices} are in use; "
                        f"the axis sizes must multiply to {n_devices} (or set one axis to -1)")
    return sizes


def build_mesh(mesh_cfg, devices: list) -> jax.sharding.Mesh:
    sizes = resolve_sizes({axis: getattr(mesh_cfg, axis) for axis in AXES}, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
    dcn = dcn_sizes(mesh_cfg, sizes, devices)
    if math.prod(dcn.values()) == 1:
        # jax.make_mesh orders devices by the physical topology (ICI rings on TPU, NVLink on GPU).
        return jax.make_mesh(shape, AXES, devices=devices, axis_types=axis_types)
    # Several slices (or nodes): each axis is (its part across the slow network) x (its part inside a
    # slice), so only the dcn parts' collectives cross between slices.
    ici = tuple(sizes[a] // dcn[a] for a in AXES)
    by_slice = n_slices(devices) > 1
    try:
        grid = mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn[a] for a in AXES), devices,
                                                    process_is_granule=not by_slice)
    except (ValueError, AssertionError) as e:
        raise UserError(f"mesh.dcn_* {dcn} does not fit the {n_granules(devices)} "
                        f"{'slices' if by_slice else 'processes'} of {len(devices)} devices ({e})") from None
    return jax.sharding.Mesh(grid, AXES, axis_types=axis_types)


def n_slices(devices: list) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def n_granules(devices: list) -> int:
    """What the slow network connects: TPU slices when there are several, else processes (nodes)."""
    return n_slices(devices) if n_slices(devices) > 1 else len({d.process_index for d in devices})


def dcn_sizes(mesh_cfg, sizes: dict[str, int], devices: list) -> dict[str, int]:
    dcn = {a: getattr(mesh_cfg, f"dcn_{a}") for a in AXES}
    if dcn["data"] is None:  # several TPU slices: data parallel across them unless told otherwise
        slices = n_slices(devices)
        others = math.prod(v for a, v in dcn.items() if a != "data")
        dcn["data"] = slices // others if slices > 1 and slices % others == 0 else 1
    for a in AXES:
        if sizes[a] % dcn[a]:
            raise UserError(f"mesh.dcn_{a}={dcn[a]} must divide mesh.{a}={sizes[a]} (the axis's whole size)")
    total = math.prod(dcn.values())
    if total > 1 and total != n_granules(devices):
        raise UserError(f"mesh.dcn_* multiply to {total} but the devices form {n_granules(devices)} "
                        "slices or processes; they must be equal")
    return dcn


def describe(mesh: jax.sharding.Mesh) -> str:
    return " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
