"""Pictures of runs, with matplotlib: the curves of one or several runs, and the plan's mesh comparison.

    python -m shard.plot RUN_DIR [RUN_DIR ...] [--metrics loss,eval_loss,tokens_per_s] [--out FILE.png]

One panel per metric, one line per run, each run labelled by its folder's name and the config values
that differ between the runs. The picture goes to <first RUN_DIR>/curves.png unless --out says where.
The trainer draws the same picture for its own run when it ends (`curves_png`).
"""

import io
import json
from dataclasses import dataclass, field

from shard.paths import yaml_load

from shard import paths
from shard.cli import Parser
from shard.errors import UserError

THROUGHPUT = ("tokens_per_s", "examples_per_s")
IGNORED_IN_LABELS = ("run.dir",)  # differs between any two runs by construction
MAX_LABEL_KEYS = 4


@dataclass
class Run:
    name: str
    records: list
    config: dict = field(default_factory=dict)  # flattened: {"optimizer.lr": 0.001, ...}


def series(records: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """The steps and values of one metric, in step order. Where a step was logged twice (a resumed run
    logs again the steps after its checkpoint), the later record wins, as TensorBoard's purge does."""
    by_step = {}
    for r in records:
        value = r.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_step[r["step"]] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def load_run(run_dir) -> Run:
    path = paths.resolve(run_dir)
    if not (path / "metrics.jsonl").exists():
        problem = "does not exist" if not path.exists() else "has no metrics.jsonl (is it a run folder?)"
        raise UserError(f"{run_dir}: {problem}")
    config_file = path / "config.yaml"
    config = _flatten(yaml_load(config_file.read_text()) or {}) if config_file.exists() else {}
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return Run(name=path.name, records=records, config=config)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def labels(runs: list[Run]) -> list[str]:
    """Each run's name, plus the config values in which the runs differ (at most a few, then '...')."""
    keys = sorted({k for r in runs for k in r.config} - set(IGNORED_IN_LABELS))
    differing = [k for k in keys if len({repr(r.config.get(k)) for r in runs}) > 1] if len(runs) > 1 else []
    out = []
    for run in runs:
        shown = [f"{k}={run.config.get(k)}" for k in differing[:MAX_LABEL_KEYS]]
        if len(differing) > MAX_LABEL_KEYS:
            shown.append("...")
        out.append(f"{run.name} ({', '.join(shown)})" if shown else run.name)
    return out


def default_metrics(runs: list[Run]) -> list[str]:
    """Loss, eval loss and throughput: whichever of them the runs logged."""
    logged = {k for r in runs for record in r.records for k in record}
    return [m for m in ("loss", "eval_loss", *THROUGHPUT) if m in logged]


def draw(runs: list[Run], metrics: list[str]):
    """The figure: one panel per metric side by side, one line per run."""
    from matplotlib.figure import Figure  # matplotlib only when a picture is drawn (it is slow to import)

    fig = Figure(figsize=(4.5 * len(metrics) + 0.5, 3.8), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics):
        for run, label in zip(runs, labels(runs)):
            steps, values = series(run.records, metric)
            if steps:
                ax.plot(steps, values, label=label, marker="o" if len(steps) < 3 else None)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return fig


def save(fig, path) -> None:
    """PNG bytes written through the run's path type (a local file or a gs:// / s3:// URL)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    path = paths.resolve(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())


def curves_png(run_dir) -> object:
    """<run_dir>/curves.png: loss, eval loss and throughput over the steps (what the trainer leaves)."""
    run = load_run(run_dir)
    path = paths.resolve(run_dir) / "curves.png"
    save(draw([run], default_metrics([run])), path)
    return path


def draw_comparison(rows: list[dict], chosen: str | None):
    """The plan's --compare as a picture: each candidate mesh's memory per device against its estimated
    step time (bytes each device sends where the step time is unknown), the chosen one marked."""
    from matplotlib.figure import Figure

    rows = [r for r in rows if "skipped" not in r]
    timed = all(r["estimated_step_s"] is not None for r in rows)
    x = [r["estimated_step_s"] * 1e3 if timed else r["wire_bytes_per_device"] / 1e6 for r in rows]
    y = [r["memory_per_device"]["total"] / 1e6 for r in rows]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.scatter(x, y, color="tab:blue")
    for xi, yi, r in zip(x, y, rows):
        ax.annotate(r["label"], (xi, yi), textcoords="offset points", xytext=(5, 4), fontsize="small")
        if r["label"] == chosen:
            ax.scatter([xi], [yi], s=220, facecolors="none", edgecolors="tab:red", linewidths=2, label="chosen")
    capacity = next((r["memory_per_device"]["capacity"] for r in rows if r["memory_per_device"]["capacity"]), None)
    if capacity:
        ax.axhline(capacity / 1e6, color="tab:gray", linestyle="--", label="device memory")
    ax.set_xlabel("estimated step (ms)" if timed else "sent per device per step (MB; step time unknown)")
    ax.set_ylabel("memory per device (MB)")
    ax.set_title(f"meshes on {rows[0]['devices']} devices" if rows else "no mesh fits these devices")
    ax.grid(alpha=0.3)
    if chosen or capacity:
        ax.legend(fontsize="small")
    return fig


def main(argv: list[str]) -> int:
    parser = Parser(prog="python -m shard.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--metrics", metavar="a,b", help="comma-separated metrics.jsonl keys (default: loss, "
                        "eval_loss and tokens_per_s or examples_per_s)")
    parser.add_argument("--out", metavar="FILE.png", help="PNG file to write (default: RUN_DIR/curves.png for one "
                        "run; for several, compare.png in the working directory, so that no run's own picture is "
                        "overwritten)")
    args = parser.parse_args(argv)
    runs = [load_run(d) for d in args.runs]
    logged = sorted({k for r in runs for record in r.records for k in record} - {"step"})
    if args.metrics:
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        unknown = [m for m in metrics if m not in logged]
        if unknown or not metrics:
            raise UserError(f"--metrics: {', '.join(unknown) or 'none given'} not logged by these runs; "
                            f"they logged: {', '.join(logged)}")
    else:
        metrics = default_metrics(runs)
        if not metrics:
            raise UserError(f"these runs logged no loss or throughput yet; "
                            f"they logged: {', '.join(logged) or 'nothing'}")
    out = args.out or (str(paths.resolve(args.runs[0]) / "curves.png") if len(runs) == 1 else "compare.png")
    if not out.lower().endswith(".png"):
        raise UserError(f"--out {out}: the picture is a PNG; name a .png file")
    save(draw(runs, metrics), out)
    print(f"wrote {out}")
    return 0

