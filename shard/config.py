"""The config schema, and loading it from YAML plus `key=value` overrides.

Every key is defined once below, as a dataclass field with its type, default and help text.
YAML files and the command line only set values. The `model` section is the exception by
design: apart from `model.name`, its keys are the model class's constructor arguments, so the
class signature is their schema (checked in `shard.registry`).
"""

import dataclasses
import difflib
import functools
import hashlib
import json
import re
import textwrap
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
           min: float | None = None, max: float | None = None, job: bool | None = None):
    """A schema field: its default, one line of help, optionally the allowed values or range, and the key
    users write where it differs from the field name (`checkpoint.async`: `async` is a Python keyword).
    `job`: whether the key changes what is trained, and so the run's folder (`job_key`); None takes the
    section's rule (JOB_SECTIONS)."""
    meta = {"help": help, "choices": choices, "key": key, "min": min, "max": max, "job": job}
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
                                     "XLA for the cores: bench/overhead.py)", min=0, job=False)


@dataclass
class OptimizerConfig:
    name: str = option("adamw", "the optimizer: adamw, or sgd (with optimizer.momentum)", choices=("adamw", "sgd"))
    lr: float = option(3e-3, "peak learning rate", min=0)
    warmup_steps: int = option(50, "linear warmup from 0 to lr", min=0)
    min_lr_ratio: float = option(0.1, "cosine decay ends at lr * min_lr_ratio", min=0, max=1)
    weight_decay: float = option(0.1, "decoupled weight decay (matrices only)", min=0)
    b1: float = option(0.9, "Adam beta1", min=0, max=1)
    b2: float = option(0.95, "Adam beta2", min=0, max=1)
    eps: float = option(1e-8, "Adam epsilon", min=0)
    momentum: float = option(0.0, "sgd: momentum (0 = none)", min=0, max=1)
    clip_norm: float = option(1.0, "clip gradients to this global norm; 0 disables", min=0)


@dataclass
class TrainConfig:
    steps: int = option(300, "optimizer steps", min=1)
    seed: int = option(0, "seed for parameters and data order", min=0, job=True)
    dtype: str = option("float32", "compute dtype; parameters stay float32",
                        choices=("float32", "bfloat16"), job=True)
    loss: str = option("auto", "loss name (see shard/losses.py); auto = the task's default", job=True)
    remat: str = option("none", "activation checkpointing of each scanned layer: keep all, recompute all, "
                        "or keep matmul outputs", choices=("none", "full", "dots"))
    context_strategy: str = option("all_gather", "attention under mesh.context > 1: all_gather (each device keeps "
                                   "its queries and gathers every key and value) or ring (keys and values pass "
                                   "round the context devices, never whole on one)", choices=("all_gather", "ring"))
    attention: str = option("xla", "attention kernel: xla (any device) or cudnn (fused flash attention; NVIDIA "
                            "GPU, bfloat16, head size <= 128)", choices=("xla", "cudnn"))
    init_from: Optional[str] = option(None, "load parameters only from this checkpoint (run, checkpoints or step folder), e.g. to fine-tune", job=True)
    deterministic: bool = option(False, "bitwise-reproducible GPU kernels (XLA's --xla_gpu_deterministic_ops; "
                                 "slower); CPU runs are deterministic anyway")
    skip_nonfinite: bool = option(False, "skip an update whose loss or gradients are not finite, instead of stopping")
    grad_accum: int = option(1, "gradient accumulation: run each batch as this many microbatches one after "
                             "another, one update (less activation memory, the same update)", min=1)
    grad_dtype: str = option("float32", "dtype the gradients are summed in across the data axis (bfloat16 halves "
                             "the data-parallel reduction's bytes)", choices=("float32", "bfloat16"), job=True)
    accum_dtype: str = option("float32", "dtype the microbatches' gradients are summed in under grad_accum > 1",
                              choices=("float32", "bfloat16"), job=True)
    offload: str = option("none", "keep state in host memory between steps (pinned_host), moved to the device "
                          "inside the step: the optimizer state, or also the parameters",
                          choices=("none", "optimizer", "params"))
    sync: str = option("allreduce", "how the replicas (mesh.replica) meet: allreduce (gradients averaged every "
                       "step), local_sgd (parameters averaged every sync_every steps) or diloco (an outer Nesterov "
                       "step on the averaged change every sync_every steps)", choices=("allreduce", "local_sgd", "diloco"), job=True)
    sync_every: int = option(16, "local_sgd, diloco: steps between syncs (H)", min=1, job=True)
    sync_fragments: int = option(1, "local_sgd, diloco: parameter fragments synced at staggered steps (streaming "
                                 "DiLoCo; each sync moves 1/F of the model)", min=1, job=True)
    outer_lr: float = option(0.7, "diloco: outer learning rate", min=0, job=True)
    outer_momentum: float = option(0.9, "diloco: outer Nesterov momentum (0 = plain SGD)", min=0, max=1, job=True)
    ema: float = option(0.0, "keep an exponential moving average of the weights with this decay (e.g. 0.999), "
                        "used by eval, the sample, load_model and export; 0 = off", min=0, max=0.99999, job=True)
    eval_every: int = option(0, "evaluate every N steps; 0 = only at the end", min=0)
    eval_batches: int = option(8, "batches per evaluation, spread evenly over the eval split; 0 = all of it", min=0)
    sample_len: int = option(200, "lm: bytes to generate after training; 0 disables", min=0)
    sample_prompt: str = option("def ", "lm: prompt for the generated sample")


