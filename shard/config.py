"""The config schema, and loading it from YAML plus `key=value` overrides.

Every key is defined once below, as a dataclass field with its type, default and help text.
YAML files and the command line only set values. The `model` section is the exception by
design: apart from `model.name`, its keys are the model class's constructor arguments, so the
class signature is their schema (checked in `shard.registry`).
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shard.errors import UserError


def option(default: Any, help: str, choices: tuple | None = None, key: str | None = None,
           min: float | None = None, max: float | None = None):
    """A schema field: its default, one line of help, optionally the allowed values or range, and the key
    users write where it differs from the field name (`checkpoint.async`: `async` is a Python keyword)."""
    meta = {"help": help, "choices": choices, "key": key, "min": min, "max": max}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name: str = option("gpt", "registered model name (see models/) or package.module:Class")
    # Filled by the loader with every other model.* key; checked against the class signature.
    kwargs: dict = field(default_factory=dict, metadata={"internal": True})


@dataclass
class DataConfig:
    name: str = option("text", "data source", choices=("text", "digits", "tabular", "arrays", "array_record", "synthetic"))
    task: str = option("auto", "what is predicted; auto = the source's own task",
                       choices=("auto", "lm", "classification", "binary", "regression"))
    path: Optional[str] = option(None, "text: file, folder or glob (default: Python's own .py sources); tabular: "
                                 "diabetes (default), breast_cancer or a CSV; arrays: .npz or folder; array_record: files")
    target: str = option("target", "tabular CSV: the column to predict")
    batch_size: int = option(32, "global batch size (all devices together)", min=1)
    seq_len: int = option(128, "tokens per sequence (sequence data)", min=1)
    eval_fraction: float = option(0.05, "text: share held out for eval (by file; by bytes for one file)", min=0.001, max=0.999)
    features: list = option([16], "synthetic: shape of one input example")
    classes: int = option(10, "synthetic: number of classes (classification)", min=2)
    size: int = option(65536, "synthetic: examples in the train split", min=1)
    prefetch: Optional[int] = option(None, "batches a background thread keeps on the devices ahead of the step; "
                                     "default: 2 on accelerators, 0 on CPU (where the thread competes with "
                                     "XLA for the cores: bench/overhead.py)", min=0)


@dataclass
class OptimizerConfig:
    lr: float = option(3e-3, "peak learning rate (AdamW)", min=0)
    warmup_steps: int = option(50, "linear warmup from 0 to lr", min=0)
    min_lr_ratio: float = option(0.1, "cosine decay ends at lr * min_lr_ratio", min=0, max=1)
    weight_decay: float = option(0.1, "decoupled weight decay (matrices only)", min=0)
    b1: float = option(0.9, "Adam beta1", min=0, max=1)
    b2: float = option(0.95, "Adam beta2", min=0, max=1)
    eps: float = option(1e-8, "Adam epsilon", min=0)
    clip_norm: float = option(1.0, "clip gradients to this global norm; 0 disables", min=0)


@dataclass
class TrainConfig:
    steps: int = option(300, "optimizer steps", min=1)
    seed: int = option(0, "seed for parameters and data order", min=0)
    dtype: str = option("float32", "compute dtype; parameters stay float32",
                        choices=("float32", "bfloat16"))
    loss: str = option("auto", "loss name (see shard/losses.py); auto = the task's default")
    remat: str = option("none", "activation checkpointing of each scanned layer: keep all, recompute all, "
                        "or keep matmul outputs", choices=("none", "full", "dots"))
    attention: str = option("xla", "attention kernel: xla (any device) or cudnn (fused flash attention; NVIDIA "
                            "GPU, bfloat16, head size <= 128)", choices=("xla", "cudnn"))
    init_from: Optional[str] = option(None, "load parameters only from this checkpoint (run, checkpoints or step folder), e.g. to fine-tune")
    deterministic: bool = option(False, "bitwise-reproducible GPU kernels (XLA's --xla_gpu_deterministic_ops; "
                                 "slower); CPU runs are deterministic anyway")
    skip_nonfinite: bool = option(False, "skip an update whose loss or gradients are not finite, instead of stopping")
    eval_every: int = option(0, "evaluate every N steps; 0 = only at the end", min=0)
    eval_batches: int = option(8, "batches per evaluation; 0 = the whole eval split", min=0)
    sample_len: int = option(200, "lm: bytes to generate after training; 0 disables", min=0)
    sample_prompt: str = option("def ", "lm: prompt for the generated sample")


@dataclass
class CheckpointConfig:
    enabled: bool = option(True, "write checkpoints and resume from them")
    every: int = option(100, "save every N steps, and always at the end; 0 = only at the end", min=0)
    keep: int = option(3, "how many of the newest checkpoints to keep", min=1)
    async_: bool = option(True, "write in the background while training goes on", key="async")
    dir: Optional[str] = option(None, "checkpoint folder; default: <run.dir>/checkpoints")
    restore_from: Optional[str] = option(None, "start from another run's checkpoint (whole state: parameters, optimizer, step)")


@dataclass
class MeshConfig:
    preset: str = option("dp", "mesh preset in meshes/ (also settable as mesh=NAME); auto = the fastest "
                         "estimated mesh that fits (see --compare)")
    data: Optional[int] = option(None, "data-parallel axis size; -1 = remaining devices; default: preset's, else 1")
    expert: Optional[int] = option(None, "expert-parallel axis size (experts split over it; it also splits the batch); "
                                   "-1 = remaining devices; default: preset's, else 1")
    fsdp: Optional[int] = option(None, "fully-sharded (ZeRO-3) axis size; -1 = remaining devices; default: preset's, else 1")
    tensor: Optional[int] = option(None, "tensor (Megatron) axis size; -1 = remaining devices; default: preset's, else 1")
    rules: dict = option({}, "logical axis -> mesh axis or list of axes (null = replicated), over the preset's")
    auto_shard: bool = option(True, "split parameters that logical names leave whole: unnamed ones over fsdp, "
                              "tensor and expert, named ones over fsdp (ZeRO-3), each on its largest divisible free "
                              "dimension")
    auto_shard_min_size: int = option(16384, "parameters with fewer elements stay whole under auto_shard "
                                      "(biases, norm scales: gathering them costs more than they save)", min=1)
    # Multi-slice / multi-node: how many of an axis's devices lie across the slow network between
    # slices (TPU) or processes (GPU nodes). Each divides its axis; all of them together multiply
    # to the number of slices or processes.
    dcn_data: Optional[int] = option(None, "part of the data axis across slices/nodes; default: the number of "
                                     "TPU slices when there are several, else 1", min=1)
    dcn_expert: int = option(1, "part of the expert axis across slices/nodes", min=1)
    dcn_fsdp: int = option(1, "part of the fsdp axis across slices/nodes", min=1)
    dcn_tensor: int = option(1, "part of the tensor axis across slices/nodes", min=1)


@dataclass
class RunConfig:
    dir: str = option("runs/default", "run directory: resolved config, metrics.jsonl")
    log_every: int = option(10, "log metrics every N steps", min=1)
    cpu_devices: Optional[int] = option(None, "run on N simulated CPU devices per process (set before JAX starts)", min=1)
    distributed: str = option("auto", "join several processes into one mesh: auto = when the environment says so "
                              "(coordinator set, SLURM tasks, TPU pod), on = always (JAX detects the cluster), off",
                              choices=("auto", "on", "off"))
    coordinator: Optional[str] = option(None, "host:port of process 0 (else JAX_COORDINATOR_ADDRESS or detected)")
    num_processes: Optional[int] = option(None, "processes in the job (else JAX_NUM_PROCESSES or detected)", min=1)
    process_id: Optional[int] = option(None, "this process's index (else JAX_PROCESS_ID or detected)", min=0)
    init_timeout_s: int = option(300, "seconds to wait for every process to join before giving up", min=1)
    heartbeat_timeout_s: int = option(30, "seconds without a heartbeat before a process counts as dead and the "
                                      "others stop", min=1)
    peak_tflops: Optional[float] = option(None, "device peak TFLOP/s for MFU; default: known accelerators only", min=0)
    device_memory_gb: Optional[float] = option(None, "memory of one device for the plan's fits check; default: "
                                               "known accelerators only", min=0)
    link_gbps: Optional[float] = option(None, "bytes/s (GB) one device sends over its links, for the plan's step "
                                        "estimate; default: known accelerators only", min=0)
    progress: bool = option(True, "show a progress bar")
    compile_cache: Optional[str] = option(None, "folder for JAX's persistent compilation cache: restarts skip compiling")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_CLASSES = {f.name: f.default_factory for f in dataclasses.fields(Config)}
FREE_FORM = {("model",), ("mesh", "rules")}  # keys below these are not schema fields


def schema_fields(section: str) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(_SECTION_CLASSES[section]) if not f.metadata.get("internal")]


def key_of(f: dataclasses.Field) -> str:
    """The name users write for a field."""
    return f.metadata.get("key") or f.name


def _renamed(layer: dict, to_field: bool) -> dict:
    """User keys <-> field names, where they differ (only `checkpoint.async` today)."""
    out = dict(layer)
    for section, values in layer.items():
        if section not in SECTIONS or section == "model" or not isinstance(values, dict):
            continue
        names = {key_of(f): f.name for f in schema_fields(section)}
        if not to_field:
            names = {v: k for k, v in names.items()}
        out[section] = {names.get(k, k): v for k, v in values.items()}
    return out


# ----------------------------------------------------------------------------- loading


def load(path: "str | Path | None", overrides: list[str]) -> "Config":
    """YAML file (optional) + `key=value` overrides -> a validated Config. Raises UserError."""
    layers = []
    if path is not None:
        layers.append(_read_yaml(Path(path)))
    layers.append(_parse_overrides(overrides))
    for layer in layers:
        _check_keys(layer)

    model_kwargs: dict = {}
    merged = OmegaConf.structured(Config)
    for layer in layers:
        model = layer.get("model") or {}
        if model.get("name", merged.model.name) != merged.model.name:
            model_kwargs = {}  # another model: the earlier layer's arguments were for the old one
        model_kwargs.update({k: v for k, v in model.items() if k != "name"})
        layer = _renamed(dict(layer, model={"name": model["name"]} if "name" in model else {}), to_field=True)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(layer))
        except OmegaConfBaseException as e:
            raise UserError(_omegaconf_message(e)) from None
    cfg: Config = OmegaConf.to_object(merged)
    cfg.model.kwargs = model_kwargs
    _check_values(cfg)
    _fill_mesh_from_preset(cfg.mesh)
    return cfg


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config file {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return _normalize(data, f"config file {str(path)!r}")


def _parse_overrides(overrides: list[str]) -> dict:
    out: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or key.startswith("-"):
            raise UserError(f"argument {item!r} is not key=value (for example train.steps=100); see --help")
        if key == "mesh":  # `mesh=fsdp` picks a preset
            key = "mesh.preset"
        if _is_text_field(key):  # `run.dir=off` or `run.dir=2024-01-01` stay strings
            value = None if raw in ("null", "~") else raw
        else:
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError:
                value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {item!r} conflicts with an earlier override of {part!r}")
        node[parts[-1]] = value
    return _normalize(out, "command line")


def _is_text_field(key: str) -> bool:
    section, _, name = key.partition(".")
    if section not in SECTIONS or section == "model":
        return False
    field_ = next((f for f in schema_fields(section) if key_of(f) == name), None)
    return field_ is not None and field_.type in (str, Optional[str])


def _normalize(data: dict, where: str) -> dict:
    if isinstance(data.get("mesh"), str):  # `mesh: fsdp` in YAML picks a preset
        data = dict(data, mesh={"preset": data["mesh"]})
    for section, value in data.items():
        if section in SECTIONS and value is not None and not isinstance(value, dict):
            raise UserError(f"{where}: section {section!r} must be a mapping of keys, got {value!r}")
    return data


def _check_keys(layer: dict) -> None:
    for section, values in layer.items():
        if section not in SECTIONS:
            raise UserError(f"unknown config section {section!r}; sections are: {', '.join(SECTIONS)}")
        if section == "model" or not values:
            continue
        allowed = [key_of(f) for f in schema_fields(section)]
        for key in values:
            if key not in allowed:
                raise UserError(f"unknown key '{section}.{key}'; {section} accepts: {', '.join(allowed)}")


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or "?"
    key = key.removesuffix("_") if key.endswith("async_") else key
    msg = str(getattr(e, "msg", e)).splitlines()[0]
    expected = _field_type_name(key)
    if expected and any(s in msg for s in ("could not be converted", "is not a subclass", "Invalid type", "is not a valid")):
        got = msg.split("'")[1] if "'" in msg else msg
        return f"{key}: expected {expected}, got {got!r}"
    if expected and any(s in msg for s in ("Cannot assign", "Invalid value assigned")):
        return f"{key}: expected {expected}, got a value of another kind"
    return f"{key}: {msg}"


def _field_type_name(full_key: str) -> str | None:
    section, _, key = full_key.partition(".")
    if section not in SECTIONS:
        return None
    for f in schema_fields(section):
        if key_of(f) == key:
            return type_name(f.type)
    return None


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in args) + " or null"
    return getattr(tp, "__name__", str(tp))


def _check_values(cfg: Config) -> None:
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for f in schema_fields(section):
            choices = f.metadata.get("choices")
            if choices and getattr(obj, f.name) not in choices:
                raise UserError(f"{section}.{key_of(f)}={getattr(obj, f.name)!r} is not allowed; choose one of: {', '.join(choices)}")
            value, low, high = getattr(obj, f.name), f.metadata.get("min"), f.metadata.get("max")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if (low is not None and value < low) or (high is not None and value > high):
                    allowed = f"at least {low}" if high is None else f"between {low} and {high}"
                    raise UserError(f"{section}.{key_of(f)}={value} is out of range; it must be {allowed}")
    if not isinstance(cfg.model.name, str) or not cfg.model.name:
        raise UserError("model.name must be a registered model name or package.module:Class")


def _fill_mesh_from_preset(mesh: MeshConfig) -> None:
    """Axis sizes not set explicitly come from the preset, else 1; the preset's rules sit under ours."""
    from shard.mesh import AXES, load_preset  # local: mesh imports jax

    preset = {} if mesh.preset == "auto" else load_preset(mesh.preset)  # auto: sizes chosen by the plan
    explicit_wild = any(getattr(mesh, axis) == -1 for axis in AXES)
    for axis in AXES:
        if getattr(mesh, axis) is None:
            size = preset.get(axis, 1)
            setattr(mesh, axis, 1 if size == -1 and explicit_wild else size)  # an explicit -1 wins
    mesh.rules = {**preset.get("rules", {}), **mesh.rules}


