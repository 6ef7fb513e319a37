"""Training over slow links: eval loss against the bytes that cross between replicas, for synchronous
data parallelism (`train.sync=allreduce`), local SGD and DiLoCo every H steps, and streaming DiLoCo.

Every run is the same job (configs/default.yaml: the same model, total batch, steps and data) on 8 simulated
CPU devices as replica=4 x data=2; only train.sync, sync_every and sync_fragments change, except the last
two rows: DiLoCo at H=16 tuned for this short run from scratch (TUNED), and allreduce with the same inner
warmup, so that the tuned row is also compared with synchronous training given that schedule. Each run trains in
this process; its cross-replica bytes per device and step come from the plan (the compiled programs'
collectives: the step's for allreduce, the sync programs' / H otherwise). Prints a table, one JSON line per
run, and draws loss against bytes into --png.

Run: `python bench/low_comm.py [--every 1,4,16,64] [--only SETTING,...] [--png bench/low_comm.png] [key=value ...]`
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MESH = ["run.cpu_devices=8", "mesh.replica=4", "mesh.data=2"]
WARMUP, MOMENTUM = 320, 0.8  # DiLoCo tuned for this short run from scratch
TUNED = [f"optimizer.warmup_steps={WARMUP}", f"train.outer_momentum={MOMENTUM}"]
QUIET = ["checkpoint.enabled=false", "train.sample_len=0", "run.progress=false", "run.tensorboard=false",
         "run.plot=false"]


def settings(every: list[int]) -> list[tuple[str, list[str]]]:
    out = [("allreduce", ["train.sync=allreduce"])]
    for mode in ("local_sgd", "diloco"):
        out += [(f"{mode} H={h}", [f"train.sync={mode}", f"train.sync_every={h}"]) for h in every]
    h = 16 if 16 in every else every[-1]
    out.append((f"streaming diloco H={h} F=4",
                ["train.sync=diloco", f"train.sync_every={h}", "train.sync_fragments=4"]))
    # DiLoCo as tuned for a short run from scratch (bench/RESULTS.md): the inner learning rate warmed up over
    # half the run instead of 30 steps, and a little less outer momentum than the paper's 0.9.
    out.append((f"diloco H={h} warmup {WARMUP} mom {MOMENTUM}",
                ["train.sync=diloco", f"train.sync_every={h}", *TUNED]))
    out.append((f"allreduce warmup {WARMUP}", ["train.sync=allreduce", TUNED[0]]))  # the same warmup, for fairness
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/low_comm.py")
    parser.add_argument("--every", default="1,4,16,64", help="comma-separated H")
    parser.add_argument("--png", default=str(ROOT / "bench" / "low_comm.png"))
    parser.add_argument("--only", help="comma-separated settings to run besides allreduce (e.g. 'diloco H=16')")
    args, overrides = parser.parse_known_args(argv)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

    import jax
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shard import config

    from shard.plan import analysis
    from shard.run import trainer

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        chosen = settings([int(h) for h in args.every.split(",")])
        if args.only:
            chosen = chosen[:1] + [c for c in chosen[1:] if c[0] in args.only.split(",")]
        for name, extra in chosen:
            cfg = config.load(ROOT / "configs" / "default.yaml",
                              [*MESH, *QUIET, *extra, *overrides, f"run.dir={scratch}/{len(rows)}"])
            costs = analysis.analyse(cfg, jax.devices())
            result = trainer.run(cfg)
            row = {"setting": name, "eval_loss": result.eval["eval_loss"],
                   "cross_replica_bytes_per_step": costs["sync"]["cross_replica_bytes_per_step"],
                   "bytes_per_sync_peak": costs["sync"]["bytes_per_sync_peak"],
                   "wire_bytes_per_device": costs["wire_bytes_per_device"], "steps": cfg.train.steps}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]
    print(f"\n{'setting':<34} {'eval loss':>9} {'vs allreduce':>12} {'cross-replica B/step':>21} {'share':>7} "
          f"{'peak B/sync':>12}")
    for r in rows:
        print(f"{r['setting']:<34} {r['eval_loss']:9.4f} {r['eval_loss'] / base['eval_loss'] - 1:+12.1%} "
              f"{r['cross_replica_bytes_per_step']:21,.0f} "
              f"{r['cross_replica_bytes_per_step'] / base['cross_replica_bytes_per_step']:7.3f} "
              f"{r['bytes_per_sync_peak']:12,.0f}")
    figure, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["cross_replica_bytes_per_step"], r["eval_loss"])
        ax.annotate(r["setting"], (r["cross_replica_bytes_per_step"], r["eval_loss"]), fontsize=7,
                    xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("bytes each device sends across replicas per step (log)")
    ax.set_ylabel("eval loss")
    ax.set_title(f"default GPT, replica=4 x data=2, {base['steps']} steps")
    ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
