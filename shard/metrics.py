"""Metrics: one JSON line per log step in <run.dir>/metrics.jsonl, and the memory and time a run has used."""

import json
import os
import time
from pathlib import Path

import jax

from shard import paths

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


class MetricsLog:
    """Appends records to metrics.jsonl, and hands each to the TensorBoard writer when there is one;
    only process 0 writes. Object stores (gs://, s3://) cannot append, so there the file is rewritten
    whole at each record (it stays small: one line a log step)."""

    def __init__(self, run_dir, board=None):
        self.path = paths.resolve(run_dir) / "metrics.jsonl"
        self.enabled = jax.process_index() == 0
        self.board = board if self.enabled else None
        self.remote = paths.is_remote(self.path)
        self.text = self.path.read_text() if self.enabled and self.remote and self.path.exists() else ""

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.board:
            self.board.write(record)
        line = json.dumps(record) + "\n"
        if self.remote:
            self.text += line
            self.path.write_text(self.text)
        else:
            with self.path.open("a") as f:
                f.write(line)

    def close(self) -> None:
        if self.board:
            self.board.close()
