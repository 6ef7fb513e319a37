"""`run.profile_steps=START:END`: a jax.profiler trace of steps START..END-1 (as the log numbers them).

The trace goes to <run.dir>/profile/ (one folder per process when there are several), in the layout
TensorBoard's profile plugin and XProf read, with a Perfetto trace beside it. Each step is annotated
with its number. Tracing starts once the steps before START have finished and stops once step END-1
has, so the trace holds the range and nothing else.
"""

import contextlib

import jax

from shard import paths


class StepProfiler:
    """Starts and stops one trace around a range of steps; does nothing when there is no range."""

    def __init__(self, steps: range | None, run_dir, say):
        self.steps, self.say, self.tracing = steps, say, False
        self.first = self.last = None
        folder = paths.resolve(run_dir) / "profile"
        self.folder = folder if jax.process_count() == 1 else folder / f"process_{jax.process_index()}"

    def step(self, number: int, before):
        """Context around dispatching step `number`; `before` (the outputs of the step before) is awaited
        first when the trace starts here, so earlier steps stay out of it."""
        if self.steps is None or number not in self.steps:
            return contextlib.nullcontext()
        if not self.tracing:
            jax.block_until_ready(before)
            self.folder.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self.tracing, self.first = True, number  # a run resumed inside the range starts later
        return jax.profiler.StepTraceAnnotation("train", step_num=number)

    def after(self, number: int, outputs) -> None:
        """Stop once the range's last step has finished."""
        self.last = number
        if self.tracing and number == self.steps[-1]:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Ends the trace (also when the run stops inside the range) and says where it is."""
        if not self.tracing:
            return
        jax.profiler.stop_trace()
        self.tracing = False
        self.say(f"profile of steps {self.first}-{self.last}: {self.folder} (tensorboard --logdir "
                 f"{self.folder}, or its perfetto_trace.json.gz at ui.perfetto.dev)")
