"""Is input time hidden behind compute? A source made slow on purpose (each batch sleeps), timed three ways:
compute only (one batch reused), reading in the loop (prefetch 0), and the background prefetch (data.prefetch).
Target: with prefetch the step time stays within 10% of compute only; without, it is about their sum.
Each step waits for its loss (as a loop that logs every step does); one more line shows that JAX's
asynchronous dispatch alone already hides one batch of input when the loop does not wait.

Run: `python bench/input_overlap.py [key=value ...]` (exit status 1 if the target is missed)."""

import sys
import tempfile
import time

import jax

from shard import config
from shard.nn import partition
from shard.run import trainer
from shard import data as data_lib
from shard.core import state as state_lib

ARGS = ["model.name=mlp", "model.in_features=64", "model.out_features=10", "model.hidden=[2048,2048,2048]",
        "data.name=digits", "data.batch_size=256", "train.steps=1", "run.progress=false",
        "checkpoint.enabled=false", "train.eval_batches=1"]
PREFETCH = 2  # the background thread's depth under test (data.prefetch)


def timed(step, state, batches, n: int, sync: bool = True) -> tuple[float, object]:
    """Seconds per step; `sync` waits for each step's loss, as a loop that logs every step does."""
    state, out = step(state, next(batches))  # warm
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(n):
        state, out = step(state, next(batches))
        if sync:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n, state


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = config.load(None, ARGS + [f"run.dir={run_dir}"] + argv)
        result = trainer.run(cfg)
    data = data_lib.build(cfg.data, cfg.train.seed)
    rules = partition.merged_rules(cfg.mesh.rules, result.mesh.axis_names)
    shardings = state_lib.batch_shardings(data.abstract_batch(), result.mesh, rules)
    step, state, n = result.train_step, result.state, 40

    one = next(data_lib.device_batches(data.train, shardings, prefetch=0))
    compute, state = timed(step, state, iter(lambda: one, None), n)
    start = time.perf_counter()
    for i in range(n):
        data.train[i]
    read = (time.perf_counter() - start) / n
    if read > 0.8 * compute:
        print(f"reading a batch ({read * 1e3:.1f} ms) is already slower than 0.8 x the step ({compute * 1e3:.1f} ms): "
              "use a bigger model or a smaller batch")
        return 1
    delay = 0.8 * compute - read  # input (read + sleep) takes 80% of the step's time
    slow = data.train.map(lambda batch: (time.sleep(delay), batch)[1])
    serial, state = timed(step, state, data_lib.device_batches(slow, shardings, prefetch=0), n)
    dispatch_only, state = timed(step, state, data_lib.device_batches(slow, shardings, prefetch=0), n, sync=False)
    overlapped, state = timed(step, state, data_lib.device_batches(slow, shardings, prefetch=PREFETCH), n)

    print(f"device {jax.devices()[0].device_kind} | {n} steps each | input per batch: read {read * 1e3:.1f} ms "
          f"+ sleep {delay * 1e3:.1f} ms")
    print(f"compute only                  {compute * 1e3:7.1f} ms/step")
    print(f"prefetch 0, sync each step    {serial * 1e3:7.1f} ms/step  ({serial / compute:.2f}x; compute + input = "
          f"{(compute + read + delay) / compute:.2f}x)")
    print(f"prefetch 0, no sync           {dispatch_only * 1e3:7.1f} ms/step  ({dispatch_only / compute:.2f}x: "
          "async dispatch alone overlaps one batch)")
    print(f"prefetch {PREFETCH}, sync each step    {overlapped * 1e3:7.1f} ms/step  ({overlapped / compute:.2f}x)")
    ok = overlapped <= 1.10 * compute
    print("target met" if ok else "TARGET MISSED: prefetched step time > 1.10 x compute only")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
