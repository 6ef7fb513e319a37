"""SIGTERM and SIGINT, honoured wherever the run is.

Python runs a signal handler only between bytecodes of the main thread, so a handler alone waits for
whatever C++ call is running: a compile, a device step, an eval. We therefore also ask CPython to
write each signal's number to a pipe the moment it arrives (`signal.set_wakeup_fd`), and a watcher
thread reads it:

- in the training loop (phase "loop"), a signal only sets `received`: the loop finishes the step in
  flight, writes a checkpoint and returns, and the process exits 0;
- in every other phase (start-up and compile, the final eval and sample), the watcher says what was
  saved and ends the process at once: exit 0 once this run's final checkpoint is written, else
  128 + the signal's number, as if the signal had killed it;
- a second signal ends the process at once in any phase.
"""

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self):
        self.received: str | None = None  # the first signal's name
        self.phase = "start"
        self.saved = "no checkpoint was written by this run"  # said when the watcher ends the process
        self.exit_code: int | None = None  # for a stop outside the loop; None: 128 + signal number
        self.main = True  # whether this process prints (process 0 of a multi-process job)
        self._previous: dict = {}
        self._previous_fd = -1
        self._pipe = None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals are the main thread's; a run started elsewhere leaves them alone
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, daemon=True, name="shard-stop-watcher").start()
        return self

    def __exit__(self, *exc):
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._pipe[1])  # the watcher reads end-of-file and returns
        self._pipe = None

    def enter_phase(self, phase: str, saved: str, exit_code: int | None = None) -> None:
        """From now on a stop means `phase`; `saved` says what a stop here leaves behind. A signal that
        arrived before (e.g. while the loop was closing) takes effect now."""
        self.phase, self.saved, self.exit_code = phase, saved, exit_code
        if self.received and phase != "loop":
            self._end(self.received, signal.Signals[self.received])

    def _handle(self, signum, frame):  # main thread, between bytecodes
        self.received = self.received or signal.Signals(signum).name

    def _watch(self):
        read, count = self._pipe[0], 0
        while True:
            try:
                data = os.read(read, 1)
            except OSError:
                return
            if not data:
                os.close(read)
                return
            sig = signal.Signals(data[0])
            if sig not in SIGNALS:
                continue
            count += 1
            self.received = self.received or sig.name
            if count > 1:
                self._end(sig.name, sig, again=True)
            if self.phase != "loop":
                self._end(sig.name, sig)

    def _end(self, name: str, sig: signal.Signals, again: bool = False) -> None:
        what = "by a second signal" if again else f"during {self.phase}"
        code = 128 + sig.value if again or self.exit_code is None else self.exit_code
        if self.main:
            print(f"{name}: stopped {what}; {self.saved}", flush=True)
        sys.stderr.flush()
        os._exit(code)