@dataclass
class CheckpointConfig:
    enabled: bool = option(True, "write checkpoints and resume from them")
    every: int = option(100, "save every N steps, and always at the end; 0 = only at the end", min=0)
    keep: int = option(3, "how many of the newest checkpoints to keep", min=1)
    async_: bool = option(True, "write in the background while training goes on", key="async")
    dir: Optional[str] = option(None, "checkpoint folder; default: <run.dir>/checkpoints")
    restore_from: Optional[str] = option(None, "start from another run's checkpoint (whole state: parameters, optimizer, step)", job=True)


@dataclass
class MeshConfig:
    preset: str = option("dp", "mesh preset in meshes/ (also settable as mesh=NAME); auto = the fastest "
                         "estimated mesh that fits (see --compare)")
    replica: Optional[int] = option(None, "replica axis size: copies of the job that sync as train.sync says "
                                    "(allreduce: one more data axis); -1 = remaining devices; default: preset's, else 1")
    stage: Optional[int] = option(None, "pipeline axis size: the stacked layers are cut into this many stages "
                                  "(see pipeline.*); -1 = remaining devices; default: preset's, else 1")
    data: Optional[int] = option(None, "data-parallel axis size; -1 = remaining devices; default: preset's, else 1")
    expert: Optional[int] = option(None, "expert-parallel axis size (experts split over it; it also splits the batch); "
                                   "-1 = remaining devices; default: preset's, else 1")
    fsdp: Optional[int] = option(None, "fully-sharded (ZeRO-3) axis size; -1 = remaining devices; default: preset's, else 1")
    context: Optional[int] = option(None, "context (sequence) axis size: each sequence is split over it (see "
                                    "train.context_strategy); -1 = remaining devices; default: preset's, else 1")
    tensor: Optional[int] = option(None, "tensor (Megatron) axis size; -1 = remaining devices; default: preset's, else 1")
    rules: dict = option({}, "logical axis -> mesh axis or list of axes (null = replicated), over the preset's")
    zero: Optional[int] = option(None, "ZeRO stage over the data axis: 1 splits the optimizer state over it, 2 also "
                                 "the gradients (parameters stay whole; fsdp is stage 3); default: preset's, else 0",
                                 choices=(0, 1, 2))
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
    dcn_replica: int = option(1, "part of the replica axis across slices/nodes", min=1)
    dcn_stage: int = option(1, "part of the stage axis across slices/nodes", min=1)
    dcn_expert: int = option(1, "part of the expert axis across slices/nodes", min=1)
    dcn_fsdp: int = option(1, "part of the fsdp axis across slices/nodes", min=1)
    dcn_context: int = option(1, "part of the context axis across slices/nodes", min=1)
    dcn_tensor: int = option(1, "part of the tensor axis across slices/nodes", min=1)


