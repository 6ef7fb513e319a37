"""`--compare` and mesh=auto: every candidate mesh of the devices (the presets and every factorization into the
canonical axes that the model's dimensions allow) planned with one workload, the table of them, compare.json and
compare.png, and the choice mesh=auto trains with (the fastest estimate that fits).
"""

import itertools
import math
from dataclasses import fields, replace

import jax
from flax import nnx

from shard import paths
from shard.core import mesh as mesh_lib
from shard.core import state as state_lib
from shard.errors import UserError
from shard.nn import partition
from shard.observe import plot
from shard.plan.analysis import analyse, write
from shard.run import job
from shard.strategies.base import mb


def candidate_meshes(n_devices: int, sequences: bool = False) -> list[tuple[str, dict]]:
    """Every preset, and every way to write n_devices as stage x data x expert x fsdp x context x tensor
    (context only for `sequences`: language-model data); a mesh that is the same as an earlier one (axis
    sizes, rules as they map onto axes larger than 1, ZeRO stage) is listed once, under all its names."""
    out, seen = [], {}  # seen: _layout -> index in out
    for name in mesh_lib.preset_names():
        preset = mesh_lib.load_preset(name)
        try:
            sizes = mesh_lib.resolve_sizes({a: preset.get(a, 1) for a in mesh_lib.AXES}, n_devices)
        except UserError:  # e.g. hybrid's tensor=2 on an odd device count
            continue
        if sizes["context"] > 1 and not sequences:
            continue
        key = _layout(sizes, preset.get("rules", {}), preset.get("zero", 0) if sizes["data"] > 1 else 0)
        if key in seen:  # e.g. on one device every preset is the same mesh
            label, mesh = out[seen[key]]
            out[seen[key]] = (f"{label} = {name}", mesh)
            continue
        seen[key] = len(out)
        out.append((name, {"preset": name, **sizes}))
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    axes = mesh_lib.AXES[1:]  # not `replica`: under train.sync=allreduce it is the data axis again
    for split in itertools.product(divisors, repeat=len(axes)):
        shape = (1, *split)
        context = shape[mesh_lib.AXES.index("context")]
        key = _layout(dict(zip(mesh_lib.AXES, shape)), {}, 0)
        if math.prod(shape) == n_devices and key not in seen and (sequences or context == 1):
            seen[key] = len(out)
            out.append((" x ".join(f"{a}={s}" for a, s in zip(mesh_lib.AXES, shape) if s > 1) or "1 device",
                        {"preset": "dp", **dict(zip(mesh_lib.AXES, shape))}))
    return out


def _layout(sizes: dict, rules: dict, zero: int) -> tuple:
    """What makes two candidates one mesh: the axis sizes, the rules as they map onto axes larger than 1 (a rule
    naming only axes of size 1 splits nothing), and the ZeRO stage."""
    merged = partition.merged_rules(rules, mesh_lib.AXES)
    return (tuple(sizes.values()), tuple(sorted((name, tuple(a for a in partition.axes_of(target) if sizes[a] > 1))
                                                for name, target in merged.items())), zero)


def compare(cfg, devices: list, schedules: bool = False) -> list[dict]:
    """analyse() for every candidate mesh the model's dimensions allow, with one workload (model,
    data, optimizer, FLOPs) built once. A mesh is skipped when the model's dimensions do not divide
    it, or when it is another mesh under a renamed axis (renamed_mesh: e.g. `expert` for a model without
    experts, data parallel or, under `ep`'s rules, fsdp under another name). `schedules` (--compare): a
    pipelined mesh also under every other `pipeline.schedule`, a row each."""
    work = job.workload(cfg, devices)
    params = work.abstract.params
    auto_min = state_lib.auto_min_size(cfg.mesh)
    rows = []
    for label, sizes in candidate_meshes(len(devices), sequences=work.data.task == "lm"):
        preset = sizes.pop("preset")
        chosen = mesh_lib.load_preset(preset)
        mesh_cfg = replace(cfg.mesh, preset=preset, rules=dict(chosen.get("rules", {})), zero=chosen.get("zero", 0),
                           **sizes)
        try:
            rules = partition.merged_rules(mesh_cfg.rules, mesh_lib.AXES)
            renamed = renamed_mesh(state_lib.split_report(params, sizes, rules, auto_min), params, sizes, rules)
        except UserError as e:  # e.g. heads not divisible by the tensor axis
            renamed = str(e)
        if renamed:
            rows.append({"label": label, "skipped": renamed})
            continue
        rows.append(_row(label, preset, replace(cfg, mesh=mesh_cfg), devices, work))
        if "skipped" in rows[-1]:
            continue
        for schedule in pipeline_schedules(cfg) if schedules and sizes["stage"] > 1 else ():
            rows.append(_row(f"{label}, {schedule}", preset,  # (a model whose stacked layers 1F1B refuses: skipped)
                             replace(cfg, mesh=mesh_cfg, pipeline=replace(cfg.pipeline, schedule=schedule)), devices,
                             work))
    return rows


