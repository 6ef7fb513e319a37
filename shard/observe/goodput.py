"""Where a run's wall time went, across restarts: <run.dir>/goodput.jsonl, and `python -m shard.goodput RUN`.

Process 0 of each attempt (a start, a resume, a restart by the launcher) appends a `start` record with the
wall time its process started, then one `span` record per piece of time it spends on something known:

  startup     process start to the first step: imports, devices, data, building the state (less what follows)
  compile     compiling the steps
  restore     reading a checkpoint (a resume, a restart, a rollback) or initialising the state
  steps       productive steps: the first time each step is trained
  retrained   steps trained again: past the checkpoint a restart or rollback went back to
  data_wait   the steps' wait for input
  checkpoint  the loop's part of a save (an async save's background writing overlaps the steps)
  eval        evaluations, the final one included

`lost` is the time between one attempt's last record and the next attempt's process start (the failure,
its detection, the launcher's restart); `other` is the rest of each attempt (the final sample, logging,
steps after the last log point of an attempt that failed). Goodput is `steps` over the whole wall time.
"""

import contextlib
import json
import time

from shard import paths
from shard.cli import Parser
from shard.errors import UserError
from shard.observe.metrics import MetricsLog, seconds_of_startup

FILE = "goodput.jsonl"
KINDS = ("startup", "compile", "restore", "steps", "retrained", "data_wait", "checkpoint", "eval", "lost", "other")


def read(run_dir) -> list[dict]:
    path = paths.resolve(run_dir) / FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line a kill cut short
            out.append(json.loads(line))
    return out


class Recorder:
    """This attempt's records (process 0 writes; every process may call)."""

    def __init__(self, run_dir, enabled: bool):
        earlier = read(run_dir) if enabled else []
        self.attempt = 1 + sum(r.get("event") == "start" for r in earlier)
        self.high = max((r["step"] for r in earlier if r.get("kind") in ("steps", "retrained")), default=0)
        self.log = MetricsLog(run_dir, name=FILE)
        self.log.enabled = self.log.enabled and enabled
        since = seconds_of_startup()
        self.process_start = time.time() - (since or 0.0)
        self.spent, self.looping = 0.0, False  # seconds of spans so far: before the loop, startup is the rest
        self.log.write({"event": "start", "attempt": self.attempt, "t": time.time(),
                        "process_start": self.process_start})

    def span(self, kind: str, seconds: float, **extra) -> None:
        self.spent += seconds
        self.log.write({"event": "span", "attempt": self.attempt, "kind": kind, "s": seconds, "t": time.time(),
                        **extra})

    @contextlib.contextmanager
    def timed(self, kind: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(kind, time.perf_counter() - start)

    def loop_starts(self) -> None:
        """Everything before the first step that no span named was start-up (once: a rollback's loop too)."""
        if not self.looping:
            self.looping = True
            self.span("startup", max(0.0, time.time() - self.process_start - self.spent))

    def steps(self, last: int, n: int, seconds: float, data_wait: float) -> None:
        """`n` steps ending at step `last` took `seconds`, `data_wait` of them waiting for input. Those at or
        below the highest step any attempt reached before are retrained; each kind gets its share of the time."""
        again = max(0, min(n, self.high - (last - n)))
        busy = max(0.0, seconds - data_wait)
        if again:
            self.span("retrained", busy * again / n, step=last - n + again, n=again)
        if n > again:
            self.span("steps", busy * (n - again) / n, step=last, n=n - again)
        self.span("data_wait", data_wait)
        self.high = max(self.high, last)

    def rolled_back(self, bad_step: int) -> None:
        """The steps up to the bad one were spent; trained again, they count as retrained."""
        self.high = max(self.high, bad_step)

    def end(self) -> str:
        self.log.write({"event": "end", "attempt": self.attempt, "t": time.time()})
        self.log.close()
        totals = account(read(self.log.path.parent)) if self.log.enabled else {}
        return summary(totals) if totals else ""


def account(records: list[dict]) -> dict:
    """Seconds per kind (KINDS), `wall` (first process start to the last record) and `retrained_steps`."""
    totals = dict.fromkeys(KINDS, 0.0)
    totals["retrained_steps"], totals["attempts"] = 0, 0
    attempts: dict[int, list] = {}
    for r in records:
        attempts.setdefault(r.get("attempt", 1), []).append(r)
    previous_end = None
    first = None
    for number in sorted(attempts):
        rs = attempts[number]
        start = next((r["process_start"] for r in rs if r.get("event") == "start"), min(r["t"] for r in rs))
        end = max(r["t"] for r in rs)
        first = start if first is None else first
        if previous_end is not None:
            totals["lost"] += max(0.0, start - previous_end)
        spans = [r for r in rs if r.get("event") == "span"]
        for r in spans:
            totals[r["kind"]] = totals.get(r["kind"], 0.0) + r["s"]
            if r["kind"] == "retrained":
                totals["retrained_steps"] += r.get("n", 0)
        totals["other"] += max(0.0, (end - start) - sum(r["s"] for r in spans))
        totals["attempts"] += 1
        previous_end = end
    totals["wall"] = (previous_end - first) if first is not None else 0.0
    return totals


def summary(totals: dict) -> str:
    wall = totals["wall"] or 1e-9
    parts = ", ".join(f"{k} {totals[k] / wall:.0%}" for k in KINDS if k != "steps" and totals[k] / wall >= 0.005)
    restarts = totals["attempts"] - 1
    again = f"; {restarts} restart(s), {totals['retrained_steps']} steps trained again" if restarts else ""
    return f"goodput {totals['steps'] / wall:.1%} of {wall:,.1f} s in productive steps ({parts}{again})"


def table(totals: dict) -> str:
    wall = totals["wall"] or 1e-9
    rows = [f"{'':<12}{'seconds':>12}{'share':>9}"]
    rows += [f"{k:<12}{totals[k]:>12.2f}{totals[k] / wall:>9.1%}" for k in KINDS]
    rows += [f"{'wall':<12}{totals['wall']:>12.2f}{1:>9.1%}",
             f"attempts {totals['attempts']}, steps trained again {totals['retrained_steps']}"]
    return "\n".join(rows)


def bar_chart(totals: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    values = [totals[k] for k in KINDS]
    ax.barh(KINDS[::-1], values[::-1], color=["tab:green" if k == "steps" else "tab:gray" for k in KINDS[::-1]])
    ax.set_xlabel("seconds")
    ax.set_title(f"goodput {totals['steps'] / (totals['wall'] or 1e-9):.1%} of {totals['wall']:,.0f} s")
    fig.tight_layout()
    with paths.resolve(path).open("wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m shard.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", metavar="RUN_DIR", help=f"a run folder with {FILE}")
    run = parser.parse_args(argv).run
    records = read(run)
    if not records:
        raise UserError(f"{run!r} has no {FILE}: it is not a run folder, or its run has not started")
    totals = account(records)
    print(table(totals))
    png = paths.resolve(run) / "goodput.png"
    bar_chart(totals, png)
    print(f"{summary(totals)}\nbar chart: {png}")
