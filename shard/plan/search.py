"""mesh=auto for a run.target: search the mesh, the remat policy and the microbatch count, then compile the best.

Every factorization of the target's devices into the canonical axes that the model's dimensions allow, times
train.remat (none, dots, qkv, attention, full; offload only as configured) and train.grad_accum (1, 2, 4, where the
batch divides), is first ranked by formulas (no compiling): the state's bytes per device from the shardings (exact),
activations by Korthikanti et al.'s per-layer count, compute over the chip's peak and the ZeRO / Megatron
communication volumes over its links. The `run.search_compiles` best that fit, and every mesh preset as configured
(the baselines a person would try), are then compiled for the target, and the winner is the fastest by the
compiler's own step estimate (the TPU compiler's; the plan's compiled estimate where the compiler gives none) among
those that fit.
"""

import dataclasses
import math
import time
from dataclasses import replace

from shard.nn import partition
from shard.plan import analysis, meshes
from shard.core import mesh as mesh_lib
from shard.core import state as state_lib
from shard.errors import UserError
from shard.plan import hardware
from shard.plan import target as target_lib
from shard.run import job
from shard.strategies.base import mb

# train.remat=offload is searched only as configured (the presets' baselines): what it costs is its transfers over
# the host link, which no chip figure here gives, so by formula it would look like full's memory at dots' compute.
REMATS = ("none", "dots", "qkv", "attention", "full")
ACCUMS = (1, 2, 4)
# A step is 3 forwards' work (forward, backward twice); a policy adds the share of the forward it recomputes. A
# GPT layer's forward per token: 6 h^2 query/key/value projections, 2 h^2 output projection, 16 h^2 MLP, plus the
# attention itself. dots recomputes the elementwise work; qkv everything but the projections it keeps (about 3/4);
# attention as much: it keeps attention's output, but a fused kernel's backward (splash, cuDNN: what a target runs)
# reruns its forward for the statistics it did not keep (gpt_1b on a v5p-8: the compiler counts qkv's FLOPs);
# offload recomputes what dots does.
RECOMPUTE = {"none": 1.0, "dots": 1.1, "qkv": 1.25, "attention": 1.25, "full": 4 / 3, "offload": 1.1}
# Share of a layer's ACTIVATION_WIDTHS kept in device memory for the backward: qkv keeps 3 of the 17 widths (query,
# key, value), attention 4 (and attention's output), a grouped-query model less; offload keeps dots' on the host.
KEPT = {"none": 1.0, "dots": 0.4, "qkv": 3 / 17, "attention": 4 / 17, "full": 0.0, "offload": 0.0}
# values of d_model kept per token per layer without remat (Korthikanti et al.: 34 sbh bytes in 16-bit)
ACTIVATION_WIDTHS = 17


@dataclasses.dataclass
class Candidate:
    label: str
    preset: str
    sizes: dict
    remat: str
    accum: int
    memory: float = 0.0     # bytes per device, by formula
    estimate: float = 0.0   # seconds per step, by formula
    baseline: bool = False  # a preset as configured: always compiled


def enumerate_candidates(cfg, work, n: int) -> list[Candidate]:
    out = []
    remats = REMATS if cfg.train.remat in REMATS else (*REMATS, cfg.train.remat)
    for label, sizes in meshes.candidate_meshes(n, sequences=work.data.task == "lm"):
        preset = sizes.pop("preset")
        for remat in remats:
            for accum in ACCUMS:
                baseline = " x " not in label and "=" not in label and remat == cfg.train.remat \
                    and accum == cfg.train.grad_accum
                if remat in REMATS or baseline:
                    out.append(Candidate(label, preset, sizes, remat, accum, baseline=baseline))
    return out


def configured(cfg, c: Candidate):
    preset = mesh_lib.load_preset(c.preset)
    mesh = replace(cfg.mesh, preset=c.preset, rules={**preset.get("rules", {}), **cfg.mesh.rules},
                   zero=preset.get("zero", 0), **c.sizes)
    return replace(cfg, mesh=mesh, train=replace(cfg.train, remat=c.remat, grad_accum=c.accum))