# ----------------------------------------------------------------------------- printing


def to_dict(cfg: Config, model_kwargs: dict | None = None) -> dict:
    """The config as plain data, with model kwargs back in the model section (as a user writes it)."""
    out = dataclasses.asdict(cfg)
    kwargs = cfg.model.kwargs if model_kwargs is None else model_kwargs
    out["model"] = {"name": cfg.model.name, **kwargs}
    return _plain(_renamed(out, to_field=False))


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def to_yaml(cfg: Config, model_kwargs: dict | None = None) -> str:
    return yaml.safe_dump(to_dict(cfg, model_kwargs), sort_keys=False)


def help_text(model_signature: list[tuple[str, str, Any]] | None = None, model_name: str = "") -> str:
    lines = ["usage: python train.py [CONFIG.yaml] [key=value ...] [--print-config] [--dry-run] [--compare] [--help]", "",
             "Keys (type, default): set them in the YAML file or as key=value; the command line wins.", ""]
    for section in SECTIONS:
        lines.append(f"{section}:")
        for f in schema_fields(section):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            low, high = f.metadata.get("min"), f.metadata.get("max")
            extra = f" [{'|'.join(choices)}]" if choices else ""
            extra += f" [{low}..{high}]" if high is not None else f" [>={low}]" if low is not None else ""
            lines.append(f"  {section}.{key_of(f):<15} {type_name(f.type):<14} {default!r:<16} {f.metadata['help']}{extra}")
        if section == "model" and model_signature is not None:
            lines.append(f"  constructor arguments of {model_name!r} (model.<arg>=value):")
            for name, tname, default in model_signature:
                lines.append(f"  model.{name:<15} {tname:<14} {default!r}")
        lines.append("")
    return "\n".join(lines)
