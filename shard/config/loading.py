"""Loading a config: a YAML file plus `key=value` overrides, parsed, checked against the schema, merged
over its defaults (OmegaConf) and completed (the run folder, mesh sizes from the preset). Raises
UserError, one line saying what is wrong; `to_yaml` writes a config back as a user would."""

import difflib
import functools
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shard.config.naming import CONFIGS, default_run_dir
from shard.config.schema import (SECTIONS, Config, MeshConfig, key_of, keys_of, renamed, schema_fields, to_dict,
                                 type_name)
from shard.errors import UserError
from shard.paths import yaml_load
from shard.run import badsteps


def load(path: "str | Path | None", overrides: list[str], sections: tuple | None = None,
         planning: bool = False) -> "Config":
    """YAML file (optional) + `key=value` overrides -> a validated Config. Raises UserError.

    `sections`: read only these sections of the file (a finished run's model and training settings, say,
    without the mesh and devices it ran on). `run.dir`, unless the file or an override sets it, is derived
    from what the job trains (`default_run_dir`). `planning`: the config is only planned (--dry-run, --compare),
    so a train.init_from folder needs neither weights nor a tokenizer (shard/hf/config_only.py)."""
    layers = []
    if path is not None:
        layer = _read_yaml(Path(path))
        layers.append(layer if sections is None else {k: v for k, v in layer.items() if k in sections})
    if layers and ((layers[0].get("train") or {}).get("grpo") or {}).get("trust_code"):
        raise UserError(f"{path} sets train.grpo.trust_code: only the command line can (train.grpo.trust_code=true), "
                        "so that no file turns on running the code it names")
    layers.append(_parse_overrides(overrides))
    # A new run's train.init_from naming a Hugging Face folder: its settings under the command line, over the
    # file (a finished run's config.yaml already holds them, maybe changed on its command line).
    if sections is None and (imported := _hf_layer(layers, planning)) is not None:
        layers.insert(len(layers) - 1, imported)
    for layer in layers:
        _check_keys(layer)
    cfg = _merge(layers)
    _check_values(cfg)
    if cfg.run.dir is None:
        cfg.run.dir = default_run_dir(path, _merge(layers[:-1]), cfg)
    fill_mesh_from_preset(cfg.mesh)
    return cfg


def _hf_layer(layers: list[dict], planning: bool) -> dict | None:
    """Where train.init_from is a Hugging Face folder: its model (config.json) and, for documents unless
    data.tokenizer is set, its tokenizer (refused in one line where it has none), as a layer of settings. A plan
    takes a folder without weights (config.json alone) and, where it has no tokenizer, reads the documents as
    bytes (shard/hf/config_only.py)."""
    from shard import hf
    from shard.data import tokenizer_files
    from shard.hf import config_only

    init_from = next((v for layer in reversed(layers) if (v := (layer.get("train") or {}).get("init_from"))), None)
    if not hf.is_folder(init_from):
        return None
    from shard.hf.arch import model_name
    from shard.hf.read import Folder

    folder = Folder(init_from, weights=not planning)
    kwargs = folder.gpt_kwargs()
    layer = {"model": {"name": model_name(folder.kind, kwargs), **kwargs}}
    data = [given.get("data") or {} for given in layers]
    documents = next((d["name"] for d in reversed(data) if d.get("name")), _schema().data.name) == "documents"
    if documents and not any(d.get("tokenizer") for d in data):
        if planning and not config_only.has_tokenizer(init_from):
            layer["data"] = {"tokenizer": tokenizer_files.BYTES}  # a compile does not depend on the tokens' values
            return layer
        tokenizer_files.find(init_from, "train.init_from")  # text needs the model's tokenizer, never bytes
        layer["data"] = {"tokenizer": init_from}
    return layer


def _merge(layers: list[dict]) -> "Config":
    """The layers over the schema's defaults, later ones winning; model arguments kept in model.kwargs."""
    model_kwargs: dict = {}
    merged = _schema()
    for layer in layers:
        model = layer.get("model") or {}
        if model.get("name", merged.model.name) != merged.model.name:
            model_kwargs = {}  # another model: the earlier layer's arguments were for the old one
        model_kwargs.update({k: v for k, v in model.items() if k != "name"})
        layer = renamed(dict(layer, model={"name": model["name"]} if "name" in model else {}), to_field=True)
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
    if expected and any(s in msg for s in ("could not be converted", "is not a subclass", "Invalid type",
                                           "is not a valid")):
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


def _check_values(cfg: Config) -> None:
    for section in SECTIONS:
        for key, f, attrs in keys_of(section):  # a group's keys (train.lora.base) one by one
            value = getattr(cfg, section)
            for attr in attrs:
                value = getattr(value, attr)
            choices = f.metadata.get("choices")
            if choices and value is not None and value not in choices:
                raise UserError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, choices))}")
            low, high = f.metadata.get("min"), f.metadata.get("max")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if (low is not None and value < low) or (high is not None and value > high):
                    allowed = f"at least {low}" if high is None else f"between {low} and {high}"
                    raise UserError(f"{key}={value} is out of range; it must be {allowed}")
    if not isinstance(cfg.model.name, str) or not cfg.model.name:
        raise UserError("model.name must be a registered model name or package.module:Class")
    step_range(cfg.run.profile_steps, cfg.train.steps)
    badsteps.check(cfg)
    if cfg.data.mixture:  # before the run's folder is made
        from shard.data.mixture import check

        check(cfg.data.mixture, cfg.data.path)


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


def fill_mesh_from_preset(mesh: MeshConfig) -> None:
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


def to_yaml(cfg: Config, model_kwargs: dict | None = None) -> str:
    """The config as YAML, as a user writes it (`to_dict`), keys in schema order."""
    written = to_dict(cfg, model_kwargs)
    if written.get("train", {}).get("grpo", {}).get("trust_code"):  # trust is given again on each command line
        written["train"]["grpo"]["trust_code"] = False
    return yaml.safe_dump(written, sort_keys=False)
