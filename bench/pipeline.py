"""What a pipeline costs: step time and memory per device of one model under data parallel, FSDP and
pipelined meshes, with several microbatch counts, so the bubble's cost is visible.

For each setting: the plan's memory per device and bubble (`shard.plan.analyse`), then STEPS steps
trained in this process; the step time is the median of the records after the first two (compile and
warm-up). Prints one table row per setting and a JSON line with every figure.

Run: `python bench/pipeline.py [key=value ...]` (default: configs/default.yaml with 8 layers on 8
simulated CPU devices; on a GPU machine pass e.g. configs/gpt_350m.yaml and run.cpu_devices= unset).
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = 8
SETTINGS = {
    "dp": ["mesh=dp"],
    "fsdp": ["mesh=fsdp"],
    **{f"stage=8, M={m}": ["mesh=pp", "mesh.stage=8", f"pipeline.microbatches={m}"] for m in (8, 16, 32)},
    **{f"stage=4 x data=2, M={m}": ["mesh=pp", "mesh.stage=4", "mesh.data=2", f"pipeline.microbatches={m}"]
       for m in (4, 8, 16)},
}
QUIET = ["checkpoint.enabled=false", "train.sample_len=0", "train.eval_batches=1", "run.progress=false",
         "run.tensorboard=false", "run.plot=false", "run.log_every=1", f"train.steps={STEPS}"]


def main(argv: list[str]) -> int:
    args = argv[1:] if argv and argv[0].endswith(".yaml") else argv
    path = Path(argv[0]) if argv and argv[0].endswith(".yaml") else ROOT / "configs" / "default.yaml"
    if not any(a.startswith("run.cpu_devices") for a in args):
        args = ["run.cpu_devices=8", "model.n_layers=8", *args]
    from shard import config
    from shard.plan import analysis
    from shard.run import distributed, trainer

    rows = []
    print(f"{'mesh':<26} {'memory/device':>14} {'bubble':>7} {'step':>10}")
    for name, mesh in SETTINGS.items():
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = config.load(path, [*args, *QUIET, *mesh, f"run.dir={run_dir}"])
            devices = distributed.start(cfg.run, deterministic=cfg.train.deterministic)
            p = analysis.analyse(cfg, devices)
            result = trainer.run(cfg)
        step = statistics.median(r["step_time_s"] for r in result.history[2:])
        bubble = p["pipeline"]["bubble"] if p["pipeline"] else 0.0
        rows.append({"mesh": name, "memory_per_device": p["memory_per_device"], "bubble": bubble, "step_s": step,
                     "wire_bytes_per_device": p["wire_bytes_per_device"]})
        print(f"{name:<26} {p['memory_per_device']['total'] / 2**20:>10.2f} MiB {bubble:>7.1%} {step * 1e3:>7.1f} ms",
              flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
