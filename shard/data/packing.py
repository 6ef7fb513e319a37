"""Packing whole documents into rows (`data.packing=documents`).

`data.packing=concat` joins a split's documents into one stream and cuts it into windows, so a row's
attention crosses from one document into the next. With `documents`, each row holds whole documents
placed first-fit, in order (a document longer than a row is cut into row-sized pieces), and says which
token belongs to which: a row's `segment_ids` number its documents from 1 (0 = padding), `positions`
restart at 0 with each document, `loss_mask` is 1 where a target counts. The step hands the first two
to the model's hooks (attention stays inside a document, positions follow it) and weights the loss with
the third (shard/core/step.py).

A document of n tokens gives n - 1 (input, next token) pairs; a row holds `seq_len` pairs. A longer one
is cut into pieces of seq_len + 1 tokens overlapping by one, so every pair is trained on exactly once.
"""

from collections.abc import Iterable, Iterator

import numpy as np

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def pieces(document, seq_len: int) -> Iterator[np.ndarray]:
    """The document's tokens cut into pieces of at most seq_len + 1 tokens (seq_len pairs), each piece's
    first token the last of the one before; a document of fewer than 2 tokens has no pair and no piece."""
    tokens = np.asarray(document)
    for start in range(0, max(len(tokens) - 1, 0), seq_len):
        yield tokens[start:start + seq_len + 1]


def row_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Each slot's position within its run of equal segment ids along the last axis (0 at each start)."""
    index = np.broadcast_to(np.arange(segment_ids.shape[-1]), segment_ids.shape)
    starts = np.ones(segment_ids.shape, bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    return (index - np.maximum.accumulate(np.where(starts, index, 0), axis=-1)).astype(np.int32)


class _Row:
    def __init__(self, seq_len: int):
        self.inputs = np.zeros(seq_len, np.int32)
        self.targets = np.zeros(seq_len, np.int32)
        self.segment_ids = np.zeros(seq_len, np.int32)
        self.used, self.documents = 0, 0

    def add(self, piece: np.ndarray) -> None:
        n = len(piece) - 1
        span = slice(self.used, self.used + n)
        self.inputs[span], self.targets[span] = piece[:-1], piece[1:]
        self.documents += 1
        self.segment_ids[span] = self.documents
        self.used += n

    def done(self) -> dict:
        mask = (self.segment_ids > 0).astype(np.float32)
        return {"inputs": self.inputs, "targets": self.targets, "segment_ids": self.segment_ids,
                "positions": row_positions(self.segment_ids), "loss_mask": mask}


def pack(documents: Iterable, seq_len: int, open_rows: int = 1024) -> Iterator[dict]:
    """Rows of `seq_len` slots (dicts of KEYS) filled first-fit from a stream of tokenized documents: each
    piece goes into the first open row with room for it, else a new row. A row is yielded when it is full;
    past `open_rows` open rows, the oldest is yielded as it stands (the stream may be endless); at the end,
    the rest in the order they opened. Deterministic: the same documents give the same rows."""
    rows: list[_Row] = []
    free = np.zeros(0, np.int64)  # each open row's free slots, in the order they opened: the search is numpy's
    for document in documents:
        for piece in pieces(document, seq_len):
            need = len(piece) - 1
            fits = np.flatnonzero(free >= need)
            if fits.size:
                i = int(fits[0])
            else:
                if len(rows) == open_rows:
                    yield rows.pop(0).done()
                    free = free[1:]
                rows.append(_Row(seq_len))
                free, i = np.append(free, seq_len), len(rows) - 1
            rows[i].add(piece)
            free[i] -= need
            if free[i] == 0:
                yield rows.pop(i).done()
                free = np.delete(free, i)
    for row in rows:
        yield row.done()


class PackedRows:
    """A split's documents packed into rows, as a random-access source (shard/data/sources.py's protocol):
    each row's inputs, targets, segment_ids, positions and loss_mask. Tokens and segment ids are held in
    the smallest integer type that fits; positions and the mask are derived from the segment ids per read."""

    def __init__(self, documents: Iterable, seq_len: int):
        rows = list(pack(documents, seq_len))
        stack = lambda key: np.stack([r[key] for r in rows]) if rows else np.zeros((0, seq_len), np.int32)
        tokens = [stack("inputs"), stack("targets")]
        top = max([int(t.max()) for t in tokens if t.size] + [0])
        self.inputs, self.targets = (t.astype(np.min_scalar_type(top)) for t in tokens)
        self.segment_ids = stack("segment_ids").astype(np.min_scalar_type(seq_len))
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        return {k: v[0] for k, v in self.read_batch(np.array([i])).items()}

    def read_batch(self, indices: np.ndarray) -> dict:
        segments = self.segment_ids[indices].astype(np.int32)
        return {"inputs": self.inputs[indices].astype(np.int32), "targets": self.targets[indices].astype(np.int32),
                "segment_ids": segments, "positions": row_positions(segments),
                "loss_mask": (segments > 0).astype(np.float32)}

    def efficiency(self) -> float:
        """The share of the rows' target slots that hold a real target."""
        return float(np.mean(self.segment_ids > 0)) if len(self) else 0.0
