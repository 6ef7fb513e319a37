"""Model FLOPs utilisation of a GPT under train.py's loop on one accelerator, and a search for the
settings that give the most of it.

Each setting is a fresh `python train.py CONFIG ...` process (XLA_FLAGS are read when JAX starts)
that trains STEPS steps and logs every LOG_EVERY; its figures are medians over the log blocks after
the first two (the first holds the compile). Reported per setting: tokens/s, model TFLOP/s per
device, MFU against the device's peak dense bf16 rate (shard/observe/metrics.py's table, or
run.peak_tflops=), peak device memory, compile seconds.

The FLOP count is the framework's (shard/core/flops.py, counted on the step's jaxpr): 2 FLOPs per
multiply-add of every matrix product, forward and backward, i.e. 6 x (parameters in matrix products)
x tokens, plus attention (4 x layers x length x width per token forward, twice that backward, the
causal mask not discounted), and without the forward that activation checkpointing recomputes
(that would be hardware, not model, utilisation). tests/test_plan.py checks it against the formula
and against XLA's own cost analysis.

`--sweep` searches one knob at a time from the config's settings, keeping the best so far: the
attention kernel (auto, xla; cudnn on an NVIDIA GPU in bf16), `train.remat`, the batch (halved and doubled
while it helps and fits), `train.scan_layers` (a scan stacks every layer's saved activations into one buffer: on
the H200 that stacking and its copies were ~28% of gpt_350m's step, bench/RESULTS.md), and XLA_FLAGS.
`--knobs a,b` limits it; `--budget-s` stops starting new runs once spent (the best so far is still reported).

Run: `python bench/mfu.py [CONFIG.yaml] [key=value ...] [--sweep] [--knobs attention,remat,batch,scan,flags]
[--steps N] [--budget-s S] [--out FILE.jsonl]` (default: configs/gpt_350m.yaml). Exit status 1 if
the best MFU is under the 55% target (or unknown).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOG_EVERY = 5
QUIET = ["checkpoint.enabled=false", "train.sample_len=0", "train.eval_batches=1", "train.eval_every=0",
         "run.progress=false"]
# XLA_FLAGS tried on a GPU: matrix products through cuBLAS rather than Triton-generated kernels.
GPU_FLAGS = ["", "--xla_gpu_enable_triton_gemm=false"]
TARGET_MFU = 0.55


def device_info() -> dict:
    """The first device's platform and kind, from a child process: this one must not hold the GPU."""
    code = "import jax; d = jax.devices()[0]; print(d.platform); print(d.device_kind); print(jax.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    return {"platform": out[0], "kind": out[1], "jax": out[2]}


def run_setting(config: str, overrides: list[str], setting: dict, steps: int, timeout_s: float) -> dict:
    """Train `steps` steps with this setting in a fresh process; its figures, or why it did not run."""
    args = [*overrides, *QUIET, f"train.steps={steps}", f"run.log_every={LOG_EVERY}",
            f"train.attention={setting['attention']}", f"train.remat={setting['remat']}",
            f"data.batch_size={setting['batch']}", f"train.scan_layers={str(setting['scan']).lower()}"]
    env = {**os.environ, "XLA_FLAGS": setting["flags"]}
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            proc = subprocess.run([sys.executable, str(ROOT / "train.py"), config, *args, f"run.dir={run_dir}"],
                                  env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {**setting, "status": f"timed out after {timeout_s:.0f} s"}
        metrics = Path(run_dir) / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in records if "loss" in r]
    if proc.returncode or len(train) < 4:
        return {**setting, "status": why_failed(proc.stderr or proc.stdout)}
    steady = train[3:]  # records: step 1 (compile), then blocks ending at LOG_EVERY, 2 x LOG_EVERY, ...
    result = {**setting, "status": "ok", "compile_s": train[0]["compile_s"],
              "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
              "tflops": statistics.median(r["tflops_per_device"] for r in steady)}
    if "mfu" in steady[0]:
        result["mfu"] = statistics.median(r["mfu"] for r in steady)
    if "peak_memory_gb" in train[-1]:
        result["peak_memory_gb"] = max(r["peak_memory_gb"] for r in train)
    return result


def why_failed(stderr: str) -> str:
    text = stderr.strip()
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return "out of memory"
    lines = [line for line in text.splitlines() if line.strip()]
    return "failed: " + (lines[-1][:160] if lines else "no output")


def key(setting: dict) -> tuple:
    return setting["attention"], setting["remat"], setting["batch"], setting["scan"], setting["flags"]


def better(a: dict | None, b: dict) -> bool:
    return b["status"] == "ok" and (a is None or b["tokens_per_s"] > a["tokens_per_s"])