def _row(label: str, preset: str, cfg, devices: list, work) -> dict:
    """compare's row of one configuration: analyse()'s plan, or why it was skipped."""
    try:
        return {"label": label, "preset": preset, **analyse(cfg, devices, work)}
    except UserError as e:
        return {"label": label, "skipped": str(e)}


def pipeline_schedules(cfg) -> list[str]:
    """The `pipeline.schedule` choices (the schema's) other than cfg's."""
    choices = next(f for f in fields(cfg.pipeline) if f.name == "schedule").metadata["choices"]
    return [s for s in choices if s != cfg.pipeline.schedule]


def renamed_mesh(rows: list[dict], params, sizes: dict, rules: dict) -> str | None:
    """Why a candidate is another mesh under a renamed axis (skipped), or None: an axis besides `data` that splits
    no parameter (data parallel renamed), or an `expert` axis that splits no mixture of experts' experts (a model
    without experts under `ep`, whose rules split the rest of the model on it: fsdp renamed)."""
    idle = state_lib.idle_axes(rows, sizes)
    if idle:
        return f"no parameter is split on {', '.join(idle)}"
    if sizes["expert"] > 1 and not _splits_experts(params, sizes, rules):
        return "no experts are split on expert (fsdp or data parallel under another name)"
    return None


def _splits_experts(params, sizes: dict, rules: dict) -> bool:
    """Whether the `expert` axis splits some parameter's `experts` dimension."""
    for var in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = partition.logical_names(var)
        if names and "experts" in names:
            spec = partition.logical_to_spec(names, rules, sizes)
            if "expert" in partition.axes_of(spec[list(names).index("experts")]):
                return True
    return False


def apply_auto(cfg, devices: list):
    """mesh=auto: cfg with the chosen mesh, saying which and why (process 0); any other mesh: cfg as it is.
    The one place mesh=auto is resolved (train.py calls it before the dry run or the trainer)."""
    if cfg.mesh.preset != "auto":
        return cfg
    cfg, why = chosen_config(cfg, compare(cfg, devices))
    if jax.process_index() == 0:
        print(why)
    return cfg


def chosen_config(cfg, rows: list[dict]):
    """cfg with mesh=auto replaced by the chosen mesh, and the one line that says why."""
    best, why = choose(rows)
    preset = mesh_lib.load_preset(best["preset"])
    rules = {**preset.get("rules", {}), **cfg.mesh.rules}
    return replace(cfg, mesh=replace(cfg.mesh, preset=best["preset"], rules=rules, zero=preset.get("zero", 0),
                                     **best["mesh"])), why


def compiler_rank(r: dict) -> tuple:
    """Sort key: rows that fit first, by the target compiler's step estimate; after those, rows it gave
    none for, by the plan's estimate; skipped rows last."""
    if "skipped" in r:
        return (2, 1, 0.0)
    compiler = (r.get("compiler") or {}).get("step_s")
    plan_s = r["estimated_step_s"] if r["estimated_step_s"] is not None else r.get("formula_step_s", math.inf)
    return (0 if r["memory_per_device"]["fits"] is not False else 1, 0 if compiler else 1, compiler or plan_s)


