"""The token stream of a corpus, tokenized once and kept on disk.

A cache is a folder `<data.cache_dir>/<key>/`: `tokens.bin` (every document's tokens, each document ending
in its separator, in file order), `bytes.bin` (uint16: the UTF-8 bytes of the text each token stands for,
for eval's bits per byte), `docs.npy` (where each document starts, and the end) and `meta.json`. The key
hashes each file's absolute path, size and modification time (not its content: reading a large corpus to
learn that it has not changed would cost what reading it to tokenize does), `data.field` and the tokenizer's
own file content, so a changed file, another column or another tokenizer builds a new cache.

The build runs in worker processes, one file at a time each (a tokenizer's `encode_batch` per batch of
rows), writes into a temporary folder beside the cache and renames it into place when it is whole: a
killed build leaves no cache, only a `.<key>.*` folder that is never read. Every later run, and every host
reading the same folder, maps the files into memory and reads only the rows it needs.
"""

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from shard.data import documents, tokenizer as tokenizer_lib
from shard.errors import UserError

FORMAT = 1                  # bump when the layout changes: old caches are then never read
PARALLEL_MIN_BYTES = 4 << 20  # smaller corpora build in this process: starting workers costs more


@dataclass
class Cache:
    folder: Path
    tokens: np.ndarray      # memory-mapped, uint16 or uint32
    token_bytes: np.ndarray  # memory-mapped uint16, aligned with tokens
    doc_starts: np.ndarray  # int64, documents + 1 entries: document i is tokens[doc_starts[i]:doc_starts[i+1]]
    meta: dict

    @property
    def documents(self) -> int:
        return len(self.doc_starts) - 1


def key(files: list[Path], field: str, tokenizer) -> str:
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    text = json.dumps({"format": FORMAT, "files": stats, "field": field, "tokenizer": tokenizer.identity()})
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def load(files: list[Path], field: str, spec: str | None, cache_dir: str | Path, workers: int | None = None) -> Cache:
    """The corpus's cache, built first if it does not exist yet."""
    tok = tokenizer_lib.load(spec)
    cache_dir = Path(cache_dir).expanduser()
    folder = cache_dir / key(files, field, tok)
    if not (folder / "meta.json").is_file():
        build(files, field, spec, tok, folder, workers)
    return open_cache(folder)


def open_cache(folder: Path) -> Cache:
    meta = json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    tokens = np.memmap(folder / "tokens.bin", dtype, "r", shape=(meta["tokens"],))
    counts = np.memmap(folder / "bytes.bin", np.uint16, "r", shape=(meta["tokens"],))
    return Cache(folder, tokens, counts, np.load(folder / "docs.npy"), meta)


def build(files: list[Path], field: str, spec: str | None, tok, folder: Path, workers: int | None = None) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as e:
        raise UserError(f"data.cache_dir={str(folder.parent)!r}: cannot write there ({e.strerror or e})") from None
    try:
        lengths = _encode_all(files, field, spec, tok, scratch, workers)
        if not lengths or sum(len(x) for x in lengths) == 0:
            raise UserError(f"data.path: the {len(files)} file(s) hold no documents with text in data.field={field!r}")
        doc_lengths = np.concatenate(lengths)
        starts = np.concatenate([[0], np.cumsum(doc_lengths)]).astype(np.int64)
        for name in ("tokens", "bytes"):  # the parts, joined in file order
            with open(scratch / f"{name}.bin", "wb") as out:
                for i in range(len(files)):
                    part = scratch / f"{name}.{i}"
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
                    part.unlink()
        np.save(scratch / "docs.npy", starts)
        meta = {"format": FORMAT, "dtype": np.dtype(token_dtype(tok.vocab_size)).name, "tokens": int(starts[-1]),
                "documents": len(doc_lengths), "vocab_size": tok.vocab_size, "bos": tok.bos, "eos": tok.eos,
                "field": field, "tokenizer": spec or "bytes", "files": [str(f) for f in files]}
        (scratch / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(scratch, folder)
        except OSError:  # another process (a host beside this one) renamed its copy first: keep that one
            if not (folder / "meta.json").is_file():
                raise
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def _encode_all(files, field, spec, tok, scratch: Path, workers: int | None) -> list[np.ndarray]:
    """Each file's document lengths (in tokens); its tokens and byte counts are written to `scratch`."""
    sizes = [f.stat().st_size for f in files]
    workers = min(workers or os.cpu_count() or 1, len(files))
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"tokenizing {len(files)} file(s)",
               disable=None, leave=False, file=sys.stderr)
    jobs = [(i, f, field, spec, scratch) for i, f in enumerate(files)]
    lengths = [None] * len(files)
    with bar:
        if workers <= 1 or sum(sizes) < PARALLEL_MIN_BYTES:
            for job in jobs:
                lengths[job[0]] = _encode_file(*job, tok=tok)
                bar.update(sizes[job[0]])
        else:
            # A fork server, not a fork of this process: JAX's threads are running here, and a forked copy
            # of a threaded process may deadlock. The server imports this module once (a second or two);
            # each worker is a fork of it.
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__])
            with context.Pool(workers, initializer=tokenizer_lib.quiet_parallelism) as pool:
                for i, got in pool.imap_unordered(_encode_job, jobs):
                    lengths[i] = got
                    bar.update(sizes[i])
    return lengths


def _encode_job(job) -> tuple[int, np.ndarray]:
    return job[0], _encode_file(*job)


_WORKER_TOKENIZER: dict = {}  # spec -> tokenizer, loaded once per worker process


def _encode_file(index: int, path: Path, field: str, spec, scratch: Path, tok=None) -> np.ndarray:
    """Tokenize one file into `scratch`/tokens.<index> and bytes.<index>; its documents' lengths."""
    if tok is None:
        tok = _WORKER_TOKENIZER.get(spec) or _WORKER_TOKENIZER.setdefault(spec, tokenizer_lib.load(spec))
    dtype = token_dtype(tok.vocab_size)
    sep_ids, sep_bytes = tokenizer_lib.separator(tok)
    head = [] if tok.bos is None else [tok.bos]
    lengths = []
    with open(scratch / f"tokens.{index}", "wb") as out, open(scratch / f"bytes.{index}", "wb") as out_bytes:
        for texts in documents.texts(path, field):
            ids, counts = tok.encode_batch(texts)
            parts, byte_parts = [], []
            for doc_ids, doc_counts in zip(ids, counts):
                if not len(doc_ids):
                    continue  # an empty text is no document
                parts += [np.asarray(head, dtype), doc_ids.astype(dtype, copy=False), sep_ids.astype(dtype)]
                byte_parts += [np.zeros(len(head), np.uint16), doc_counts, sep_bytes]
                lengths.append(len(head) + len(doc_ids) + len(sep_ids))
            if parts:
                out.write(np.concatenate(parts).tobytes())
                out_bytes.write(np.concatenate(byte_parts).astype(np.uint16).tobytes())
    return np.asarray(lengths, np.int64)