@dataclass
class PipelineConfig:
    microbatches: Optional[int] = option(None, "microbatches the global batch is cut into under mesh.stage > 1 "
                                         "(M); default: twice the stages", min=1)
    repeats: int = option(1, "layer groups each stage holds (R): 1 = GPipe; more = a circular schedule, each "
                          "stage holding R non-adjacent groups, bubble (S-1)/(R*M+S-1)", min=1)


@dataclass
class RunConfig:
    dir: Optional[str] = option(None, "run folder: resolved config, metrics.jsonl, checkpoints. null (the default): "
                                "runs/<config file name>, plus -<8 hex digits> when the command line changes what "
                                "is trained (model, data, optimizer, train.seed/dtype/loss/init_from, "
                                "checkpoint.restore_from; not train.steps, eval, sample, log, mesh, run or checkpoint "
                                "keys), so the same command resumes its own run and another job gets another folder; "
                                "a config file outside configs/ always gets the suffix")
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
    device_memory_gb: Optional[float] = option(None, "memory of one device for the plan's fits check; default: what "
                                               "the runtime lets JAX use (GPU, TPU), unknown on CPU", min=0)
    link_gbps: Optional[float] = option(None, "bytes/s (GB) one device sends over its links, for the plan's step "
                                        "estimate; default: known accelerators only", min=0)
    progress: bool = option(True, "show progress: a bar on a terminal, else a line every log_every steps")
    tensorboard: bool = option(True, "write TensorBoard event files to <run.dir>/tensorboard (process 0)")
    plot: bool = option(True, "draw <run.dir>/curves.png when the run ends (loss, eval loss, throughput)")
    profile_steps: Optional[str] = option(None, "START:END traces steps START..END-1 with jax.profiler into "
                                          "<run.dir>/profile (TensorBoard's profile plugin, XProf, Perfetto)")
    compile_cache: Optional[str] = option(None, "folder for JAX's persistent compilation cache: restarts skip compiling")
    reuse_host_memory: bool = option(True, "on CPU, glibc's malloc keeps the memory a step frees for the next step "
                                     "instead of unmapping it (XLA:CPU allocates every step's buffers anew; saves "
                                     "their page faults, ~17% of the default job's step); false, or any MALLOC_* or "
                                     "GLIBC_TUNABLES variable set, leaves malloc as it is")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
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


def load(path: "str | Path | None", overrides: list[str], sections: tuple | None = None) -> "Config":
    """YAML file (optional) + `key=value` overrides -> a validated Config. Raises UserError.

    `sections`: read only these sections of the file (a finished run's model and training settings, say,
    without the mesh and devices it ran on). `run.dir`, unless the file or an override sets it, is derived
    from what the job trains (`default_run_dir`)."""
    layers = []
    if path is not None:
        layer = _read_yaml(Path(path))
        layers.append(layer if sections is None else {k: v for k, v in layer.items() if k in sections})
    layers.append(_parse_overrides(overrides))
    for layer in layers:
        _check_keys(layer)
    cfg = _merge(layers)
    _check_values(cfg)
    if cfg.run.dir is None:
        cfg.run.dir = default_run_dir(path, _merge(layers[:-1]), cfg)
    _fill_mesh_from_preset(cfg.mesh)
    return cfg


def _merge(layers: list[dict]) -> "Config":
    """The layers over the schema's defaults, later ones winning; model arguments kept in model.kwargs."""
    model_kwargs: dict = {}
    merged = _schema()
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
    return cfg


@functools.cache
def _schema():
    """The schema as OmegaConf's structured config: built once (it is slow), never changed (merge copies)."""
    return OmegaConf.structured(Config)


# What a run trains picks its folder: every key of these sections, and the keys of other sections marked
# `job=True` (a key of these sections may opt out with `job=False`). Every other key may change between a run
# and its resumption, so it keeps the folder: train.steps, eval, sample and log settings, the mesh (a checkpoint
# restores onto any mesh), speed and memory knobs (remat, attention, prefetch, deterministic kernels,
# grad_accum, offload) and skip_nonfinite (the NaN error says to rerun with it; it changes nothing until a step
# is not finite). A new key that changes what is trained says `job=True`.
JOB_SECTIONS = ("model", "data", "optimizer")


