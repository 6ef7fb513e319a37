"""The run folder a job gets when `run.dir` is not set: `runs/<config file name>`, with `-<8 hex digits>`
when the command line changes what is trained. Which keys count as "what is trained" is decided here
alone, from the schema's `job` flags; the README's list is tested against it (tests/test_readme.py)."""

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from shard.config.schema import SECTIONS, Config, key_of, keys_of, schema_fields, to_dict

# The repository's configs/ folder: a config file there names its runs alone (`runs/default`).
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# What a run trains picks its folder: every key of these sections, and the keys of other sections marked
# `job=True` (a key of these sections may opt out with `job=False`). Every other key may change between a run
# and its resumption, so it keeps the folder: train.steps, eval, sample and log settings, the mesh (a checkpoint
# restores onto any mesh), speed and memory knobs (remat, attention, prefetch, deterministic kernels,
# grad_accum, offload) and what a non-finite step does (nonfinite, skip_nonfinite, max_rollbacks: the NaN error
# says to rerun with them; they change nothing until a step is not finite). A new key that changes what is
# trained says `job=True`.
JOB_SECTIONS = ("model", "data", "optimizer")


def job_key(section: str, f: dataclasses.Field) -> bool:
    job = f.metadata.get("job")
    return section in JOB_SECTIONS if job is None else job


def job_keys_outside_sections() -> list[str]:
    """The keys outside JOB_SECTIONS that change what is trained, in schema order."""
    return [key for s in SECTIONS if s not in JOB_SECTIONS for key, f, _ in keys_of(s) if job_key(s, f)]


def not_job_keys_inside_sections() -> list[str]:
    """The keys of JOB_SECTIONS that do not (data.prefetch, data.cache_dir)."""
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
    fingerprint of the values of what is trained (`job_values`) that the overrides change, resolved and keyed by
    name (so their order, or restating the file's own value, changes nothing). A file elsewhere (two may share a
    name) is fingerprinted by its job values that differ from the built-in defaults, so it always has the suffix;
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
