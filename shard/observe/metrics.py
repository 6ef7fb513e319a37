"""Metrics: one JSON line per log step in <run.dir>/metrics.jsonl, and the memory and time a run has used."""

import json
import os
import time
from pathlib import Path

import jax

from shard import paths
from shard.errors import first_line, warn

UPLOAD_EVERY_S = 30.0  # a URL run folder's logs are copied at most this often (and when the run closes them)


class Uploads:
    """What a URL run folder costs its log writers: an upload at most every UPLOAD_EVERY_S seconds, not one per
    record, and a failed write only a warning (once until one succeeds again) that never costs the run or its
    checkpoints; what was not written stays here and goes with the next upload."""

    def __init__(self, what: str):
        self.what, self.last, self.failing = what, float("-inf"), False  # the first write goes at once

    def due(self) -> bool:
        return time.monotonic() - self.last >= UPLOAD_EVERY_S

    def attempt(self, write) -> None:
        self.last = time.monotonic()
        try:
            write()
        except Exception as e:  # the store's errors are of many kinds; none may end the run
            if not self.failing:
                warn(f"writing {self.what} failed ({first_line(e)}); training goes on, and the log is written "
                     "again at the next upload")
            self.failing = True
        else:
            self.failing = False

def peak_memory_gb() -> float | None:
    """Most device memory this process's first device has held so far, in GB (10^9 bytes), where the
    runtime reports it (GPUs and TPUs; not the CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return peak / 1e9 if peak is not None else None


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc; None elsewhere): start-up cost, imports included."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_RUNS_BEGAN: list[float] = []  # time.time() as each trainer run in this process began (run_began)


def run_began() -> None:
    _RUNS_BEGAN.append(time.time())


def seconds_of_startup() -> float | None:
    """Wall seconds since this run's start-up began: the process's start for the first run in a process (imports
    included), the run's own start for a later one (a library user's second trainer.run, bench/vs_torch.py's
    rounds), which would otherwise count the runs before it as its start-up."""
    if len(_RUNS_BEGAN) > 1:
        return time.time() - _RUNS_BEGAN[-1]
    return seconds_since_process_start()


class MetricsLog:
    """Appends records to metrics.jsonl, and hands each to the TensorBoard writer when there is one;
    only process 0 writes. Object stores (gs://, s3://) cannot append, so there the file is rewritten
    whole, at most every UPLOAD_EVERY_S seconds and when the log closes (it stays small: one line a log
    step). A write that fails is a warning, never the run's end."""

    def __init__(self, run_dir, board=None, name: str = "metrics.jsonl"):
        self.path = paths.resolve(run_dir) / name
        self.enabled = jax.process_index() == 0
        self.board = board if self.enabled else None
        self.remote = paths.is_remote(self.path)
        self.text = self.path.read_text() if self.enabled and self.remote and self.path.exists() else ""
        self.uploads = Uploads(str(self.path))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.board:
            self.board.write(record)
        line = json.dumps(record) + "\n"
        if self.remote:
            self.text += line
            if self.uploads.due():
                self.uploads.attempt(lambda: self.path.write_text(self.text))
        else:
            self.uploads.attempt(lambda: self._append(line))

    def keep_until(self, step: int) -> None:
        """A run resumed at `step` (a restart, a rollback) trains the steps after it again: their old records
        (and a line a kill cut short) move to metrics.discarded.jsonl, so each step is logged once."""
        if not self.enabled:
            return
        text = self.text if self.remote else (self.path.read_text() if self.path.exists() else "")
        kept, dropped = [], []
        for line in text.splitlines(keepends=True):
            try:
                record = json.loads(line)
                keep = line.endswith("\n") and record.get("step", 0) <= step
            except ValueError:
                keep = False
            (kept if keep else dropped).append(line if line.endswith("\n") else line + "\n")
        if not dropped:
            return
        self.text = "".join(kept)
        discarded = self.path.with_name("metrics.discarded.jsonl")
        old = discarded.read_text() if discarded.exists() else ""
        self.uploads.attempt(lambda: (discarded.write_text(old + "".join(dropped)), self.path.write_text(self.text)))
        if self.remote:
            self.uploads.last = float("-inf")
        else:
            self.text = ""

    def _append(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(line)

    def close(self) -> None:
        if self.enabled and self.remote:
            self.uploads.attempt(lambda: self.path.write_text(self.text))
        if self.board:
            self.board.close()
