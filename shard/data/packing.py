"""Documents (a token cache) cut into fixed-length language-model rows, `data.packing` says how.

`concat` (GPT-2 / nanoGPT): the split's documents, each ending in its separator (EOS), joined into one
stream and cut into consecutive windows of seq_len + 1 tokens; inputs are a window's first seq_len tokens
and targets its last seq_len, as for the byte-level `text` source. The split is by document: a fixed
share of the documents (by `SPLIT_SEED`, not the run's seed) is held out for eval.

Sources here are random access (`read_batch(indices)`), so a global batch depends only on its index and
each host reads only its own rows of it, straight from the memory-mapped cache.

`documents` (a `documents` corpus, or `text` files one document each): each row holds whole documents
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

from shard.data import documents, formats, token_cache
from shard.data.sources import held_out_indices
from shard.errors import UserError


class Split:
    """Some documents of a cache as one virtual stream: position p of the stream -> the cache's token index."""

    def __init__(self, cache: token_cache.Cache, docs: np.ndarray):
        self.cache = cache
        self.starts = cache.doc_starts[docs]
        self.offsets = np.concatenate([[0], np.cumsum(cache.doc_starts[docs + 1] - self.starts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, positions: np.ndarray) -> np.ndarray:
        doc = np.searchsorted(self.offsets, positions, side="right") - 1
        return self.starts[doc] + (positions - self.offsets[doc])


class ConcatWindows:
    """Consecutive, non-overlapping windows of a split's stream; `bytes` (with_bytes): per row, the UTF-8
    bytes of the text its targets stand for, for eval's bits per byte. A cache of fine-tuning rows (with a
    mask) gives each row a `loss_mask` too: 1 where the target is trained on (a completion's, an
    assistant's), and only those targets' bytes count. `masked` may be set by a mixture, whose sources must
    give batches of one shape: a row of plain documents then trains on every target."""

    def __init__(self, split: Split, seq_len: int, with_bytes: bool = False):
        self.split, self.seq_len, self.with_bytes = split, seq_len, with_bytes
        self.masked = split.cache.mask is not None

    def __len__(self) -> int:
        return max(0, (len(self.split) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> dict:
        return {k: v[0] for k, v in self.read_batch(np.array([i])).items()}

    def read_batch(self, indices: np.ndarray) -> dict:
        positions = np.asarray(indices, np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        where = self.split.locate(positions)
        cache = self.split.cache
        window = cache.tokens[where].astype(np.int32)
        batch = {"inputs": window[:, :-1], "targets": window[:, 1:]}
        trained = cache.mask[where[:, 1:]] if cache.mask is not None else None
        if self.masked:
            batch["loss_mask"] = np.ones(batch["targets"].shape, np.float32) if trained is None else \
                trained.astype(np.float32)
        if self.with_bytes:
            counts = cache.token_bytes[where[:, 1:]].astype(np.int64)
            batch["bytes"] = (counts if trained is None else counts * trained).sum(axis=1).astype(np.int32)
        return batch


def splits(cfg, cache_dir) -> tuple:
    """(train source, eval source, the cache) of `data.name=documents`."""
    cache = token_cache.load(documents.corpus_files(cfg.path), formats.columns(cfg), cfg.tokenizer, cfg.cache_dir or cache_dir)
    if cache.documents < 2:
        raise UserError(f"data.path={cfg.path!r} holds {cache.documents} document; it needs at least 2 (one to hold out)")
    train_docs, eval_docs = held_out_indices(cache.documents, cfg.eval_fraction)
    if cfg.packing == "documents":
        each = lambda array, ids: None if array is None else (array[cache.doc_starts[d]:cache.doc_starts[d + 1]]
                                                              for d in ids)
        train = PackedRows(each(cache.tokens, train_docs), cfg.seq_len, masks=each(cache.mask, train_docs))
        held = PackedRows(each(cache.tokens, eval_docs), cfg.seq_len, each(cache.token_bytes, eval_docs),
                          each(cache.mask, eval_docs))
        if len(held) == 0:
            raise UserError(f"the eval split ({len(eval_docs)} documents) has no document of 2 tokens or more")
        return train, held, cache
    train = ConcatWindows(Split(cache, train_docs), cfg.seq_len)
    held = ConcatWindows(Split(cache, eval_docs), cfg.seq_len, with_bytes=True)
    if len(held) == 0:
        raise UserError(f"the eval split ({len(eval_docs)} documents, {len(held.split)} tokens) is shorter than one "
                        f"row of data.seq_len={cfg.seq_len} + 1 tokens; raise data.eval_fraction or lower data.seq_len")
    return train, held, cache


# ----------------------------------------------------------------------------- whole documents per row

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
    the smallest integer type that fits; positions and the mask are derived from the segment ids per read.
    `masks` (fine-tuning rows): per document, 1 where a token as a target is trained on; a row's loss_mask
    is then also 0 at a prompt's or a user's targets. Packed by the same lengths as the tokens, the masks
    land where their tokens did (as the byte counts do)."""

    def __init__(self, documents: Iterable, seq_len: int, byte_counts: Iterable | None = None,
                 masks: Iterable | None = None):
        rows = list(pack(documents, seq_len))
        stack = lambda key: np.stack([r[key] for r in rows]) if rows else np.zeros((0, seq_len), np.int32)
        tokens = [stack("inputs"), stack("targets")]
        top = max([int(t.max()) for t in tokens if t.size] + [0])
        self.inputs, self.targets = (t.astype(np.min_scalar_type(top)) for t in tokens)
        self.segment_ids = stack("segment_ids").astype(np.min_scalar_type(seq_len))
        self.seq_len = seq_len
        self.trained = None if masks is None else \
            np.stack([r["targets"] for r in pack(masks, seq_len)] or [np.zeros(seq_len)]).astype(bool)[:len(rows)]
        self.bytes = None
        if byte_counts is not None:  # per row, the UTF-8 bytes its targets stand for (eval's bits per byte): the
            # counts packed as documents of their own land where their tokens did (placement goes by length)
            counts = [r["targets"] * r["loss_mask"].astype(np.int64) for r in pack(byte_counts, seq_len)]
            if self.trained is not None:
                counts = [c * t for c, t in zip(counts, self.trained)]
            self.bytes = np.array([c.sum() for c in counts], np.int32)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        return {k: v[0] for k, v in self.read_batch(np.array([i])).items()}

    def read_batch(self, indices: np.ndarray) -> dict:
        segments = self.segment_ids[indices].astype(np.int32)
        real = segments > 0
        return {"inputs": self.inputs[indices].astype(np.int32), "targets": self.targets[indices].astype(np.int32),
                "segment_ids": segments, "positions": row_positions(segments),
                "loss_mask": (real if self.trained is None else real & self.trained[indices]).astype(np.float32),
                **({} if self.bytes is None else {"bytes": self.bytes[indices]})}

    def efficiency(self) -> float:
        """The share of the rows' target slots that hold a real target."""
        return float(np.mean(self.segment_ids > 0)) if len(self) else 0.0
