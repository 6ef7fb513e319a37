"""GRPO on single-digit addition, offline on a CPU: the reward curve, rollout tokens per second and the share of
the step spent generating (bench/RESULTS.md, issue 49).

    python bench/grpo_example.py data runs/grpo                 # runs/grpo/add.jsonl: 'a+b=' -> a + b, a + b < 10
    python train.py ... train.objective=grpo ... run.dir=RUN    # the commands RESULTS.md gives
    python bench/grpo_example.py report RUN [RUN ...] --out bench/grpo_reward.png

`report` reads each run's metrics.jsonl: per run the mean reward of its first and last tenth of steps, the
rollouts' tokens per second (completion tokens sampled, `data.batch_size x train.grpo.group x
grpo/completion_len`, over `grpo/rollout_s`) and the rollout's share of rollout + update time, over the steps
after the first (the first includes the compile); and draws every run's reward curve into one picture.
"""

import argparse
import json
from pathlib import Path

import yaml


def data(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "add.jsonl", "w") as f:
        for a in range(10):
            for b in range(10 - a):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "completion": f"{a + b}\n"}) + "\n")
    print(out / "add.jsonl")


def records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, open(run / "metrics.jsonl")) if "grpo/reward" in r]


def report(runs: list[Path], out: Path | None) -> None:
    for run in runs:
        cfg = yaml.safe_load(open(run / "config.yaml"))
        rows = cfg["data"]["batch_size"] * cfg["train"]["grpo"]["group"]
        got, tenth = records(run), max(1, len(records(run)) // 10)
        later = got[1:]
        roll = sum(r["grpo/rollout_s"] for r in later)
        update = sum(r["grpo/update_s"] for r in later)
        tokens = sum(rows * r["grpo/completion_len"] for r in later)
        first, last = (sum(r["grpo/reward"] for r in part) / len(part) for part in (got[:tenth], got[-tenth:]))
        print(f"{run}: {len(got)} logged steps, reward {first:.3f} -> {last:.3f} (first and last tenth), "
              f"rollouts {tokens / max(roll, 1e-9):,.0f} tokens/s, generating {roll / max(roll + update, 1e-9):.0%} "
              f"of rollout + update time ({roll / len(later) * 1e3:.1f} + {update / len(later) * 1e3:.1f} ms a step)")
    if out is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for run in runs:
            got = records(run)
            ax.plot([r["step"] for r in got], [r["grpo/reward"] for r in got], label=run.name)
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward of the step's rollouts")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        print(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("data").add_argument("out", type=Path)
    shown = sub.add_parser("report")
    shown.add_argument("runs", type=Path, nargs="+")
    shown.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.command == "data":
        data(args.out)
    else:
        report(args.runs, args.out)


if __name__ == "__main__":
    main()
