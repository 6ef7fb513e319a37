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

from collections.abc import Iterable
from dataclasses import dataclass

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
    cache = token_cache.load(documents.corpus_files(cfg.path), formats.columns(cfg), cfg.tokenizer,
                             cfg.cache_dir or cache_dir)
    if cache.documents < 2:
        raise UserError(f"data.path={cfg.path!r} holds {cache.documents} document; "
                        "it needs at least 2 (one to hold out)")
    train_docs, eval_docs = held_out_indices(cache.documents, cfg.eval_fraction)
    if cfg.packing == "documents":
        train = PackedRows(Documents.of_cache(cache, train_docs), cfg.seq_len)
        held = PackedRows(Documents.of_cache(cache, eval_docs, with_bytes=True), cfg.seq_len)
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


@dataclass
class Documents:
    """Documents as slices of one token array (a memory-mapped cache, or texts in memory): document i is
    tokens[starts[i]:ends[i]]. `token_bytes` (eval's bits per byte) and `mask` (fine-tuning rows' trained
    targets) are aligned with the tokens, where there are any."""
    tokens: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    token_bytes: np.ndarray | None = None
    mask: np.ndarray | None = None

    @classmethod
    def of_cache(cls, cache: token_cache.Cache, docs: np.ndarray, with_bytes: bool = False) -> "Documents":
        return cls(cache.tokens, cache.doc_starts[docs], cache.doc_starts[docs + 1],
                   cache.token_bytes if with_bytes else None, cache.mask)

    @classmethod
    def of_arrays(cls, documents: Iterable) -> "Documents":
        docs = [np.asarray(d) for d in documents]
        ends = np.cumsum([len(d) for d in docs], dtype=np.int64)
        tokens = np.concatenate(docs) if docs else np.zeros(0, np.int32)
        return cls(tokens, ends - [len(d) for d in docs], ends)


def place(lengths: np.ndarray, seq_len: int, open_rows: int = 1024) -> tuple[np.ndarray, ...]:
    """First-fit placement of documents of `lengths` tokens into rows of `seq_len` (input, target) pairs; only
    lengths are moved, never tokens. A document of n tokens has n - 1 pairs; a longer one than a row is cut
    into pieces of seq_len pairs (seq_len + 1 tokens, each piece's first token the last of the one before).
    Each piece goes into the first open row with room for it, else a new row; a row is closed when full, past
    `open_rows` open rows the oldest is closed as it stands, and at the end the rest in the order they
    opened. Rows are numbered in the order they close. Returns per piece, grouped by row in row order: its
    row, its first slot in the row, its document, its first token's offset in the document and its pairs.
    Deterministic: the same lengths give the same rows."""
    out: list[tuple] = []
    rows: list[list] = []                     # each open row's pieces: (slot, document, offset, pairs)
    free = np.zeros(0, np.int64)              # each open row's free slots, in the order they opened
    closed = 0

    def close(i: int) -> None:
        nonlocal closed
        out.extend((closed, *piece) for piece in rows.pop(i))
        closed += 1

    for doc, n in enumerate(np.asarray(lengths, np.int64)):
        for offset in range(0, max(int(n) - 1, 0), seq_len):
            need = min(seq_len, int(n) - 1 - offset)
            fits = np.flatnonzero(free >= need)
            if fits.size:
                i = int(fits[0])
            else:
                if len(rows) == open_rows:
                    close(0)
                    free = free[1:]
                rows.append([])
                free, i = np.append(free, seq_len), len(rows) - 1
            rows[i].append((seq_len - int(free[i]), doc, offset, need))
            free[i] -= need
            if free[i] == 0:
                close(i)
                free = np.delete(free, i)
    while rows:
        close(0)
    table = np.asarray(out, np.int64).reshape(-1, 5)
    return tuple(table[:, k] for k in range(5))


def row_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Each slot's position within its run of equal segment ids along the last axis (0 at each start)."""
    index = np.broadcast_to(np.arange(segment_ids.shape[-1]), segment_ids.shape)
    starts = np.ones(segment_ids.shape, bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    return (index - np.maximum.accumulate(np.where(starts, index, 0), axis=-1)).astype(np.int32)


class PackedRows:
    """Documents packed into rows of whole documents (`place`), as a random-access source (shard/data/sources.py's
    protocol): each row's inputs, targets, segment_ids (its documents numbered from 1, 0 = padding), positions
    (restarting at 0 with each document) and loss_mask (1 where a target counts: a real one, and for
    fine-tuning rows a trained one); `bytes` too where the documents carry byte counts (eval's bits per byte).
    Only the placement is held (a few integers a piece); a read gathers its rows' tokens from the documents'
    array, so a memory-mapped corpus stays on disk."""

    def __init__(self, documents: Documents, seq_len: int):
        self.docs, self.seq_len = documents, seq_len
        row, self.slot, doc, offset, self.pairs = place(documents.ends - documents.starts, seq_len)
        self.start = documents.starts[doc] + offset  # each piece's first token in the token array
        self.rows = int(row[-1]) + 1 if len(row) else 0
        self.first = np.searchsorted(row, np.arange(self.rows + 1))  # row r's pieces: first[r]:first[r + 1]

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict:
        return {k: v[0] for k, v in self.read_batch(np.array([i])).items()}

    def read_batch(self, indices: np.ndarray) -> dict:
        indices = np.asarray(indices, np.int64)
        lo, hi = self.first[indices], self.first[indices + 1]
        count = hi - lo
        piece = np.repeat(hi - np.cumsum(count), count) + np.arange(count.sum())  # the rows' pieces, in order
        which = np.repeat(np.arange(len(indices)), count)                           # each piece's row in the batch
        segment = piece - np.repeat(lo, count) + 1
        pairs = self.pairs[piece]
        within = np.arange(pairs.sum()) - np.repeat(np.cumsum(pairs) - pairs, pairs)  # each pair's place in its piece
        at = (np.repeat(which, pairs), np.repeat(self.slot[piece], pairs) + within)
        source = np.repeat(self.start[piece], pairs) + within                   # each pair's input token
        shape = (len(indices), self.seq_len)
        batch = {key: np.zeros(shape, np.int32) for key in ("inputs", "targets", "segment_ids")}
        batch["inputs"][at] = self.docs.tokens[source]
        batch["targets"][at] = self.docs.tokens[source + 1]
        batch["segment_ids"][at] = np.repeat(segment, pairs)
        batch["positions"] = row_positions(batch["segment_ids"])
        trained = np.ones(len(source), bool) if self.docs.mask is None else self.docs.mask[source + 1].astype(bool)
        batch["loss_mask"] = np.zeros(shape, np.float32)
        batch["loss_mask"][at] = trained
        if self.docs.token_bytes is not None:
            counts = self.docs.token_bytes[source + 1].astype(np.int64) * trained
            batch["bytes"] = np.bincount(at[0], weights=counts, minlength=len(indices)).astype(np.int32)
        return batch

    def efficiency(self) -> float:
        """The share of the rows' target slots that hold a real target."""
        return float(self.pairs.sum() / (self.rows * self.seq_len)) if self.rows else 0.0


def pack(documents: Iterable, seq_len: int) -> list[dict]:
    """Documents held in memory (token arrays) packed into rows: dicts of KEYS, in row order."""
    rows = PackedRows(Documents.of_arrays(documents), seq_len)
    batch = rows.read_batch(np.arange(len(rows)))
    return [{k: batch[k][r] for k in KEYS} for r in range(len(rows))]
