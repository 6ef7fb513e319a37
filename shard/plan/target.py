"""Compile-only devices of hardware this machine does not have: `run.target=v5p-128`, `h100x8`, ...

JAX compiles for a device topology it is only told about: libtpu gives compile-only TPU devices of any
slice (`jax.experimental.topologies.get_topology_desc`), and the CUDA plugin gives compile-only GPUs from a
description of the chip (its GpuTargetConfigProto, written here from shard/plan/chips.yaml). The plan then
compiles the same train step for them, with the real compiler: nothing is ever executed on these devices.

Names follow the clouds': a TPU's name counts TensorCores on v4 and v5p (v5p-8 is 4 chips, 2x2x1) and chips
on v5e and v6e (v5e-16 is a 4x4 slice); a GPU's is the chip and the count, in nodes of 8 (h100x16 is two).
"""

import contextlib
import functools
import importlib.resources
import math
import os
import re
import tempfile
from dataclasses import dataclass, field, replace

from shard.paths import yaml_load
from shard.errors import UserError
from shard.plan import hardware

GPUS_PER_NODE = 8
INSTALL = {"tpu": 'pip install -e ".[tpu]"  (libtpu)',
           "gpu": 'pip install -e ".[cuda]"  (jax[cuda12]: the CUDA plugin)'}


@functools.cache
def chips() -> dict:
    return yaml_load((importlib.resources.files("shard.plan") / "chips.yaml").read_text())


@dataclass(frozen=True)
class Target:
    name: str          # as given, e.g. v5p-8
    family: str        # tpu or gpu
    chip: str          # v5p, h100, ...
    n_chips: int       # per slice (TPU) or in all (GPU)
    topology: str      # what the compiler is told: v5p:2x2x1, or slices x nodes x GPUs per node: 1x2x8
    slices: int = 1

    @property
    def facts(self) -> dict:
        return chips()[self.family][self.chip]

    @property
    def spec(self) -> dict:
        return hardware.SPECS[self.facts["spec"]]

    def describe(self) -> str:
        where = f"{self.slices} slices of {self.topology}" if self.slices > 1 else self.topology
        return f"{self.name} ({self.chips_in_all()} {self.facts.get('kind', 'TPU ' + self.chip)} chips, {where})"

    def chips_in_all(self) -> int:
        return self.n_chips * self.slices


def known() -> list[str]:
    tpu = [f"{c}-N" for c in chips()["tpu"]]
    gpu = [f"{c}xN" for c in chips()["gpu"]]
    return tpu + gpu


