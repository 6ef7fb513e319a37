"""The `--help` text: every key with its type, its value, the default where that differs, and its help,
in columns that line up (and wrap to a terminal's width)."""

import dataclasses
import textwrap
from typing import Any

import yaml

from shard.config.loading import fill_mesh_from_preset
from shard.config.naming import JOB_KEYS
from shard.config.schema import SECTIONS, Config, MeshConfig, keys_of, plain, type_name
from shard.errors import UserError

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
            fill_mesh_from_preset(preset_mesh)
    except UserError:  # an unknown preset: compare with the schema's defaults
        preset_mesh = MeshConfig()
    from_preset = {"replica", "stage", "data", "expert", "fsdp", "context", "tensor", "rules", "zero"}
    rows: list[tuple[str, str, str, str] | str] = []  # (key, type, value, help) or a heading
    for section in SECTIONS:
        rows.append(f"{section}:")
        obj = getattr(shown_cfg, section)
        for key, f, attrs in keys_of(section):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if section == "mesh" and f.name in from_preset:
                default = getattr(preset_mesh, f.name)
            value = obj
            for attr in attrs:
                value = getattr(value, attr)
            choices = f.metadata.get("choices")
            low, high = f.metadata.get("min"), f.metadata.get("max")
            extra = f" [{'|'.join(map(str, choices))}]" if choices else ""
            extra += " [picks the folder]" if key in JOB_KEYS else ""
            extra += f" [{low}..{high}]" if high is not None else f" [>={low}]" if low is not None else ""
            rows.append((key, type_name(f.type), _value_text(value, default), f.metadata["help"] + extra))
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
        same = bool(plain(value) == plain(default))
    except Exception:  # values whose == is not a plain answer (arrays)
        same = value is default
    return text if same else f"{text} (default {_yaml_text(default)})"


def _yaml_text(value: Any) -> str:
    try:
        return yaml.safe_dump(plain(value), default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()
    except yaml.YAMLError:  # not plain data (a dtype, a function): Python's own spelling
        return repr(value)
