"""The default job's targets: `python train.py` finishes in under 2 minutes on a 2-core CPU and its
loss falls by at least a third. Run: `python bench/default_job.py` (exit status 1 if a target is missed)."""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"run.dir={run_dir}", "run.progress=false"],
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            print(proc.stderr)
            return 1
        records = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    first, last, final = train[0]["loss"], train[-1]["loss"], records[-1]
    drop = 1 - last / first
    tokens = sorted(r["tokens_per_s"] for r in train[1:])
    print(f"wall {wall:.1f} s | loss {first:.3f} -> {last:.3f} (-{drop:.0%}) | eval_loss {final['eval_loss']:.3f} | "
          f"median {tokens[len(tokens) // 2]:,.0f} tokens/s")
    ok = wall < 120 and drop >= 1 / 3
    print("targets met" if ok else "TARGET MISSED (wall < 120 s, loss drop >= 1/3)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
