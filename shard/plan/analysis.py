"""One job's plan (`--dry-run`): its train step compiled, never run, and read for memory per device (XLA's memory
analysis and the state's shardings), FLOPs, collectives and their bytes (hlo.py), and the estimated step time
(hardware.py): compute plus communication with no overlap. `report` prints it, `write` saves plan.json.
"""

from __future__ import annotations  # `job.Workload` in a signature

import json
from dataclasses import replace

import jax

from shard import paths
from shard.core import mesh as mesh_lib
from shard.core import state as state_lib
from shard.hf import config_only
from shard.errors import UserError
from shard.nn import partition
from shard.plan import hardware, hlo
from shard.plan import target as target_lib
from shard.run import job
from shard.strategies import registry as strategies
from shard.strategies.base import mb


def _on_host(leaf) -> bool:
    return getattr(getattr(leaf, "sharding", None), "memory_kind", None) == "pinned_host"


def _gradient_bytes(abstract_params, prepared) -> int:
    """Bytes of the gradients as the step keeps them per device: split like the parameters, unless a strategy
    keeps them in another layout (ZeRO-2 with microbatches: the optimizer state's split)."""
    kept = [g for s in prepared.strategies if (g := s.gradient_shardings(prepared)) is not None]
    layout = kept[0] if kept else prepared.shardings.params
    return state_lib.shard_bytes(jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                     abstract_params, layout))


def analyse(cfg, devices: list, work: job.Workload | None = None) -> dict:
    """Compile the train step for cfg's mesh on these devices and read out its costs (the workload
    is built here unless given: --compare builds it once for every mesh)."""
    try:
        prepared = job.prepare(cfg, devices, work, training=False, flags=target_lib.compiler_flags(cfg.run, devices[0]))
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program larger than the chip's memory
        where = cfg.run.target or "the device"
        if "RESOURCE_EXHAUSTED" in str(e):
            raise UserError(target_lib.out_of_memory(str(e), where)) from None
        if "INTERNAL" in str(e) or "UNIMPLEMENTED" in str(e):  # the compiler's own failure, not the program's
            raise UserError(target_lib.compiler_failed(str(e), where)) from None
        raise
    work = prepared.work
    step = prepared.train_step
    n = len(devices)
    memory = step.memory_analysis()
    sharded = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), prepared.abstract,
                           prepared.shardings)
    text = step.as_text()
    ops = hlo.collectives(text, n)
    table, wire = hlo.summary(ops)
    wire += sum(s.wire_bytes(prepared, n) for s in prepared.strategies)  # outside the step (e.g. DiLoCo's syncs)
    flops_device = work.flops_per_step / n  # the step's model FLOPs split evenly over the devices
    total = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes \
        + memory.temp_size_in_bytes
    # Host offload: the state kept in pinned host memory. Where XLA's analysis does not count host memory apart
    # (the CPU backend, whose "host" and "device" are the same RAM), it is taken out of the device total here.
    host = state_lib.shard_bytes([leaf for leaf in jax.tree.leaves(sharded) if _on_host(leaf)])
    if host and not memory.host_argument_size_in_bytes:
        total -= host
    target = target_lib.of(cfg.run)
    run = target_lib.with_figures(cfg.run, target, n) if target else cfg.run  # the chip's figures, unless set
    capacity = hardware.memory_bytes(devices[0], run.device_memory_gb)
    peak = hardware.peak_flops(devices[0], run.peak_tflops)
    link = hardware.link_gbps(devices[0], run.link_gbps)
    idle = max((s.idle_share() for s in prepared.strategies), default=0.0)
    estimate = None
    if peak and link:  # a pipeline's stages idle through its bubble: the compute takes 1/(1 - bubble) longer
        estimate = flops_device / peak / (1 - idle) + wire / (link * 1e9)
    return {
        "devices": n,
        "device_kind": getattr(devices[0], "device_kind", devices[0].platform),
        "target": target.describe() if target else None,
        "mesh": {a: int(prepared.mesh.shape[a]) for a in mesh_lib.AXES},
        "param_count": state_lib.count_params(work.abstract.params),
        "flops_per_step": work.flops_per_step,
        "flops_per_device": flops_device,
        "executed_flops_per_device": hlo.dot_flops(text),
        "uncounted_kernel_runs": (lambda k: k.attention_unestimated + k.grouped_unestimated)(hlo.kernels(text)),
        "data_dependent_loops": hlo.data_dependent_loops(text),
        "matrix_products": hlo.dot_types(text),  # executions per step by operand type
        "memory_per_device": {
            "params": state_lib.shard_bytes(sharded.params) + state_lib.shard_bytes(sharded.rest),
            "optimizer": state_lib.shard_bytes(sharded.opt_state),
            "gradients": _gradient_bytes(prepared.abstract.params if (t := prepared.trained()) is None else t,
                                         prepared),
            "host": host,
            "arguments": memory.argument_size_in_bytes,
            "temp": memory.temp_size_in_bytes,
            "total": total,
            "capacity": capacity,
            "fits": (total <= capacity) if capacity else None,
        },
        "sharding": state_lib.split_summary(prepared.split),
        "auto_split": [{"param": r["param"], "shape": list(r["shape"]), "spec": _spec_text(r["spec"])}
                       for r in prepared.split if r["kind"] == "auto"],
        "collectives": table,
        "wire_bytes_per_device": wire,
        "peak_tflops": peak / 1e12 if peak else None,
        "link_gbps": link,
        "estimated_step_s": estimate,
        "compiler": compiler_figures(step, text, work, flops_device, peak, n, cfg.train.remat),
        "compiler_flags": dict(prepared.flags.flags) if prepared.flags else {},
        "compiler_flags_dropped": list(prepared.flags.dropped) if prepared.flags else [],
        "strategies": [s.label for s in prepared.strategies],
        "planned_from": config_only.note(cfg),  # a Hugging Face folder without weights or tokenizer: what stood in
        **quantized(cfg, devices, work),
        # each strategy's own figures (pipeline, context, sync, ema, ...), with None for those not active
        **{key: None for cls in strategies.ALL for key in cls.plan_keys},
        **{k: v for s in prepared.strategies for k, v in s.plan(prepared, ops, n).items()},
    }