def job_key(section: str, f: dataclasses.Field) -> bool:
    job = f.metadata.get("job")
    return section in JOB_SECTIONS if job is None else job


def job_keys_outside_sections() -> list[str]:
    """The keys outside JOB_SECTIONS that change what is trained, in schema order."""
    return [f"{s}.{key_of(f)}" for s in SECTIONS if s not in JOB_SECTIONS for f in schema_fields(s) if job_key(s, f)]


def not_job_keys_inside_sections() -> list[str]:
    """The keys of JOB_SECTIONS that do not (data.prefetch)."""
    return [f"{s}.{key_of(f)}" for s in JOB_SECTIONS for f in schema_fields(s) if not job_key(s, f)]


JOB_KEYS = frozenset(job_keys_outside_sections())
NOT_JOB = frozenset(not_job_keys_inside_sections())
RUNS = "runs"


def job_values(cfg: "Config") -> dict[str, Any]:
    """What `cfg` trains, flat (`model.d_model`, `train.dtype`, ...), model arguments included."""
    out = {}
    for section, values in to_dict(cfg).items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if (section in JOB_SECTIONS and name not in NOT_JOB) or name in JOB_KEYS:
                out[name] = value
    return out


def default_run_dir(path: "str | Path | None", file_cfg: "Config", cfg: "Config") -> str:
    """`runs/<config file name>` for a config in configs/ as it is; with `-<8 hex digits>` after it, a
    fingerprint of the values of what is trained (`job_values`) that the overrides change, resolved and keyed by name (so their
    order, or restating the file's own value, changes nothing). A file elsewhere (two may share a name) is
    fingerprinted by its job values that differ from the built-in defaults, so it always has the suffix;
    with no file at all the name is `builtin`. The same command always gives the same folder: a preempted
    job started again resumes, and a job that trains something else never lands in another's folder."""
    own = path is not None and Path(path).resolve().parent == CONFIGS
    if own:
        name, base, changed = Path(path).stem, file_cfg, {}
    else:
        name, base = (Path(path).stem if path is not None else "builtin"), Config()
        changed = {"from": "built-in defaults"} if path is not None else {}
    before, after = job_values(base), job_values(cfg)
    for key in sorted(before.keys() | after.keys()):
        old, new = (_canonical(d[key]) if key in d else None for d in (before, after))
        if old != new:
            changed[key] = "unset" if new is None else "=" + new
    if not changed:
        return f"{RUNS}/{name}"
    digest = hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]
    return f"{RUNS}/{name}-{digest}"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, reading numbers as people write them. YAML 1.1 (PyYAML's) takes a float only with
    a dot and a signed exponent, so `1e5`, `1E-4` and `3e+2` would be strings: here they are floats, as in
    YAML 1.2 and Python. Strings, booleans and the rest read as before."""


_NUMBER = re.compile(r"""^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$""")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _NUMBER, list("-+0123456789."))


def yaml_load(text: str):
    """Safe YAML (no Python objects are ever built), with every usual spelling of a number read as one."""
    return yaml.load(text, Loader=_Loader)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise UserError(_missing_config_message(path))
    try:
        data = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config file {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return _normalize(data, f"config file {str(path)!r}")


CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _missing_config_message(path: Path) -> str:
    """One line: the file is missing; the config in configs/ it probably means, and which there are."""
    what = "is a folder, not a file" if path.is_dir() else "does not exist"
    available = sorted(p.name for p in CONFIGS.glob("*.yaml")) if CONFIGS.is_dir() else []
    if not available:
        return f"config file {str(path)!r} {what}"
    name = path.name if path.suffix in (".yaml", ".yml") else path.name + ".yaml"
    candidates = [c for c in (path.with_name(name), CONFIGS / name) if c.is_file()] if path.name else []
    if not candidates and path.name:  # a typo: the closest name in configs/
        close = difflib.get_close_matches(name, available, n=1, cutoff=0.75)
        candidates = [CONFIGS / close[0]] if close else []
    hint = f"; did you mean {shown_path(candidates[0])}?" if candidates else ""
    return f"config file {str(path)!r} {what}{hint} ({shown_path(CONFIGS)}/ holds: {', '.join(available)})"


def shown_path(path: Path) -> str:
    """A path as the user would type it from here: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


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
                value = yaml_load(raw) if raw != "" else ""
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
            if choices and getattr(obj, f.name) is not None and getattr(obj, f.name) not in choices:
                raise UserError(f"{section}.{key_of(f)}={getattr(obj, f.name)!r} is not allowed; choose one of: {', '.join(map(str, choices))}")
            value, low, high = getattr(obj, f.name), f.metadata.get("min"), f.metadata.get("max")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if (low is not None and value < low) or (high is not None and value > high):
                    allowed = f"at least {low}" if high is None else f"between {low} and {high}"
                    raise UserError(f"{section}.{key_of(f)}={value} is out of range; it must be {allowed}")
    if not isinstance(cfg.model.name, str) or not cfg.model.name:
        raise UserError("model.name must be a registered model name or package.module:Class")
    step_range(cfg.run.profile_steps, cfg.train.steps)


def step_range(spec: str | None, train_steps: int) -> range | None:
    """'10:15' -> range(10, 15); None -> None. Raises UserError naming what is allowed."""
    if spec is None:
        return None
    start, sep, end = str(spec).partition(":")
    try:
        first, stop = int(start), int(end)
    except ValueError:
        first = stop = None
    if not sep or first is None or not 1 <= first < stop:
        raise UserError(f"run.profile_steps={spec!r} must be START:END with 1 <= START < END, the steps as the log "
                        "numbers them (10:15 traces steps 10 to 14; quote it in YAML: '10:15')")
    if first > train_steps:
        raise UserError(f"run.profile_steps={spec} starts after the last step (train.steps={train_steps})")
    return range(first, min(stop, train_steps + 1))


def _fill_mesh_from_preset(mesh: MeshConfig) -> None:
    """Axis sizes not set explicitly come from the preset, else 1; the preset's rules sit under ours."""
    from shard.core.mesh import AXES, load_preset  # local: mesh imports jax

    preset = {} if mesh.preset == "auto" else load_preset(mesh.preset)  # auto: sizes chosen by the plan
    explicit_wild = any(getattr(mesh, axis) == -1 for axis in AXES)
    for axis in AXES:
        if getattr(mesh, axis) is None:
            size = preset.get(axis, 1)
            setattr(mesh, axis, 1 if size == -1 and explicit_wild else size)  # an explicit -1 wins
    mesh.rules = {**preset.get("rules", {}), **mesh.rules}
    if mesh.zero is None:
        mesh.zero = preset.get("zero", 0)


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


USAGE = "usage: python train.py [CONFIG.yaml] [key=value ...] [--print-config] [--dry-run] [--compare] [--help]"
VALUE_WIDTH = 24  # a longer value puts its key's help on the next line, in the help column
MIN_HELP_WIDTH = 40  # narrower than this beside the values: help goes under each key instead


def help_text(cfg: "Config | None" = None, model_signature: list[tuple[str, str, Any]] | None = None,
              source: str = "", width: int | None = None) -> str:
    """Every key with its type, its value in `cfg` (the built-in default after it where they differ) and help.

    `source` says in a few words where the values come from; `width` wraps the help to a terminal
    (None: one line per key, for grep). Column widths come from the longest key, type and value."""
    shown_cfg = cfg if cfg is not None else Config()
    # Mesh axis sizes and rules left unset come from the preset: theirs is the default to compare with.
    preset_mesh = MeshConfig(preset=shown_cfg.mesh.preset)
    try:
        if cfg is not None:  # (the bare schema's are not filled from the preset either)
            _fill_mesh_from_preset(preset_mesh)
    except UserError:  # an unknown preset: compare with the schema's defaults
        preset_mesh = MeshConfig()
    from_preset = {"replica", "stage", "data", "expert", "fsdp", "context", "tensor", "rules", "zero"}
    rows: list[tuple[str, str, str, str] | str] = []  # (key, type, value, help) or a heading
    for section in SECTIONS:
        rows.append(f"{section}:")
        obj = getattr(shown_cfg, section)
        for f in schema_fields(section):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if section == "mesh" and f.name in from_preset:
                default = getattr(preset_mesh, f.name)
            choices = f.metadata.get("choices")
            low, high = f.metadata.get("min"), f.metadata.get("max")
            extra = f" [{'|'.join(map(str, choices))}]" if choices else ""
            extra += f" [{low}..{high}]" if high is not None else f" [>={low}]" if low is not None else ""
            rows.append((f"{section}.{key_of(f)}", type_name(f.type), _value_text(getattr(obj, f.name), default),
                         f.metadata["help"] + extra))
        if section == "model" and model_signature is None and cfg is not None:
            rows.append(f"  constructor arguments of {shown_cfg.model.name!r}: unknown (the class did not load)")
        if section == "model" and model_signature is not None:
            rows.append(f"  constructor arguments of {shown_cfg.model.name!r} (model.<arg>=value):")
            kwargs = shown_cfg.model.kwargs
            for name, tname, default in model_signature:
                value = kwargs.get(name, default)
                rows.append((f"model.{name}", tname, _value_text(value, default), ""))
            named = {name for name, _, _ in model_signature}
            for name, value in kwargs.items():  # a class that takes **kwargs
                if name not in named:
                    rows.append((f"model.{name}", "any", _value_text(value, value), "not a named constructor argument"))
        rows.append("")

    table = [r for r in rows if isinstance(r, tuple)]
    key_w = max(len(r[0]) for r in table)
    type_w = max(len(r[1]) for r in table)
    value_w = min(VALUE_WIDTH, max(len(r[2]) for r in table))
    help_col = 2 + key_w + 2 + type_w + 2 + value_w + 2
    beside = width is None or width - help_col >= MIN_HELP_WIDTH
    indent = help_col if beside else 6

    def wrapped(text: str) -> list[str]:
        if width is None or not text:
            return [text] if text else []
        return textwrap.wrap(text, max(width - indent, 20), break_long_words=False, break_on_hyphens=False)

    values = (f"Values are what {source} resolves to" if source and cfg is not None else
              "Values are the built-in defaults" + (f" ({source})" if source else ""))
    header = [f"Each key with its type, value and help. {values}; where a value differs from the built-in "
              "default, \"(default X)\" follows it (for mesh axis sizes and rules: the preset's). Set keys in the "
              "YAML file or as key=value; the command line wins.",
              "Allowed values are in [ ]; the model.* keys after model.name are the model class's constructor "
              "arguments."]
    lines = (textwrap.wrap(USAGE, width, subsequent_indent=" " * 6, break_on_hyphens=False) if width else [USAGE])
    lines.append("")
    for paragraph in header:
        lines += textwrap.wrap(paragraph, width) if width else [paragraph]
    lines.append("")
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
            continue
        key, tname, value, help_ = row
        first = f"  {key:<{key_w}}  {tname:<{type_w}}  {value}"
        help_lines = wrapped(help_)
        if beside and help_lines and len(value) <= value_w:
            first = f"  {key:<{key_w}}  {tname:<{type_w}}  {value:<{value_w}}  {help_lines.pop(0)}"
        lines.append(first.rstrip())
        lines += [" " * indent + line for line in help_lines]
    return "\n".join(lines).rstrip()


def _value_text(value: Any, default: Any) -> str:
    """A value as one would write it in YAML or key=value; the default after it where they differ."""
    text = _yaml_text(value)
    if isinstance(default, str) and default == "(required)":  # the signature's marker: no default
        return text
    try:
        same = bool(_plain(value) == _plain(default))
    except Exception:  # values whose == is not a plain answer (arrays)
        same = value is default
    return text if same else f"{text} (default {_yaml_text(default)})"


def _yaml_text(value: Any) -> str:
    try:
        return yaml.safe_dump(_plain(value), default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()
    except yaml.YAMLError:  # not plain data (a dtype, a function): Python's own spelling
        return repr(value)
