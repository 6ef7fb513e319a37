"""Long sequences: memory per device and step time against sequence length, one device against the
sequence split over 8 (`mesh=cp`), with each context strategy.

For each length and setting: the plan's memory per device (XLA's memory analysis of the compiled step),
then STEPS steps of the compiled step on real batches, each waited for in full (every output fetched,
the new state ready); the step time is the median after the first two. (The trainer's own step_time_s
is not used: with a record every step it can count a step before all of its outputs are written.)
Prints one table row per setting and a JSON line with every figure.

Run: `python bench/context.py [key=value ...]` (default: configs/default.yaml, batch 1, on 8 simulated
CPU devices; on a GPU machine pass e.g. configs/gpt_350m.yaml and the lengths to try with LENGTHS=...).
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = 6
LENGTHS = [int(x) for x in os.environ.get("LENGTHS", "256,512,1024,2048").split(",")]
SETTINGS = {"1 device": ["run.cpu_devices=1"],
            "context=8, all_gather": ["mesh=cp", "train.context_strategy=all_gather"],
            "context=8, ring": ["mesh=cp", "train.context_strategy=ring"]}
QUIET = ["checkpoint.enabled=false", "train.sample_len=0", "train.eval_batches=1", "run.progress=false",
         "run.tensorboard=false", "run.plot=false", "run.log_every=1", f"train.steps={STEPS}", "data.batch_size=1"]


def timed_step(cfg, devices) -> float:
    """Median seconds of one train step after two warm-up steps, each fetched whole before the next."""
    import jax

    from shard import data as data_lib
    from shard.run import job
    from shard.core import state as state_lib

    prepared = job.prepare(cfg, devices)
    state = state_lib.init_state(prepared.work.init, prepared.shardings)
    batches = data_lib.device_batches(prepared.work.data.train, prepared.batch_shardings, prefetch=0,
                                      batch_size=cfg.data.batch_size)
    times = []
    for _ in range(STEPS):
        batch = next(batches)
        start = time.perf_counter()
        state, out = prepared.train_step(state, batch)
        jax.device_get(out)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main(argv: list[str]) -> int:
    args = argv[1:] if argv and argv[0].endswith(".yaml") else argv
    path = Path(argv[0]) if argv and argv[0].endswith(".yaml") else ROOT / "configs" / "default.yaml"
    if not any(a.startswith("run.cpu_devices") for a in args):  # 8 simulated devices from the start: the one-device
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        args = ["run.cpu_devices=8", *args]  # setting then takes one of them
        import jax
        jax.devices()  # start the backend now, with all 8
    from shard import config
    from shard.plan import analysis
    from shard.run import distributed

    rows = []
    print(f"{'tokens':>7} {'setting':<24} {'memory/device':>14} {'temp':>11} {'sends/device':>13} {'step':>10}")
    for length in LENGTHS:
        for name, setting in SETTINGS.items():
            with tempfile.TemporaryDirectory() as run_dir:
                cfg = config.load(path, [*args, *QUIET, f"data.seq_len={length}",
                                         f"model.max_len={length}", *setting, f"run.dir={run_dir}"])
                devices = distributed.start(cfg.run, deterministic=cfg.train.deterministic)
                p = analysis.analyse(cfg, devices)
                step = timed_step(cfg, devices)
            mem = p["memory_per_device"]
            rows.append({"tokens": length, "setting": name, "memory_per_device": mem, "step_s": step,
                         "wire_bytes_per_device": p["wire_bytes_per_device"]})
            print(f"{length:>7} {name:<24} {mem['total'] / 2**20:>10.2f} MiB {mem['temp'] / 2**20:>7.2f} MiB "
                  f"{p['wire_bytes_per_device'] / 2**20:>9.2f} MiB {step * 1e3:>7.1f} ms", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