def quantized(cfg, devices: list, work) -> dict:
    """train.quantize's figures: the same step compiled without quantization, its matrix products and memory per
    device beside the quantized step's (what the quantized products save)."""
    if cfg.train.quantize == "none":
        return {"quantize": None}
    plain = analyse(replace(cfg, train=replace(cfg.train, quantize="none")), devices, work)
    return {"quantize": {"kind": cfg.train.quantize, "unquantized": {
        "matrix_products": plain["matrix_products"], "memory_per_device": plain["memory_per_device"]}}}


def quantized_lines(plan: dict) -> list[str]:
    q = plan.get("quantize")
    if not q:
        return []
    kinds = lambda counts: ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    mem, plain = plan["memory_per_device"], q["unquantized"]["memory_per_device"]
    return [f"  train.quantize={q['kind']}: matrix products per step by operand type {kinds(plan['matrix_products'])} "
            f"(unquantized: {kinds(q['unquantized']['matrix_products'])})",
            f"  memory per device {mb(mem['total'])} against {mb(plain['total'])} unquantized (temp {mb(mem['temp'])} "
            f"against {mb(plain['temp'])})"]


def compiler_figures(step, text: str, work, flops_device: float, peak: float | None, n: int, remat: str) -> dict:
    """What the compiler itself says of the step, per device: its FLOPs and, where it gives one (the TPU
    compiler's `optimal_seconds`), its estimate of the step's time, with the MFU and throughput that implies.

    XLA's cost analysis counts a loop body once, so a scanned layer stack counts as one layer. The FLOPs get
    the matrix products of the loops' other iterations added; the time scales each loop body's share of the
    program (weighed by the compiler's per-instruction estimates) by its trip count, and leaves the work
    outside loops (optimizer, embedding, loss) counted once. Custom-call kernels are counted once each run, whatever
    lowered them: one that states its own cost (a Pallas cost estimate: the grouped products' kernels on TPU,
    tokamax's, megablox's or XLA's own) is in the cost model's FLOPs and time already, for one iteration of its
    loop, so its other iterations' estimates are added as the loops' matrix products are; one that states none
    (splash attention, cuDNN's, Triton's) is opaque to the cost model (zero FLOPs, zero time), so attention's or the
    grouped products' analytic FLOPs (forward, backward, and the forward again under remat) are added for it, at
    the chip's peak, in the share of its kind's runs that state no cost."""
    cost = step.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})  # a list in older JAX
    once = hlo.dot_flops(text, loops=False, convolutions=True)
    extra = hlo.dot_flops(text, convolutions=True) - once  # the loops' other iterations' matrix products
    scale, basis = hlo.loop_scale(text)
    k = hlo.kernels(text)
    extra += k.estimated_flops - k.estimated_once  # the loops' other iterations' kernels, by their own estimates
    # a forward, two in the backward pass, and the forward again under remat (its own work, at the chip's peak)
    passes = (3 + (remat != "none")) / n
    unseen = lambda runs, unestimated: unestimated / runs if runs else 0.0  # noqa: E731
    kernel_flops = passes * (work.attention_flops * unseen(k.attention_runs, k.attention_unestimated)
                             + work.grouped_flops * unseen(k.grouped_runs, k.grouped_unestimated))
    kernel_s = kernel_flops / peak if kernel_flops and peak else 0.0
    raw_s = cost.get("optimal_seconds")
    raw_s = raw_s if raw_s and raw_s > 0 else None  # the TPU cost model answers a negative time where it has none
    seconds = raw_s * scale + kernel_s if raw_s else None
    lm = work.data.task == "lm"
    items = work.data.batch_size * (work.data.tokens_per_example if lm else 1)  # tokens (language models) or samples
    raw_flops = cost.get("flops")
    return {"flops_per_device": raw_flops + extra + kernel_flops if raw_flops else None,
            "raw_flops_per_device": raw_flops, "raw_step_s": raw_s, "loop_factor": scale, "loop_basis": basis,
            "kernel_calls": k.calls, "grouped_kernel_calls": k.grouped, "kernel_flops_per_device": kernel_flops,
            "kernel_estimated_flops_per_device": k.estimated_flops, "kernel_s": kernel_s,
            "bytes_accessed": cost.get("bytes accessed"), "step_s": seconds,
            "mfu": flops_device / (seconds * peak) if seconds and peak else None,
            "per_s": items / seconds if seconds else None, "unit": "tokens" if lm else "samples"}


