"""Where a profiled step's device time goes: the kernels of a `run.profile_steps` trace, summed by name.

Reads the Perfetto trace jax.profiler writes (<run.dir>/profile/**/perfetto_trace.json.gz), keeps the events
of the device's processes (a GPU's streams; on a CPU run, every thread of the host's XLA runtime), groups
them by kernel name with the numbers stripped (fusion.12 and fusion.40 are one row: 'fusion'), and prints
the busiest rows with their share of the device's busy time, per profiled step.

Run: `python bench/trace_top.py RUN_DIR_OR_TRACE [--top N] [--steps K] [--raw]` (--raw keeps the numbers).
"""

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path


def trace_file(where: Path) -> Path:
    if where.is_file():
        return where
    found = sorted(where.rglob("perfetto_trace.json.gz"))
    if not found:
        raise SystemExit(f"error: no perfetto_trace.json.gz under {where} (train with run.profile_steps=START:END)")
    return found[-1]


def device_events(trace: dict) -> list[dict]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
    gpu = {pid for pid, name in names.items() if "/device:GPU" in name or "/device:TPU" in name}
    pids = gpu or {pid for pid, name in names.items() if "/host:CPU" in name}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e]


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("where", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=1, help="how many steps the trace holds (figures per step)")
    parser.add_argument("--raw", action="store_true", help="keep the kernels' numbers (fusion.12, not fusion)")
    args = parser.parse_args(argv)
    path = trace_file(args.where)
    events = device_events(json.loads(gzip.open(path).read()))
    if not events:
        print(f"error: {path} holds no device events", file=sys.stderr)
        return 1
    by_name, count = collections.Counter(), collections.Counter()
    for e in events:
        name = e["name"] if args.raw else re.sub(r"[._]\d+$", "", e["name"])
        by_name[name] += e["dur"]
        count[name] += 1
    busy = sum(by_name.values())
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    print(f"{path}: {len(events)} device events, busy {busy / 1e3 / args.steps:.1f} ms a step "
          f"over a span of {span / 1e3 / args.steps:.1f} ms")
    for name, us in by_name.most_common(args.top):
        print(f"{us / 1e3 / args.steps:9.2f} ms {us / busy:6.1%} {count[name] // args.steps:6d}x  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