def estimate(cfg, work, c: Candidate, peak: float, link: float) -> bool:
    """Fill c's memory and step time by formula; False when the model leaves an axis idle (skip it)."""
    s = c.sizes
    params = work.abstract.params
    rules = partition.merged_rules(configured(cfg, c).mesh.rules, mesh_lib.AXES)
    try:
        rows = state_lib.split_report(params, s, rules, state_lib.auto_min_size(cfg.mesh))
    except UserError:  # the model's dimensions do not divide this mesh
        return False
    if meshes.renamed_mesh(rows, params, s, rules):
        return False
    psi = sum(r["bytes"] for r in rows)
    per_device = sum(r["bytes"] / math.prod(s[a] for e in r["spec"] for a in partition.axes_of(e)) for r in rows)
    optimizer = state_lib.shard_bytes(work.abstract.opt_state) / max(psi, 1)  # e.g. 2 for Adam's moments
    zero = mesh_lib.load_preset(c.preset).get("zero", 0) if s["data"] > 1 else 0
    state = per_device * (1 + optimizer / (s["data"] if zero >= 1 else 1) + 1 / (s["data"] if zero >= 2 else 1))
    width, layers = work.kwargs.get("d_model"), (work.stacks[0] if work.stacks else 1)
    batch_shape = work.batch.get("targets", work.batch["inputs"]).shape  # (GRPO's batches are prompts alone)
    tokens = math.prod(batch_shape[:2]) / (s["data"] * s["fsdp"] * s["context"] * s["replica"] * c.accum)
    act_bytes = work.dtype.itemsize
    activations = 0.0
    if width:
        per_layer = tokens * width * act_bytes
        activations = layers / s["stage"] * per_layer * (1 + ACTIVATION_WIDTHS * KEPT[c.remat] / s["tensor"])
    c.memory = state + activations
    stages = s["stage"]
    micro = cfg.pipeline.microbatches or 2 * stages
    bubble = (stages - 1) / (micro + stages - 1) if stages > 1 else 0.0
    compute = work.flops_per_step / math.prod(s.values()) * RECOMPUTE[c.remat] / peak / (1 - bubble)
    model_split = s["tensor"] * s["stage"] * s["expert"]
    wire = 2 * psi * (s["data"] - 1) / s["data"] / (s["fsdp"] * model_split)                  # gradient all-reduce
    wire += (2 * c.accum + 1) * psi * (s["fsdp"] - 1) / s["fsdp"] / model_split               # ZeRO-3 per microbatch
    if width:
        activation = tokens * width * act_bytes
        wire += 8 * 2 * (s["tensor"] - 1) / s["tensor"] * activation * layers / stages * c.accum  # Megatron f, g
        wire += 4 * (s["context"] - 1) * activation / s["tensor"] * layers / stages * c.accum    # keys, values
    c.estimate = compute + wire / (link * 1e9)
    return True


def search(cfg, devices: list, compiles: int) -> tuple[list[dict], float, int]:
    """Rows for every compiled candidate (ranked), the seconds spent compiling, and how many were ranked."""
    target = target_lib.of(cfg.run)
    run = target_lib.with_figures(cfg.run, target, len(devices))
    peak, link = hardware.peak_flops(devices[0], run.peak_tflops), hardware.link_gbps(devices[0], run.link_gbps)
    capacity = run.device_memory_gb * 1e9
    work = job.workload(cfg, devices)
    ranked = [c for c in enumerate_candidates(cfg, work, len(devices)) if estimate(cfg, work, c, peak, link)]
    ranked.sort(key=lambda c: c.estimate)
    chosen = [c for c in ranked if c.memory <= capacity][:compiles]
    chosen += [c for c in ranked if c.baseline and c not in chosen]
    rows, start = [], time.perf_counter()
    for c in chosen:
        row = {"label": c.label, "preset": c.preset, "remat": c.remat, "grad_accum": c.accum, "baseline": c.baseline,
               "formula_step_s": c.estimate, "formula_memory": c.memory}
        try:
            rows.append({**row, **analysis.analyse(configured(cfg, c), devices, work)})
        except UserError as e:
            rows.append({**row, "skipped": str(e)})
    seconds = time.perf_counter() - start
    rows.sort(key=meshes.compiler_rank)
    return rows, seconds, len(ranked)


def table(rows: list[dict]) -> str:
    head = (f"{'#':>2} {'mesh':<30} {'remat':<9} {'accum':>5} {'formula':>9} {'memory/chip':>12} {'fits':<4} "
            f"{'FLOPs/chip':>10} {'sends/chip':>11} {'compiler est.':>13}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        name = r["label"] + (" *" if r["baseline"] else "")
        if "skipped" in r:
            lines.append(f"{i:>2} {name:<30} {r['remat']:<9} {r['grad_accum']:>5} skipped: {r['skipped']}")
            continue
        mem, c = r["memory_per_device"], r["compiler"] or {}
        step = c.get("step_s")
        lines.append(f"{i:>2} {name:<30} {r['remat']:<9} {r['grad_accum']:>5} {r['formula_step_s'] * 1e3:>7.3g}ms "
                     f"{mb(mem['total']):>12} {'yes' if mem['fits'] is not False else 'no':<4} "
                     f"{c.get('flops_per_device') or 0:>10.3g} {mb(r['wire_bytes_per_device']):>11} "
                     + (f"{step * 1e3:>11.3g}ms" if step else f"{'-':>13}"))
    return "\n".join(lines)


def apply(cfg, devices: list):
    """mesh=auto with a run.target: the search, its table and the chosen config (mesh, remat, grad_accum)."""
    rows, seconds, considered = search(cfg, devices, cfg.run.search_compiles)
    print(f"mesh=auto for {target_lib.of(cfg.run).describe()}: {considered} candidates ranked by formula, "
          f"{len(rows)} compiled in {seconds:.0f} s (the {cfg.run.search_compiles} best that fit by formula, and "
          "the presets as configured, marked *); ranked by the compiler's step estimate:")
    print(table(rows))
    ok = [r for r in rows if "skipped" not in r and r["memory_per_device"]["fits"] is not False]
    if not ok:
        raise UserError(f"mesh=auto: nothing compiled fits {cfg.run.target}'s memory; lower data.batch_size or the "
                        "model's size, or pick a bigger target")
    best = ok[0]
    c = Candidate(best["label"], best["preset"], best["mesh"], best["remat"], best["grad_accum"])
    print(f"mesh=auto chose {best['label']}, remat={best['remat']}, grad_accum={best['grad_accum']}")
    return configured(cfg, c)
