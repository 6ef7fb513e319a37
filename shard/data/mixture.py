"""`data.mixture`: several document corpora, each with a weight, sampled in that proportion.

Each source is read as `data.path` is (same field, tokenizer, packing), then the train splits are laid
end to end as one random-access source (`Concat`); `MixOrder` maps a stream position to a row of it with
Grain's `MapDataset.mix`, so global batch s stays a pure function of (seed, s) and each process still reads
only its own rows (`TrainBatches`, `Rows`). Eval keeps each source's split apart, for per-source metrics.
"""

import dataclasses
import numbers
from pathlib import Path

import grain
import numpy as np

from shard.errors import UserError


def check(mixture: dict, path) -> None:
    """One line for a mixture that cannot be read: beside data.path, or a weight that is not a positive number."""
    if path is not None:
        raise UserError("data.path and data.mixture are exclusive: give one corpus in data.path or several in "
                        "data.mixture")
    for source, weight in mixture.items():
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not weight > 0:
            raise UserError(f"data.mixture: {source}: {weight!r} is not a weight; a weight is a positive number")


def labels(paths: list[str]) -> list[str]:
    """Short, stable names for the sources: the stem of each path's last part without glob characters
    (b/*.jsonl -> b), made unique."""
    names = []
    for path in paths:
        plain = [part for part in Path(path).parts if not any(c in part for c in "*?[")]
        stem = (plain[-1].split(".")[0] if plain else "") or "source"
        name, n = stem, 1
        while name in names:
            n += 1
            name = f"{stem}_{n}"
        names.append(name)
    return names


def splits(cfg, cache_dir) -> tuple:
    """(train sources, eval sources by label, weights, the largest token id of them all) of a mixture, each
    source read as data.path would be."""
    from shard.data import packing

    check(cfg.mixture, cfg.path)
    trains, evals, largest = [], {}, -1
    for name, (path, _) in zip(labels(list(cfg.mixture)), cfg.mixture.items()):
        try:
            train, held, cache = packing.splits(dataclasses.replace(cfg, path=str(path), mixture={}), cache_dir)
        except UserError as e:  # say which source
            raise UserError(f"data.mixture: {path}: {e}") from None
        if len(train) == 0:
            raise UserError(f"data.mixture: {path} holds no train row of data.seq_len={cfg.seq_len} + 1 tokens")
        trains.append(train)
        evals[name] = held
        largest = max(largest, cache.largest_token)
    windows = [s for s in (*trains, *evals.values()) if isinstance(s, packing.ConcatWindows)]
    if any(s.masked for s in windows):  # fine-tuning rows beside plain documents: one batch shape for all
        for s in windows:
            s.masked = True
    return trains, evals, [float(w) for w in cfg.mixture.values()], largest


class Concat:
    """Sources laid end to end: index i of source k is offsets[k] + i. One `read_batch` per source touched."""

    def __init__(self, sources: list):
        self.sources = sources
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in sources])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def which(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def read_batch(self, indices: np.ndarray) -> dict:
        indices = np.asarray(indices, np.int64)
        owner = self.which(indices)
        parts = {k: self.sources[k].read_batch(indices[owner == k] - self.offsets[k]) for k in np.unique(owner)}
        first = next(iter(parts.values()))
        batch = {key: np.empty((len(indices), *v.shape[1:]), v.dtype) for key, v in first.items()}
        for k, part in parts.items():
            for key, v in part.items():
                batch[key][owner == k] = v
        return batch


class MixOrder:
    """Stream position -> row of a `Concat`: Grain's `MapDataset.mix` of each source's own endless shuffle
    (a fresh one each epoch), in proportion to the weights; one Grain lookup per position."""

    def __init__(self, concat: Concat, weights: list[float], seed: int):
        streams = [grain.MapDataset.range(len(s)).seed(seed + k).shuffle().repeat()
                   .map(lambda i, base=int(concat.offsets[k]): base + i) for k, s in enumerate(concat.sources)]
        self.stream = grain.MapDataset.mix(streams, weights)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return np.array([self.stream[int(p)] for p in positions], np.int64)
