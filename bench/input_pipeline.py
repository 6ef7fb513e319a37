"""How fast does the input pipeline deliver batches, against how fast the default job consumes them?

Times reading global batches from `shard.data.build` (no device transfer), then the same with the
transfer (`device_batches` with prefetch 0, waiting for each batch to land), for the default job's
data (text, batch 32 x 64) and for digits in batches of 256; then the default job's own step time
from a short run. Target: the default job's data arrives >= 20x faster than its step consumes it,
and a batch of 256 digits reads in under 2 ms.

Run: `python bench/input_pipeline.py [--batches N] [--steps N]` (exit status 1 if a target is missed)."""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shard import config
from shard.run import trainer
from shard import data as data_lib

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name: (config file, overrides)
    "default (text, 32 x 64)": ("default.yaml", []),
    "digits, batch 256": ("digits_mlp.yaml", ["data.batch_size=256"]),
}


def per_batch(read, n: int) -> tuple[float, float]:
    """(median, 90th percentile) seconds of `read(i)` over batches 0..n-1, after two unrecorded reads."""
    read(n), read(n + 1)  # warm: first-touch allocations, lazy imports
    times = []
    for i in range(n):
        start = time.perf_counter()
        read(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times), float(np.percentile(times, 90))


def pipeline_times(cfg, n: int) -> dict:
    data = data_lib.build(cfg.data, cfg.train.seed)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    shardings = {k: NamedSharding(mesh, PartitionSpec("batch")) for k in data.abstract_batch()}

    def transferred(i: int):  # a fresh generator per batch: the read and the transfer, nothing ahead
        jax.block_until_ready(next(data_lib.device_batches(data.train, shardings, start=i, prefetch=0)))

    return {"read": per_batch(lambda i: data.train[i], n), "read + transfer": per_batch(transferred, n),
            "eval read": per_batch(lambda i: data.eval[i % len(data.eval)], min(n, 4 * len(data.eval)))}


def default_step_time(steps: int) -> float:
    """Median seconds per step of the default job (logged every 10 steps; the first block, with the
    compile, is left out)."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = config.load(ROOT / "configs" / "default.yaml", [
            f"train.steps={steps}", "run.log_every=10", f"run.dir={run_dir}", "run.progress=false",
            "checkpoint.enabled=false", "train.sample_len=0", "train.eval_batches=1"])
        history = trainer.run(cfg).history
    return statistics.median(r["step_time_s"] for r in history if r["step"] > 10)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="batches timed per line")
    parser.add_argument("--steps", type=int, default=60, help="steps of the default job timed (0: skip)")
    args = parser.parse_args(argv)

    print(f"{jax.devices()[0].device_kind} | median (p90) per global batch over {args.batches} batches")
    print(f"{'data':26} {'what':16} {'ms/batch':>9} {'p90':>8} {'us/example':>11}")
    results = {}
    for name, (file, overrides) in CASES.items():
        cfg = config.load(ROOT / "configs" / file, overrides)
        results[name] = pipeline_times(cfg, args.batches)
        for what, (median, p90) in results[name].items():
            print(f"{name:26} {what:16} {median * 1e3:9.3f} {p90 * 1e3:8.3f} "
                  f"{median / cfg.data.batch_size * 1e6:11.1f}")

    digits_ms = results["digits, batch 256"]["read"][0] * 1e3
    ok = digits_ms < 2.0
    print(f"digits: {digits_ms:.3f} ms per batch of 256 (target < 2 ms): {'met' if ok else 'MISSED'}")
    if args.steps:
        step = default_step_time(args.steps)
        supply = results["default (text, 32 x 64)"]["read + transfer"][0]
        ratio = step / supply
        print(f"default job: {step * 1e3:.1f} ms per step; its input arrives {ratio:.0f}x faster than that "
              f"(target >= 20x): {'met' if ratio >= 20 else 'MISSED'}")
        ok = ok and ratio >= 20
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
