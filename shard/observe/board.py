"""TensorBoard event files for a run, written with tensorboardX (no TensorFlow needed).

`tensorboard --logdir <run.dir>` then shows every metrics record as scalars grouped by kind
(train/, eval/, perf/), the resolved config as text and the parameter count. A resumed run opens
a new event file with `purge_step` set to its first new step, so TensorBoard drops what the old
file logged past the checkpoint and no step appears twice. Under a URL run.dir (gs://, s3://) the
event file is written locally and copied through the run's path type at most every
shard.observe.metrics.UPLOAD_EVERY_S seconds and when the run ends (only files that grew since their last copy),
so any store that holds the run holds its events; a failed copy is a warning, never the run's end.
"""

import shutil
import tempfile
import uuid
from pathlib import Path

from shard import paths
from shard.observe.metrics import Uploads

# Record keys that describe the machine's speed and memory, not the model's learning.
PERF_KEYS = frozenset({"step_time_s", "data_wait_s", "tokens_per_s", "examples_per_s", "tflops_per_device",
                       "mfu", "peak_memory_gb", "compile_s", "startup_s"})


def tag(key: str) -> str:
    """The TensorBoard tag of a metrics record key: eval_loss -> eval/loss, mfu -> perf/mfu, loss -> train/loss;
    lm-evaluation-harness's lm_eval/<task>/<metric> as it is."""
    if key.startswith("lm_eval/"):
        return key
    if key.startswith("eval_"):
        return "eval/" + key.removeprefix("eval_")
    return ("perf/" if key in PERF_KEYS else "train/") + key


class Board:
    """One run's TensorBoard writer (process 0 only; the trainer makes none elsewhere)."""

    def __init__(self, directory, start_step: int):
        self.remote = paths.resolve(directory) if paths.is_remote(directory) else None
        self.local = tempfile.mkdtemp(prefix="shard-tensorboard-") if self.remote else str(directory)
        # A fresh run starts at step 0 and has nothing to purge; a resumed one purges from start_step + 1.
        # Event files are named by the second they were opened and the host: a suffix of its own keeps a
        # second run (or resume) started within the same second from overwriting this one's file.
        from tensorboardX import SummaryWriter  # here, not at import: it imports torch where that is installed (~2 s)

        self.writer = SummaryWriter(self.local, purge_step=start_step + 1 if start_step else None,
                                    filename_suffix="." + uuid.uuid4().hex[:8])
        self.uploads, self.copied = Uploads(f"TensorBoard events to {self.remote}"), {}

    def describe(self, step: int, config_yaml: str, model: str, parameters: int) -> None:
        """The run's config and size, at the step the run (or its resume) begins."""
        indented = "\n".join("    " + line for line in config_yaml.splitlines())  # Markdown code block
        self.writer.add_text("config", indented, step)
        self.writer.add_text("model", f"{model}: {parameters:,} parameters", step)
        self.writer.add_scalar("model/parameters", parameters, step)
        self.flush()

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag(key), value, step)
        self.flush()  # records are few (one a log step); a stop that ends the process loses none

    def flush(self, force: bool = False) -> None:
        self.writer.flush()
        if self.remote and (force or self.uploads.due()):
            self.uploads.attempt(self._copy)

    def _copy(self) -> None:
        self.remote.mkdir(parents=True, exist_ok=True)
        for f in Path(self.local).iterdir():
            if self.copied.get(f.name) != f.stat().st_size:
                (self.remote / f.name).write_bytes(f.read_bytes())
                self.copied[f.name] = f.stat().st_size

    def close(self) -> None:
        self.flush(force=True)
        self.writer.close()
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)
