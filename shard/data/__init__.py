"""Input: a source picked by `data.name`, batched with Grain, placed on the devices ahead of the step.

Global batch `s` is a pure function of (seed, s): a run that restarts at step s sees exactly the
batches it would have seen. Each process reads only its own rows of each global batch.
"""

import collections
from dataclasses import dataclass

import grain
import jax
import numpy as np

from shard.data.sources import Synthetic, text_splits
from shard.errors import UserError

SOURCE_TASKS = {"text": "lm", "synthetic": "classification"}


@dataclass
class Data:
    task: str                # lm, classification, binary or regression
    train: grain.MapDataset  # this process's share of global batch s at index s (endless)
    eval: list               # this process's share of each eval batch (a fixed list)
    batch_size: int          # global
    tokens_per_example: int  # seq_len for sequence data, else 0
    num_classes: int         # classes (or vocabulary) the targets range over; 0 for binary and regression

    def abstract_batch(self) -> dict:
        """Shapes and dtypes of one global batch."""
        local = self.train[0]
        return {k: jax.ShapeDtypeStruct((self.batch_size,) + v.shape[1:], v.dtype) for k, v in local.items()}


def build(cfg, seed: int) -> Data:
    task = SOURCE_TASKS[cfg.name] if cfg.task == "auto" else cfg.task
    if cfg.name == "text":
        if task != "lm":
            raise UserError(f"data.task={cfg.task!r}: the text source only supports lm")
        train_src, eval_src = text_splits(cfg.path, cfg.seq_len, cfg.eval_fraction)
    else:
        if task == "lm":
            raise UserError("data.task=lm needs a text source (data.name=text)")
        features = tuple(cfg.features)
        train_src = Synthetic(cfg.size, features, task, cfg.classes, seed, split=0)
        eval_src = Synthetic(max(cfg.batch_size, cfg.size // 10), features, task, cfg.classes, seed, split=1)

    n_proc, proc = jax.process_count(), jax.process_index()
    if cfg.batch_size % n_proc:
        raise UserError(f"data.batch_size={cfg.batch_size} must be divisible by the {n_proc} processes")
    if len(train_src) < cfg.batch_size:
        raise UserError(f"data.batch_size={cfg.batch_size} is larger than the train split ({len(train_src)} examples)")
    if len(eval_src) < cfg.batch_size:
        raise UserError(f"data.batch_size={cfg.batch_size} is larger than the eval split ({len(eval_src)} examples)")
    local = cfg.batch_size // n_proc
    # Rows of global batch s are examples [s*B, (s+1)*B) of the shuffled, repeated stream;
    # local batch s*n_proc + proc holds this process's contiguous block of them.
    train = grain.MapDataset.source(train_src).seed(seed).shuffle().repeat().batch(local)[proc::n_proc]
    eval_batches = grain.MapDataset.source(eval_src).batch(local, drop_remainder=True)[proc::n_proc]
    tokens = cfg.seq_len if task == "lm" else 0
    classes = 256 if task == "lm" else cfg.classes if task == "classification" else 0
    return Data(task=task, train=train, eval=eval_batches, batch_size=cfg.batch_size, tokens_per_example=tokens,
                num_classes=classes)


def device_batches(batches, shardings: dict, start: int = 0, prefetch: int = 2):
    """Yield global, sharded batches start, start+1, ... keeping `prefetch` of them already on the devices.

    Device transfers are asynchronous, so the next batches move while the current step computes.
    """

    def put(local: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v)) for k, v in local.items()}

    queue: collections.deque = collections.deque()
    index = start
    while True:
        while len(queue) <= prefetch:
            queue.append(put(batches[index]))
            index += 1
        yield queue.popleft()