def parse(name: str, slices: int = 1) -> Target:
    """The target a cloud name stands for; one line naming what is known when it is not one."""
    tpu = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
    gpu = re.fullmatch(r"([a-z]\d+)x(\d+)", name)
    if tpu:
        chip = "v5e" if tpu.group(1) == "v5litepod" else tpu.group(1)
        facts = chips()["tpu"][chip]
        cores = int(tpu.group(2))
        n = cores // facts["cores_in_name"]
        if n < 1 or cores % facts["cores_in_name"] or n & (n - 1):
            step = facts["cores_in_name"]
            raise UserError(f"run.target={name}: a {chip} slice is named by {'TensorCores' if step > 1 else 'chips'}, "
                            f"a power of two{f' times {step}' if step > 1 else ''} (e.g. {chip}-{4 * step}, "
                            f"{chip}-{16 * step})")
        return Target(name, "tpu", chip, n, f"{chip}:{torus(n, facts['dims'])}", slices)
    if gpu and gpu.group(1) in chips()["gpu"]:
        n = int(gpu.group(2))
        if n < 1 or (n > GPUS_PER_NODE and n % GPUS_PER_NODE):
            raise UserError(f"run.target={name}: up to {GPUS_PER_NODE} GPUs, or whole nodes of {GPUS_PER_NODE} "
                            f"(e.g. {gpu.group(1)}x16)")
        nodes, per_node = (n // GPUS_PER_NODE, GPUS_PER_NODE) if n > GPUS_PER_NODE else (1, n)
        if slices > 1:
            raise UserError("run.target_slices is for TPU slices; GPU nodes are counted in the name (h100x16)")
        return Target(name, "gpu", gpu.group(1), n, f"1x{nodes}x{per_node}")
    raise UserError(f"unknown run.target {name!r}; known: {', '.join(known())} "
                    "(e.g. v5p-8, v5e-16, v6e-64, h100x8, h100x16)")


def torus(n_chips: int, dims: int) -> str:
    """The cloud's topology for a slice of n chips: dimensions as even as powers of two allow, smallest first
    (a 4-chip v5p slice is 2x2x1: a dimension of 1 goes last)."""
    shape = [1] * dims
    while math.prod(shape) < n_chips:
        shape[shape.index(min(shape))] *= 2
    shape.sort()
    if dims == 3 and shape[0] == 1:
        shape = shape[1:] + [1]
    return "x".join(map(str, shape))


def gpu_target_config(facts: dict) -> str:
    """The chip's description in the text form of XLA's GpuTargetConfigProto (what the CUDA plugin compiles
    for without a GPU)."""
    major, minor = facts["compute_capability"]
    mem = int(facts["hbm_gib"] * 2**30)
    return (
        "gpu_device_info {\n"
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
        "  threads_per_block_limit: 1024\n  threads_per_warp: 32\n  shared_memory_per_block: 49152\n"
        f"  shared_memory_per_core: {facts['shared_memory_per_sm']}\n"
        f"  shared_memory_per_block_optin: {facts['shared_memory_per_block_optin']}\n"
        "  threads_per_core_limit: 2048\n"
        f"  core_count: {facts['sm_count']}\n  fpus_per_core: {facts['fp32_cores_per_sm']}\n"
        "  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n  block_dim_limit_z: 65535\n"
        f"  memory_bandwidth: {int(facts['memory_bandwidth'])}\n  l2_cache_size: {facts['l2_bytes']}\n"
        f"  clock_rate_ghz: {facts['clock_ghz']}\n  device_memory_size: {mem}\n"
        "}\n"
        'platform_name: "CUDA"\n'
        "dnn_version_info { major: 9 minor: 1 patch: 0 }\n"
        f'device_description_str: "{facts["kind"]}"\n')


def of(run) -> Target | None:
    return parse(run.target, run.target_slices) if run.target else None


def devices(target: Target) -> list:
    """The target's compile-only devices. JAX must run on the CPU here (the CUDA plugin checks for a GPU
    driver unless told to stay off the GPU): set before JAX's backends start, as run.cpu_devices is."""
    import jax
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock unless told not to: compile-only devices share no chip, so several
    # processes (a test and its subprocess, two dry runs) may each load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass  # backends already started (tests): the TPU topology does not need it
    jax.config.update("jax_enable_compilation_cache", False)  # a compile-only program cannot be stored or loaded
    try:
        with _quiet_stderr() as said:
            if target.family == "tpu":
                kwargs = {"num_slices": target.slices} if target.slices > 1 else {}
                got = topologies.get_topology_desc(topology_name=target.topology, platform="tpu", **kwargs)
            else:
                got = topologies.get_topology_desc(platform="cuda", topology=target.topology,
                                                   target_config=gpu_target_config(target.facts))
    except (ImportError, RuntimeError, NotImplementedError, ValueError) as e:
        missing = isinstance(e, (ImportError, NotImplementedError)) or "not installed" in str(e) \
            or "not implemented" in str(e)
        if missing:
            raise UserError(f"run.target={target.name} needs the {target.family.upper()} compiler, which is not "
                            f"installed here: {INSTALL[target.family]}") from None
        detail = (str(e).strip().splitlines() or [said()])[0]
        raise UserError(f"run.target={target.name}: the compiler refused topology {target.topology}: "
                        f"{detail}") from None
    return list(got.devices)


@dataclass
class CompilerFlags:
    """The flags a step compiles with: chips.yaml's recommended ones for the device's family and the user's
    (run.compiler_flags), merged by compiler_flags below. A recommended flag this compiler does
    not know (another libtpu or XLA version) is dropped and listed; an unknown flag of the user's is refused."""
    flags: dict = field(default_factory=dict)
    users: frozenset = frozenset()   # the names the user gave (refused when unknown, never dropped)
    dropped: list = field(default_factory=list)


def family(run, device) -> str | None:
    """Whose recommended compiler flags apply: run.target's family, else the device's (tpu, gpu); None on CPU."""
    if run.target:
        return parse(run.target, run.target_slices).family
    return device.platform if device.platform in ("tpu", "gpu") else None


def chip(run, device) -> str | None:
    """The chip (chips.yaml's name: v5p, h100, ...): run.target's, else the device's kind where it names one."""
    if run.target:
        return parse(run.target, run.target_slices).chip
    kind = str(getattr(device, "device_kind", "")).lower()
    names = {"tpu v6 lite": "v6e", "tpu v5 lite": "v5e", "tpu v5": "v5p", "tpu v4": "v4"}  # as libtpu names them
    return next((c for k, c in names.items() if kind.startswith(k)), None)


def compiler_flags(run, device):
    """The flags the steps compile with: chips.yaml's recommended ones for the family and then the chip's own (unless
    run.recommended_flags=false), then run.compiler_flags over them (a null value drops one; a leading -- is
    allowed, as in LIBTPU_INIT_ARGS)."""
    kind = family(run, device)
    flags = dict(chips().get("flags", {}).get(kind, {})) if run.recommended_flags and kind else {}
    if flags:
        flags.update(chips()[kind].get(chip(run, device), {}).get("flags", {}))
    users = set()
    for name, value in (run.compiler_flags or {}).items():
        name = str(name).lstrip("-")
        if value is None:
            flags.pop(name, None)
        else:
            flags[name] = value
            users.add(name)
    return CompilerFlags(flags, frozenset(users))


def check_mesh(mesh_cfg, target: Target, n_devices: int) -> None:
    """The mesh's sizes against the target's devices, in one line that names the target."""
    from shard.core import mesh as mesh_lib

    if mesh_cfg.preset == "auto":
        return
    try:
        mesh_lib.resolve_sizes({a: getattr(mesh_cfg, a) for a in mesh_lib.AXES}, n_devices)
    except UserError as e:
        raise UserError(f"run.target={target.name} has {n_devices} devices ({target.describe()}): {e}") from None


def out_of_memory(message: str, where: str) -> str:
    """The TPU compiler's refusal of a program, as one line: the shortfall where the step does not fit the chip's
    HBM; where one fusion or kernel overflows a core's on-chip vector memory (VMEM), that, which says nothing of
    whether the step fits (the compile stopped there)."""
    first = message.strip().splitlines()[0]
    if "memory space vmem" in message:
        return (f"the step does not compile for {where}: one of its fusions or kernels needs more of a core's vector "
                f"memory (VMEM, on-chip scratch) than there is; its HBM use is unknown ({first})")
    need = re.search(r"required for ([^(]*)\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", message)
    if not need:
        return f"the step does not fit {where}: {first}"
    what, needed, have = need.group(1).strip(), float(need.group(2)), float(need.group(3))
    return (f"the step does not fit {where}: the compiler needs {needed:.2f} GiB for {what} but a chip has "
            f"{have:.2f} GiB: short by {needed - have:.2f} GiB (try train.remat=full, train.grad_accum, a mesh that "
            "splits more, or mesh=auto)")


def compiler_failed(message: str, where: str) -> str:
    """A compiler's own failure on a program (not the user's code), as one line with what may get round it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    first = lines[0] if lines else "no message"
    around = ""
    if "output tile sizes" in message or "Triton" in message or "triton" in message:
        # XLA's GPU compiler fails to tile some products with its Triton GEMM emitter (Phi-3's key/value
        # gradient on h100x8, bench/RESULTS.md); cuBLAS takes them
        around = "; run.compiler_flags={xla_gpu_enable_triton_gemm: false} hands matrix products to cuBLAS instead"
    return f"the step does not compile for {where}: the compiler failed ({first[:300]}){around}"


def per_device(target: Target, n_devices: int) -> dict:
    """The chip's figures per compile-only device: some topologies give a device per TensorCore (v4's two),
    each with half the chip's memory and FLOP/s."""
    share = target.chips_in_all() / n_devices
    return {"tflops": target.spec["tflops"] * share, "link_gbps": target.spec["link_gbps"] * share,
            "memory_gb": target.facts["hbm_gib"] * 2**30 / 1e9 * share}


def with_figures(run, target: Target, n_devices: int):
    """run with the target's peak FLOP/s, links and memory where the user left them unset."""
    fig = per_device(target, n_devices)
    return replace(run, peak_tflops=run.peak_tflops or fig["tflops"], link_gbps=run.link_gbps or fig["link_gbps"],
                   device_memory_gb=run.device_memory_gb or fig["memory_gb"])


@contextlib.contextmanager
def _quiet_stderr():
    """libtpu prints pages of warnings about the cloud metadata it cannot find on a machine that is not a
    TPU VM; keep them out of the report (yields a function that returns what was said)."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)

        def said() -> str:
            sink.seek(0)
            return sink.read().decode(errors="replace").strip()
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