def sweep(config, overrides, start: dict, knobs: list[str], device: dict, bf16: bool, steps, deadline,
          say) -> list[dict]:
    """One knob at a time from `start`, each from the best setting so far; returns every run."""
    done: dict[tuple, dict] = {}
    best: dict | None = None

    def trial(setting: dict) -> dict | None:
        nonlocal best
        if key(setting) in done:
            return done[key(setting)]
        if time.monotonic() > deadline:
            return None
        result = run_setting(config, overrides, setting, steps, max(60.0, deadline - time.monotonic()))
        done[key(setting)] = result
        say(row(result))
        if better(best, result):
            best = result
        return result

    trial(start)
    gpu_bf16 = device["platform"] == "gpu" and bf16
    for knob in knobs:
        base = dict(best or start)
        if knob == "attention":
            # auto picks cuDNN on an NVIDIA GPU in bf16 where the call fits (splash on a TPU): try each by name
            choices = ["auto", "xla", "cudnn"] if gpu_bf16 else ["auto", "xla"]
            for value in choices:
                trial({**base, "attention": value})
        elif knob == "remat":
            for value in ("none", "dots", "full"):
                trial({**base, "remat": value})
        elif knob == "scan":
            for value in (True, False):
                trial({**base, "scan": value})
        elif knob == "flags":
            for value in GPU_FLAGS if device["platform"] == "gpu" else [""]:
                trial({**base, "flags": value})
        elif knob == "batch":
            for direction in (2, 0.5):  # grow while it helps and fits, then try smaller
                batch = base["batch"]
                while True:
                    batch = int(batch * direction)
                    if batch < 1:
                        break
                    result = trial({**base, "batch": batch})
                    if result is None or result["status"] != "ok" or result is not best:
                        break
    return list(done.values())


def row(r: dict) -> str:
    flags = r["flags"] or "-"
    head = (f"batch {r['batch']:>4} | remat {r['remat']:<4} | attention {r['attention']:<5} | "
            f"{'scanned' if r['scan'] else 'unrolled'} | XLA_FLAGS {flags}")
    if r["status"] != "ok":
        return f"{head} | {r['status']}"
    mfu = f"{r['mfu']:.1%}" if "mfu" in r else "unknown peak"
    memory = f" | peak memory {r['peak_memory_gb']:.1f} GB" if "peak_memory_gb" in r else ""
    return (f"{head} | {r['tokens_per_s']:,.0f} tokens/s | {r['tflops']:.3g} TFLOP/s | MFU {mfu}{memory} "
            f"| compile {r['compile_s']:.1f} s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "gpt_350m.yaml"))
    parser.add_argument("overrides", nargs="*", help="key=value, as for train.py")
    parser.add_argument("--sweep", action="store_true", help="search the settings one knob at a time")
    parser.add_argument("--knobs", default="attention,remat,batch,scan,flags", help="what --sweep varies, in order")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (at least 4 x %d)" % LOG_EVERY)
    parser.add_argument("--budget-s", type=float, default=480, help="start no run after this many seconds")
    parser.add_argument("--out", help="append every run's figures to this JSON-lines file")
    args = parser.parse_args(argv)
    if "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = str(ROOT / "configs" / "gpt_350m.yaml")
    knobs = [k for k in args.knobs.split(",") if k]
    unknown = set(knobs) - {"attention", "remat", "batch", "scan", "flags"}
    if unknown:
        print(f"error: --knobs takes attention,remat,batch,scan,flags, got {','.join(sorted(unknown))}",
              file=sys.stderr)
        return 2
    if args.steps < 4 * LOG_EVERY:
        print(f"error: --steps must be at least {4 * LOG_EVERY}, got {args.steps}", file=sys.stderr)
        return 2

    from shard import config as config_lib
    from shard.errors import UserError

    try:
        cfg = config_lib.load(args.config, [*args.overrides, *QUIET])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = device_info()
    start = {"attention": cfg.train.attention, "remat": cfg.train.remat, "batch": cfg.data.batch_size,
             "scan": cfg.train.scan_layers, "flags": os.environ.get("XLA_FLAGS", "")}
    print(f"device: {device['kind']} ({device['platform']}) | jax {device['jax']} | {Path(args.config).name} "
          f"{' '.join(args.overrides)} | {cfg.data.seq_len} tokens per sequence, {cfg.train.dtype} | "
          f"{args.steps} steps per run", flush=True)
    deadline = time.monotonic() + args.budget_s
    say = lambda line: print(line, flush=True)  # noqa: E731
    if args.sweep:
        runs = sweep(args.config, args.overrides, start, knobs, device, cfg.train.dtype == "bfloat16", args.steps,
                     deadline, say)
    else:
        runs = [run_setting(args.config, args.overrides, start, args.steps, max(60.0, args.budget_s))]
        say(row(runs[0]))
    if args.out:
        with open(args.out, "a") as f:
            for r in runs:
                f.write(json.dumps({**r, "device": device["kind"], "config": args.config,
                                    "overrides": args.overrides, "date": time.strftime("%Y-%m-%d")}) + "\n")
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        print("no setting ran")
        return 1
    best = max(ok, key=lambda r: r["tokens_per_s"])
    print(f"best: {row(best)}")
    return 0 if best.get("mfu", 0) >= TARGET_MFU else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