def _fits(mem: dict) -> str:
    if mem["fits"]:
        return "fits"
    return f"does NOT fit by {(mem['total'] - mem['capacity']) / 2**30:.2f} GiB"


def report(plan: dict) -> str:
    mem = plan["memory_per_device"]
    mesh = " x ".join(f"{a}={s}" for a, s in plan["mesh"].items())
    where = f"{plan['devices']} {plan['device_kind']} device(s)"
    if plan.get("target"):
        where = f"{plan['devices']} compile-only devices of {plan['target']}"
    lines = [f"plan: {plan['param_count']:,} parameters on {where}, mesh {mesh}",
             *([f"  {plan['planned_from']}"] if plan.get("planned_from") else []),
             f"  memory per device: params {mb(mem['params'])}, optimizer {mb(mem['optimizer'])}, "
             f"gradients {mb(mem['gradients'])}, arguments {mb(mem['arguments'])}, temp {mb(mem['temp'])}, "
             f"total {mb(mem['total'])}" + (f" on the device, {mb(mem['host'])} in host memory" if mem["host"] else "")
             + (f" of {mb(mem['capacity'])} ({_fits(mem)})" if mem["capacity"] else ""),
             f"  per step: {plan['flops_per_step']:.3g} FLOPs, each device sends {mb(plan['wire_bytes_per_device'])}"]
    if plan["executed_flops_per_device"]:  # the TPU compiler's dots live in fusions as convolutions: not counted
        lines.append(f"  each device executes {plan['executed_flops_per_device']:.3g} matrix-product FLOPs per step, "
             f"{plan['executed_flops_per_device'] / max(plan['flops_per_device'], 1):.2f}x its share of the model's "
             "(recomputation, padding, masked attention, pipeline bubbles, work repeated across stages)"
             + (f"; not counted: the work of {plan['uncounted_kernel_runs']} kernel runs that state no cost (Pallas "
                "or cuDNN custom calls)" if plan.get("uncounted_kernel_runs") else ""))
    if plan.get("data_dependent_loops"):
        lines.append(f"  {plan['data_dependent_loops']} loop(s) run as often as the data asks (e.g. dropless experts' "
                     "exchange rounds, one where no bucket overflows): their work and bytes counted once")
    lines.append(f"  {plan['sharding']}")
    for r in plan["auto_split"][:AUTO_SHOWN]:
        lines.append(f"    auto: {r['param']} {tuple(r['shape'])} -> {r['spec']}")
    if len(plan["auto_split"]) > AUTO_SHOWN:
        lines.append(f"    ... and {len(plan['auto_split']) - AUTO_SHOWN} more in plan.json")
    if any("tensor" in r["spec"] for r in plan["auto_split"]):
        lines.append("    (split over tensor without logical names: correct, but only names let Megatron pair a "
                     "column split with the next row split and share one all-reduce)")
    for cls in strategies.ALL:  # each active strategy's lines (its keys in plan.json)
        lines += [f"  {line}" for line in cls.report(plan)]
    used = {k: v for k, v in plan["collectives"].items() if v["count"]}
    if used:
        lines.append("  collectives: " + ", ".join(f"{k} x{v['count']} ({mb(v['bytes'])})" for k, v in used.items())
                     + (" (ragged: at most; the rows sent are the data's)" if "ragged-all-to-all" in used else ""))
    if plan["estimated_step_s"] is not None:
        lines.append(f"  estimated step: {plan['estimated_step_s'] * 1e3:.2f} ms "
                     f"({plan['peak_tflops']:.0f} TFLOP/s, {plan['link_gbps']:.0f} GB/s links)")
    else:
        lines.append("  estimated step: unknown device; set run.peak_tflops and run.link_gbps")
    lines += quantized_lines(plan) + compiler_lines(plan)
    return "\n".join(lines)


