"""The device mesh: canonical axes, presets, sizes with -1, and the devices it is laid over.

Every canonical axis always exists (size 1 unless set), so rules and models can name any of
them under any preset. Axes are of type Auto: sharding comes from annotations, and XLA's
partitioner inserts the collectives.
"""

import importlib.resources
import math

import jax
import yaml

from shard.errors import UserError

AXES = ("data", "expert", "fsdp", "tensor")  # mesh axis order, slowest-varying first


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in importlib.resources.files("meshes").iterdir()
                  if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict:
    path = importlib.resources.files("meshes") / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown mesh preset {name!r}; presets are: {', '.join(preset_names())}")
    preset = yaml.safe_load(path.read_text()) or {}
    unknown = set(preset) - set(AXES) - {"rules"}
    if unknown:
        raise UserError(f"mesh preset {name!r} has unknown keys {sorted(unknown)}; allowed: {', '.join(AXES)}, rules")
    return preset


def select_devices(cpu_devices: int | None) -> list:
    """The devices to lay the mesh over.

    With `run.cpu_devices=N`, JAX is asked for N CPU devices; this only takes effect before JAX's
    backends start (train.py calls this first thing). When they have already started with at least
    N CPU devices (tests, notebooks), the first N are used.
    """
    if cpu_devices is None:
        return jax.devices()
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError:
        pass  # backends already initialised: use what is there
    devices = jax.devices("cpu")
    if len(devices) < cpu_devices:
        raise UserError(f"run.cpu_devices={cpu_devices} but JAX already started with {len(devices)} CPU devices; "
                        "set it before JAX initialises (a fresh process)")
    return devices[:cpu_devices]


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
    # jax.make_mesh orders devices by the physical topology (ICI rings on TPU, NVLink on GPU).
    return jax.make_mesh(shape, AXES, devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def describe(mesh: jax.sharding.Mesh) -> str:
    return " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
