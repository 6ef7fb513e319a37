"""Where a train step's time goes on CPU, op by op: our compiled step against the same model in PyTorch.

Ours: the framework's own train step (shard.run.job.prepare, as train.py compiles it) traced with jax.profiler;
each XLA thunk's self time is summed by the HLO instruction it runs, and each instruction is labelled with
its opcode (fusions with their kind: kLoop elementwise, kInput reductions, kOutput matmul epilogues) and
the JAX operation it came from. Theirs: bench/vs_torch.py's PyTorch GPT (same shapes, AdamW, clipping,
schedule, batch) in eager mode under torch.profiler, each aten op's self time (in this process, so with our
trainer's host allocator settings: bench/vs_torch.py shows PyTorch with and without them). Both run --steps steps
after a warm-up, in this process, one after the other; every figure is milliseconds per step.

Run: `pip install torch` then `python bench/cpu_profile.py [CONFIG.yaml] [key=value ...] [--steps N] [--top K]`
"""

import argparse
import collections
import glob
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

QUIET = ["checkpoint.enabled=false", "train.sample_len=0", "run.progress=false", "run.cpu_devices=1"]
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? (\w[\w\-]*)\((.*)$")


def instructions(hlo_text: str) -> dict:
    """HLO instruction name -> (what it is, the JAX operation it came from), from the compiled text."""
    out = {}
    for line in hlo_text.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, opcode, rest = m.groups()
        kind = re.search(r"kind=(k\w+)", rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        what = f"{opcode} {kind.group(1)}" if kind else opcode
        out[name] = (what, _short(op_name.group(1)) if op_name else "")
    return out


def _short(op_name: str) -> str:
    """The last parts of a JAX op_name path, which say what the operation was (e.g.
    `transpose(jvp(...))/dot_general`)."""
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    return "/".join(parts[-2:])[-70:]


def self_times(trace_dir: str) -> collections.Counter:
    """Each event name's self time in ns over the XLA runtime threads of a jax.profiler trace (an event's
    time less that of the events nested in it on the same thread)."""
    from jax._src.lib import _profile_data

    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    totals = collections.Counter()
    for plane in _profile_data.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith(("tf_XLAPjRtCpuClient", "tf_XLAEigen")):
                continue
            events = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events), key=lambda e: (e[0], -e[1]))
            stack: list = []  # open events: [end, name]
            for start, duration, name in events:
                while stack and stack[-1][0] <= start:
                    stack.pop()
                if stack:
                    totals[stack[-1][1]] -= duration
                totals[name] += duration
                stack.append([start + duration, name])
    return totals


def profile_ours(cfg_path, args, steps: int):
    import jax
    import numpy as np

    from shard import config
    from shard.run import distributed, job as job_lib
    from shard.core import state as state_lib

    cfg = config.load(cfg_path, [*args, *QUIET])
    job = job_lib.prepare(cfg, distributed.start(cfg.run), training=False)
    state = state_lib.init_state(job.init, job.shardings)
    rng = np.random.default_rng(0)
    batches = [{k: jax.device_put(rng.integers(0, 256, v.shape).astype(v.dtype), job.batch_shardings[k])
                for k, v in job.work.batch.items()} for _ in range(4)]
    for i in range(5):  # warm-up
        state, out = job.train_step(state, batches[i % 4])
    jax.block_until_ready((state, out))
    names = instructions(job.train_step.as_text())
    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace)
        start = time.perf_counter()
        for i in range(steps):
            state, out = job.train_step(state, batches[i % 4])
        jax.block_until_ready((state, out))
        wall = (time.perf_counter() - start) / steps
        jax.profiler.stop_trace()
        totals = self_times(trace)
    rows = [(ns / steps / 1e6, name, *names[name]) for name, ns in totals.items() if name in names]
    return wall * 1e3, sorted(rows, reverse=True), cfg


def profile_torch(cfg, steps: int):
    import torch
    from torch.profiler import ProfilerActivity, profile
    from shard.core import registry
    from vs_torch import torch_setup

    cfg.model.kwargs = registry.with_defaults(registry.resolve(cfg.model.name), cfg.model.kwargs)
    step_fn, batches, _ = torch_setup(cfg, steps)
    for i in range(5):
        step_fn(*batches[i % len(batches)])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            loss = step_fn(*batches[i % len(batches)])
        float(loss)
        wall = (time.perf_counter() - start) / steps
    rows = [(e.self_cpu_time_total / steps / 1e3, e.key, "aten", "") for e in prof.key_averages()
            if e.self_cpu_time_total > 0]
    return wall * 1e3, sorted(rows, reverse=True), torch.get_num_threads()


def table(title: str, wall_ms: float, rows: list, top: int) -> None:
    busy = sum(r[0] for r in rows)
    print(f"\n{title}: {wall_ms:.2f} ms per step (wall); the ops below add up to {busy:.2f} ms of thread time")
    by_kind = collections.Counter()
    for ms, _, what, _ in rows:
        by_kind[what] += ms
    print("  by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in by_kind.most_common(8)))
    print(f"  {'ms/step':>8} {'share':>6}  {'op':<28} {'kind':<16} from")
    for ms, name, what, origin in rows[:top]:
        print(f"  {ms:8.3f} {ms / busy:6.1%}  {name[:28]:<28} {what[:16]:<16} {origin}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/cpu_profile.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-torch", action="store_true", help="profile ours only")
    opts, rest = parser.parse_known_args(argv)
    cfg_path = Path(rest[0]) if rest and "=" not in rest[0] else ROOT / "configs" / "default.yaml"
    args = [a for a in rest if "=" in a]

    wall, rows, cfg = profile_ours(cfg_path, args, opts.steps)
    import jax

    print(f"device: {jax.devices()[0].device_kind} | jax {jax.__version__} | {cfg.model.name} "
          f"{cfg.data.batch_size}x{cfg.data.seq_len} | {opts.steps} steps after 5 of warm-up")
    table("ours (XLA thunks, self time)", wall, rows, opts.top)
    if not opts.no_torch:
        wall, rows, threads = profile_torch(cfg, opts.steps)
        table(f"PyTorch eager ({threads} threads, aten ops, self time)", wall, rows, opts.top)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
