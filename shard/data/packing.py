"""Documents (a token cache) cut into fixed-length language-model rows, `data.packing` says how.

`concat` (GPT-2 / nanoGPT): the split's documents, each ending in its separator (EOS), joined into one
stream and cut into consecutive windows of seq_len + 1 tokens; inputs are a window's first seq_len tokens
and targets its last seq_len, as for the byte-level `text` source. The split is by document: a fixed
share of the documents (by `SPLIT_SEED`, not the run's seed) is held out for eval.

Sources here are random access (`read_batch(indices)`), so a global batch depends only on its index and
each host reads only its own rows of it, straight from the memory-mapped cache. A packer of another kind
(`documents`: whole documents per row, with `segment_ids`, `positions` and `loss_mask`) is a class beside
`ConcatWindows` over the same `Split` and a branch in `splits`.
"""

import numpy as np

from shard.data import documents, token_cache
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
    bytes of the text its targets stand for, for eval's bits per byte."""

    def __init__(self, split: Split, seq_len: int, with_bytes: bool = False):
        self.split, self.seq_len, self.with_bytes = split, seq_len, with_bytes

    def __len__(self) -> int:
        return max(0, (len(self.split) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> dict:
        return {k: v[0] for k, v in self.read_batch(np.array([i])).items()}

    def read_batch(self, indices: np.ndarray) -> dict:
        positions = np.asarray(indices, np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        where = self.split.locate(positions)
        window = self.split.cache.tokens[where].astype(np.int32)
        batch = {"inputs": window[:, :-1], "targets": window[:, 1:]}
        if self.with_bytes:
            batch["bytes"] = self.split.cache.token_bytes[where[:, 1:]].sum(axis=1, dtype=np.int64).astype(np.int32)
        return batch


def splits(cfg, cache_dir) -> tuple:
    """(train source, eval source, the cache) of `data.name=documents`."""
    if cfg.packing != "concat":
        raise UserError(f"data.packing={cfg.packing} is not built yet; use data.packing=concat")
    cache = token_cache.load(documents.corpus_files(cfg.path), cfg.field, cfg.tokenizer, cfg.cache_dir or cache_dir)
    if cache.documents < 2:
        raise UserError(f"data.path={cfg.path!r} holds {cache.documents} document; it needs at least 2 (one to hold out)")
    train_docs, eval_docs = held_out_indices(cache.documents, cfg.eval_fraction)
    train = ConcatWindows(Split(cache, train_docs), cfg.seq_len)
    held = ConcatWindows(Split(cache, eval_docs), cfg.seq_len, with_bytes=True)
    if len(held) == 0:
        raise UserError(f"the eval split ({len(eval_docs)} documents, {len(held.split)} tokens) is shorter than one "
                        f"row of data.seq_len={cfg.seq_len} + 1 tokens; raise data.eval_fraction or lower data.seq_len")
    return train, held, cache
