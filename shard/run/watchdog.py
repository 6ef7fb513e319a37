"""`run.step_timeout_s`: a run whose steps stop finishing (a hung collective, a dead link, a stuck host
callback) writes every thread's Python stack and the last collective it entered to the run folder, says so
in one line and exits non-zero, so that the launcher's --max-restarts starts the job again.

A thread watches the time since the last step finished; the loop marks each finished step (`beat`) and
pauses the watch around what is not a step (checkpoint saves, evaluations). `None` (the default) is off
on CPU (tests, laptops: a debugger's breakpoint is no hang) and elsewhere AUTO_MULTIPLE times the measured
step time, at least AUTO_FLOOR_S; until a step time is measured, the first steps get FIRST_STEPS_S.
"""

import contextlib
import faulthandler
import os
import sys
import tempfile
import threading
import time

from shard import paths
from shard.run import distributed

HANG_EXIT = 3  # the process's exit status after a hang: not 1 (an error) nor 2 (bad input)
AUTO_MULTIPLE = 100
AUTO_FLOOR_S = 300.0
FIRST_STEPS_S = 1800.0


def timeout_for(setting: float | None, platform: str) -> float | None:
    """The timeout to watch with before any step time is known: None = off."""
    if setting == 0 or (setting is None and platform == "cpu"):
        return None
    return FIRST_STEPS_S if setting is None else float(setting)


class Watchdog:
    def __init__(self, setting: float | None, platform: str, run_dir, say=print):
        self.auto = setting is None
        self.timeout = timeout_for(setting, platform)
        self.run_dir, self.say = run_dir, say
        self.last, self.step, self.paused_since = time.monotonic(), None, None
        self._done = threading.Event()
        if self.timeout is not None:
            threading.Thread(target=self._watch, daemon=True, name="shard-step-watchdog").start()

    def beat(self, step: int, step_time_s: float | None = None) -> None:
        """Step `step` finished; `step_time_s`, once measured, sets an automatic timeout."""
        self.last, self.step = time.monotonic(), step
        if self.auto and step_time_s and self.timeout is not None:
            self.timeout = max(AUTO_FLOOR_S, AUTO_MULTIPLE * step_time_s)

    @contextlib.contextmanager
    def paused(self):
        """Not a step (a save, an eval): its time counts toward no timeout."""
        self.paused_since = time.monotonic()
        try:
            yield
        finally:
            self.paused_since = None
            self.last = time.monotonic()

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout / 10)):
            if self.paused_since is None and time.monotonic() - self.last > self.timeout:
                self._hung()

    def _hung(self) -> None:
        import jax

        me = jax.process_index()
        after = f"after step {self.step}" if self.step is not None else "before the first step finished"
        header = (f"process {me}: no step finished within run.step_timeout_s={self.timeout:g} s ({after}); "
                  f"last collective entered: {distributed.last_collective or 'none yet'}\n\n")
        where = paths.resolve(self.run_dir) / f"hang-process{me}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        try:
            where = write_stacks(where, header)
        except OSError as e:
            where = f"(not written: {e})"
        print(f"error: {header.strip()}; every thread's stack: {where}; exiting (status {HANG_EXIT}) so that the "
              "launcher can restart the job", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(HANG_EXIT)


def write_stacks(where, header: str):
    """Every thread's Python stack (faulthandler: it needs a real file, so a URL run folder gets a copy)."""
    local = where if not paths.is_remote(where) else paths.resolve(tempfile.mkstemp(suffix=".txt")[1])
    with open(local, "w") as f:
        f.write(header)
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    if local != where:
        where.write_text(local.read_text())
    return where