def compiler_lines(plan: dict) -> list[str]:
    """The compiler's own figures, labelled as such (beside the plan's: for a run.target, a real compiler's)."""
    c = plan.get("compiler") or {}
    lines = []
    if plan.get("compiler_flags"):
        lines.append("  compiler flags (chips.yaml's for the device, run.compiler_flags): "
                     + " ".join(f"{k}={v}" for k, v in plan["compiler_flags"].items()))
    if plan.get("compiler_flags_dropped"):
        lines.append("  flags this compiler does not know, dropped: " + ", ".join(plan["compiler_flags_dropped"]))
    if not plan.get("target") or not c.get("flops_per_device"):
        return lines
    whose = "the target's compiler"
    loops = f" (its loop bodies counted through their trip counts, x{c['loop_factor']:.2f} by {c['loop_basis']})" \
        if abs(c["loop_factor"] - 1) > 0.01 else ""
    lines.append(f"  {whose}: {c['flops_per_device']:.3g} FLOPs per device per step{loops}; the model's share: "
                 f"{plan['flops_per_device']:.3g}")
    if c.get("kernel_calls"):
        grouped = c.get("grouped_kernel_calls", 0)
        kinds = ", ".join(f"{what} {count}" for what, count in (("attention", c["kernel_calls"] - grouped),
                                                                 ("grouped products", grouped)) if count)
        stated = c.get("kernel_estimated_flops_per_device") or 0.0
        counted = [f"{stated:.3g} FLOPs by their own cost estimates"] if stated else []
        if c["kernel_flops_per_device"]:
            counted.append(f"{c['kernel_flops_per_device']:.3g} analytic FLOPs at peak, {c['kernel_s'] * 1e3:.3g} ms, "
                           "for those the cost model cannot see")
        lines.append(f"  {c['kernel_calls']} custom-call kernel runs ({kinds}): counted as "
                     + (" and ".join(counted) or "nothing (they state no cost and the model has no such work)"))
    if c["step_s"]:
        mfu = f", MFU {c['mfu']:.0%}" if c["mfu"] is not None else ""
        lines.append(f"  {whose} estimates the step at {c['step_s'] * 1e3:.3g} ms{mfu}, {c['per_s']:,.0f} "
                     f"{c['unit']}/s (its cost model; not a measurement)")
    return lines


AUTO_SHOWN = 20  # auto-split parameters listed in the printed report (plan.json has them all)


def _spec_text(spec) -> str:
    return "(" + ", ".join("None" if e is None else "+".join(partition.axes_of(e)) for e in spec) + ")"


def write(run_dir: str, plan, name: str):
    path = paths.resolve(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2) + "\n")
    return path
