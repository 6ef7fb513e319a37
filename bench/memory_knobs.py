"""Memory against communication: per-device memory and bytes sent for dp, ZeRO-1, ZeRO-2 and FSDP (ZeRO-3),
each with and without gradient accumulation and a bfloat16 gradient reduction, beside the ZeRO paper's
formulas (Rajbhandari et al. 2020, Psi = parameter count, N = devices, float32 everywhere):

  per device     parameters   Adam moments   gradients     sent per step
  dp             4Psi         8Psi           4Psi          2(N-1)/N x 4Psi  (one all-reduce)
  ZeRO-1         4Psi         8Psi/N         4Psi          the same (a reduce-scatter and an all-gather)
  ZeRO-2         4Psi         8Psi/N         4Psi/N        the same; x(K+1)/2 when K microbatches are each
                                                           reduce-scattered
  ZeRO-3 (fsdp)  4Psi/N       8Psi/N         4Psi/N        3(N-1)/N x 4Psi  (gather forward and backward,
                                                           reduce-scatter), xK gathers under accumulation

Every figure is the plan's (`shard.plan.analyse`: XLA's memory analysis and the compiled program's
collectives), nothing is trained. `--converge` also trains the default job under dp with float32 and with
bfloat16 gradient reduction and prints both eval losses.

Run: `python bench/memory_knobs.py [--converge] [key=value ...]` (default: configs/default.yaml on 8
simulated CPU devices).
"""

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MESHES = ("dp", "zero1", "zero2", "fsdp")
KNOBS = {"": [], "K=4": ["train.grad_accum=4"], "bf16": ["train.grad_dtype=bfloat16"],
         "K=4, bf16": ["train.grad_accum=4", "train.grad_dtype=bfloat16"]}
QUIET = ["checkpoint.enabled=false", "train.sample_len=0", "run.progress=false", "run.tensorboard=false",
         "run.plot=false"]


def formula(mesh: str, psi: int, n: int, k: int) -> dict:
    """The paper's bytes per device (float32) for this mesh and K microbatches."""
    ring = 2 * (n - 1) / n * 4 * psi
    return {
        "params": 4 * psi / (n if mesh == "fsdp" else 1),
        "optimizer": 8 * psi / (1 if mesh == "dp" else n),
        "gradients": 4 * psi / (n if mesh in ("zero2", "fsdp") else 1),
        "sent": {"dp": ring, "zero1": ring, "zero2": ring / 2 * (k + 1),
                 "fsdp": (n - 1) / n * 4 * psi * (2 * k + k)}[mesh],
    }


def mib(x) -> str:
    return f"{x / 2**20:.2f}"


def main(argv: list[str]) -> int:
    converge = "--converge" in argv
    argv = [a for a in argv if a != "--converge"]
    args = argv[1:] if argv and argv[0].endswith(".yaml") else argv
    path = Path(argv[0]) if argv and argv[0].endswith(".yaml") else ROOT / "configs" / "default.yaml"
    if not any(a.startswith("run.cpu_devices") for a in args):
        args = ["run.cpu_devices=8", *args]
    from shard import config
    from shard.plan import analysis
    from shard.run import distributed, trainer
    from shard.errors import UserError

    rows = []
    print(f"{'mesh':<7} {'knobs':<10} {'params':>7} {'(paper)':>7} {'optim':>7} {'(paper)':>7} {'grads':>7} "
          f"{'(paper)':>7} {'temp':>7} {'total':>7} {'sent':>7} {'(paper)':>7}   (MiB per device)")
    for mesh in MESHES:
        for knob, extra in KNOBS.items():
            with tempfile.TemporaryDirectory() as run_dir:
                cfg = config.load(path, [*args, *QUIET, f"mesh={mesh}", *extra, f"run.dir={run_dir}"])
                devices = distributed.start(cfg.run, deterministic=cfg.train.deterministic)
                try:
                    p = analysis.analyse(cfg, devices)
                except UserError as e:
                    print(f"{mesh:<7} {knob:<10} not offered: {e}", flush=True)
                    continue
            mem, n = p["memory_per_device"], p["devices"]
            paper = formula(mesh, p["param_count"], n, cfg.train.grad_accum)
            bf16 = 0.5 if cfg.train.grad_dtype == "bfloat16" else 1.0  # only the gradient reduction narrows
            rows.append({"mesh": mesh, "knobs": knob, "plan": mem, "sent": p["wire_bytes_per_device"],
                         "collectives": p["collectives"], "paper_fp32": paper})
            print(f"{mesh:<7} {knob:<10} {mib(mem['params']):>7} {mib(paper['params']):>7} {mib(mem['optimizer']):>7} "
                  f"{mib(paper['optimizer']):>7} {mib(mem['gradients']):>7} {mib(paper['gradients']):>7} "
                  f"{mib(mem['temp']):>7} {mib(mem['total']):>7} {mib(p['wire_bytes_per_device']):>7} "
                  f"{mib(paper['sent']) + ('*' if bf16 < 1 else ''):>7}", flush=True)
    print("(paper)* = the float32 figure; a bfloat16 reduction halves the gradients' share of it")
    print(json.dumps(rows))
    if converge:
        losses = {}
        for dtype in ("float32", "bfloat16"):
            with tempfile.TemporaryDirectory() as run_dir:
                cfg = config.load(path, [*args, *QUIET, "mesh=dp", f"train.grad_dtype={dtype}", f"run.dir={run_dir}"])
                losses[dtype] = trainer.run(cfg).eval["eval_loss"]
            print(f"default job, dp on {n} devices, grad_dtype={dtype}: eval loss {losses[dtype]:.4f}", flush=True)
        print(f"bfloat16 / float32 eval loss: {losses['bfloat16'] / losses['float32']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