def comparison_table(rows: list[dict]) -> str:
    """One line a mesh; for a run.target ranked by the compiler's estimate, with its column."""
    compiled = any((r.get("compiler") or {}).get("step_s") for r in rows if r.get("target"))
    if compiled:
        rows = sorted(rows, key=compiler_rank)
    head = f"{'mesh':<36} {'memory/device':>14} {'sends/device':>14} {'est. step':>11}  fits" \
        + ("  compiler est." if compiled else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            continue
        est = f"{r['estimated_step_s'] * 1e3:.3g} ms" if r["estimated_step_s"] is not None else "?"
        fits = {True: "yes", False: "no", None: "?"}[r["memory_per_device"]["fits"]]
        step = (r.get("compiler") or {}).get("step_s")
        lines.append(f"{r['label']:<36} {mb(r['memory_per_device']['total']):>14} "
                     f"{mb(r['wire_bytes_per_device']):>14} {est:>11}  {fits:<4}"
                     + ((f"  {step * 1e3:.3g} ms" if step else "  -") if compiled else ""))
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        lines.append(f"skipped {len(skipped)}:")
        lines += [f"  {r['label']}: {r['skipped']}" for r in skipped]
    return "\n".join(lines)


def choose(rows: list[dict]) -> tuple[dict, str]:
    """The fastest estimated mesh that fits (unknown memory counts as fitting), and why, in one line."""
    ok = [r for r in rows if "skipped" not in r and r["memory_per_device"]["fits"] is not False]
    if not ok:
        raise UserError("mesh=auto: no mesh fits the device memory; lower the batch size or the model size")
    key = (lambda r: (r["estimated_step_s"], r["memory_per_device"]["total"])) \
        if all(r["estimated_step_s"] is not None for r in ok) else \
        (lambda r: (r["wire_bytes_per_device"], r["memory_per_device"]["total"]))
    basis = "fastest estimated step" if all(r["estimated_step_s"] is not None for r in ok) else \
        "fewest bytes sent per device (device speed unknown: set run.peak_tflops and run.link_gbps)"
    if all((r.get("compiler") or {}).get("step_s") for r in ok if r.get("target")) and ok[0].get("target"):
        key, basis = compiler_rank, "fastest step by the target compiler's estimate"
    best = min(ok, key=key)
    if all(r["memory_per_device"]["fits"] is None for r in ok):
        among = (f"of {len(ok)} meshes (whether they fit is unknown: this device reports no memory limit; "
                 "set run.device_memory_gb)")
    else:
        among = f"of {len(ok)} meshes that fit"
    why = (f"mesh=auto chose {best['label']}: {basis} {among} "
           f"({mb(best['memory_per_device']['total'])} per device, sends {mb(best['wire_bytes_per_device'])})")
    return best, why


def write_config(cfg, path: str):
    """cfg (mesh=auto resolved) as a config file that trains as it is: on the target's hardware, so without
    run.target; the run folder is left to follow the file's name. Never over another file."""
    from shard import config as config_lib
    from shard.core import registry

    out = paths.resolve(path)
    if out.exists():
        raise UserError(f"--write-config {path}: the file exists; give a new name (nothing is overwritten)")
    aimed = cfg.run.target
    cfg = replace(cfg, run=replace(cfg.run, target=None, target_slices=1, dir=None, cpu_devices=None))
    model_cls, kwargs = registry.load(cfg.model)
    head = f"# written by mesh=auto for run.target={aimed}: train it there with python train.py {path}\n" \
        if aimed else "# written by mesh=auto\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(head + config_lib.to_yaml(cfg, model_kwargs=registry.with_defaults(model_cls, kwargs)))
    return out


def write_comparison(run_dir: str, rows: list[dict]) -> list:
    """compare.json, and compare.png beside it: memory per device against estimated step per mesh,
    the one mesh=auto would take marked (none when none fits)."""
    try:
        chosen = choose(rows)[0]["label"]
    except UserError:
        chosen = None
    picture = paths.resolve(run_dir) / "compare.png"
    plot.save(plot.draw_comparison(rows, chosen), picture)
    return [write(run_dir, rows, "compare.json"), picture]
