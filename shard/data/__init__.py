"""Input: a source picked by `data.name`, a Grain pipeline, and batches placed on the devices ahead of the step.

Pipeline: source -> shuffle (seeded) -> transforms -> batch. Global batch `s` is a pure function of
(seed, s), so a run that restarts at step s sees exactly the batches it would have seen, and each
process reads only its own rows of each global batch. A background thread keeps `data.prefetch`
batches already on the devices, so reading and transferring overlap the step.
"""

import queue
import threading
from dataclasses import dataclass

import grain
import jax
import numpy as np

from shard.data import sources
from shard.errors import UserError

TARGET_DTYPES = {"lm": np.int32, "classification": np.int32, "binary": np.float32, "regression": np.float32}


@dataclass
class Data:
    task: str                # lm, classification, binary or regression
    train: grain.MapDataset  # this process's share of global batch s at index s (endless)
    eval: "EvalBatches"      # the whole eval split, this process's share, padded and masked
    batch_size: int          # global
    tokens_per_example: int  # seq_len for sequence data, else 0
    num_classes: int         # classes (or vocabulary) the targets range over; 0 for binary and regression

    def abstract_batch(self, eval: bool = False) -> dict:
        """Shapes and dtypes of one global batch (eval batches also carry a `mask`)."""
        local = self.eval[0] if eval else self.train[0]
        return {k: jax.ShapeDtypeStruct((self.batch_size,) + v.shape[1:], v.dtype) for k, v in local.items()}


def load_splits(cfg, seed: int) -> tuple:
    """(train source, eval source, the source's own task)."""
    if cfg.name == "text":
        return (*sources.text_splits(cfg.path, cfg.seq_len, cfg.eval_fraction), "lm")
    if cfg.name == "digits":
        return sources.digits(cfg.eval_fraction)
    if cfg.name == "tabular":
        return sources.tabular(cfg.path, cfg.target, cfg.eval_fraction)
    if cfg.name == "arrays":
        return sources.arrays(cfg.path, cfg.eval_fraction)
    if cfg.name == "array_record":
        return sources.array_record(cfg.path, cfg.eval_fraction)
    task = "classification" if cfg.task == "auto" else cfg.task
    if task == "lm":
        raise UserError("data.task=lm needs a text source (data.name=text)")
    features = tuple(cfg.features)
    return (sources.Synthetic(cfg.size, features, task, cfg.classes, seed, split=0),
            sources.Synthetic(max(cfg.batch_size, cfg.size // 10), features, task, cfg.classes, seed, split=1), task)


def build(cfg, seed: int) -> Data:
    train_src, eval_src, own_task = load_splits(cfg, seed)
    task = own_task if cfg.task == "auto" else cfg.task
    if (task == "lm") != (own_task == "lm"):
        raise UserError(f"data.task={task}: the {cfg.name} source's task is {own_task}; lm goes with text only")

    n_proc, proc = jax.process_count(), jax.process_index()
    if cfg.batch_size % n_proc:
        raise UserError(f"data.batch_size={cfg.batch_size} must be divisible by the {n_proc} processes")
    if len(train_src) < cfg.batch_size:
        raise UserError(f"data.batch_size={cfg.batch_size} is larger than the train split "
                        f"({len(train_src)} examples of data.name={cfg.name})")
    local = cfg.batch_size // n_proc
    cast = lambda ex: {"inputs": ex["inputs"], "targets": np.asarray(ex["targets"], TARGET_DTYPES[task])}
    # Rows of global batch s are examples [s*B, (s+1)*B) of the shuffled, repeated stream;
    # local batch s*n_proc + proc holds this process's contiguous block of them.
    train = (grain.MapDataset.source(train_src).seed(seed).shuffle().map(cast).repeat()
             .batch(local)[proc::n_proc])
    eval_batches = EvalBatches(grain.MapDataset.source(eval_src).map(cast), cfg.batch_size, n_proc, proc)
    tokens = cfg.seq_len if task == "lm" else 0
    classes = {"lm": 256, "classification": _num_classes(cfg, train_src, task)}.get(task, 0)
    return Data(task=task, train=train, eval=eval_batches, batch_size=cfg.batch_size, tokens_per_example=tokens,
                num_classes=classes)


def _num_classes(cfg, train_src, task: str) -> int:
    if cfg.name == "synthetic":
        return cfg.classes
    targets = getattr(train_src, "targets", None)
    return int(np.max(targets)) + 1 if targets is not None else 0


class EvalBatches:
    """Every example of the eval split exactly once, in global batches; the last is padded and carries
    `mask` 0 on its padding so metrics count only real examples."""

    def __init__(self, dataset: grain.MapDataset, batch_size: int, n_proc: int, proc: int):
        self.dataset, self.batch_size, self.n_proc, self.proc = dataset, batch_size, n_proc, proc

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __getitem__(self, i: int) -> dict:
        local = self.batch_size // self.n_proc
        start = i * self.batch_size + self.proc * local
        rows = [start + j for j in range(local)]
        examples = [self.dataset[r if r < len(self.dataset) else 0] for r in rows]
        batch = {k: np.stack([ex[k] for ex in examples]) for k in examples[0]}
        batch["mask"] = np.array([r < len(self.dataset) for r in rows], np.float32)
        return batch


def device_batches(batches, shardings: dict, start: int = 0, prefetch: int = 2):
    """Yield global, sharded batches start, start+1, ... A background thread reads and transfers up to
    `prefetch` batches ahead while the current step runs (0: read in the loop, nothing overlaps)."""

    def put(index: int) -> dict:
        local = batches[index]
        return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v)) for k, v in local.items()}

    if prefetch == 0:
        index = start
        while True:
            yield put(index)
            index += 1
    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def produce():
        index = start
        while not stop.is_set():
            try:
                item = put(index)
            except Exception as e:  # hand the error to the consumer
                item = e
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Exception):
                return
            index += 1

    thread = threading.Thread(target=produce, name="shard-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()  # never leave it inside a JAX call while the interpreter shuts down
