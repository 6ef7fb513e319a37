"""The token stream of a corpus, tokenized once and kept on disk.

A cache is a folder `<data.cache_dir>/<key>/`: `tokens.bin` (every document's tokens, each document ending
in its separator, in file order), `bytes.bin` (uint16: the UTF-8 bytes of the text each token stands for,
for eval's bits per byte), `docs.npy` (where each document starts, and the end) and `meta.json`; for
fine-tuning rows (prompt/completion pairs, chats: shard/data/formats.py) also `mask.bin` (uint8: 1 where a
token, as a target, is trained on), which plain documents do without (every target counts). The key
hashes each file's absolute path, size and modification time (not its content: reading a large corpus to
learn that it has not changed would cost what reading it to tokenize does), the columns read (`data.field`,
or the prompt and completion fields) and the tokenizer's own file content (its chat template included), so a
changed file, another column or another tokenizer builds a new cache.

The build runs in worker processes, one file at a time each (a tokenizer's `encode_batch` per batch of
rows), writes into a temporary folder beside the cache and renames it into place when it is whole: a
killed build leaves no cache, only a `.<key>.*` folder that is never read (and that the next build of the
same cache on that host removes, once the process that wrote it is gone). Every later run, and every host
reading the same folder, maps the files into memory and reads only the rows it needs.
"""

import hashlib
import json
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from shard.data import documents, formats, tokenizer as tokenizer_lib
from shard.errors import UserError

FORMAT = 2                  # bump when the layout changes: old caches are then never read
PARALLEL_MIN_BYTES = 4 << 20  # smaller corpora build in this process: starting workers costs more


@dataclass
class Cache:
    folder: Path
    tokens: np.ndarray      # memory-mapped, uint16 or uint32
    token_bytes: np.ndarray  # memory-mapped uint16, aligned with tokens
    doc_starts: np.ndarray  # int64, documents + 1 entries: document i is tokens[doc_starts[i]:doc_starts[i+1]]
    meta: dict
    mask: np.ndarray | None = None  # memory-mapped uint8, aligned with tokens: fine-tuning rows' trained targets

    @property
    def documents(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def largest_token(self) -> int:
        """The largest token id the corpus holds: checked against a model's embedding, which may have fewer
        rows than the tokenizer has tokens (Gemma 3). Caches written before it was recorded read it once."""
        if "largest_token" not in self.meta:
            self.meta["largest_token"] = int(self.tokens.max()) if len(self.tokens) else -1
        return self.meta["largest_token"]


def key(files: list[Path], names: tuple[str, ...], tokenizer) -> str:
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    field = names[0] if len(names) == 1 else list(names)  # one column: the key it always had
    text = json.dumps({"format": FORMAT, "files": stats, "field": field, "tokenizer": tokenizer.identity()})
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def load(files: list[Path], names: tuple[str, ...] | str, spec: str | None, cache_dir: str | Path,
         workers: int | None = None) -> Cache:
    """The corpus's cache, built first if it does not exist yet. `names`: the columns each row is read
    from (shard/data/formats.py: a document's or a chat's, or a prompt's and its completion's)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    tok = tokenizer_lib.load(spec)
    cache_dir = Path(cache_dir).expanduser()
    folder = cache_dir / key(files, names, tok)
    if not (folder / "meta.json").is_file():
        build(files, names, spec, tok, folder, workers)
    return open_cache(folder)


def open_cache(folder: Path) -> Cache:
    meta = json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    tokens = np.memmap(folder / "tokens.bin", dtype, "r", shape=(meta["tokens"],))
    counts = np.memmap(folder / "bytes.bin", np.uint16, "r", shape=(meta["tokens"],))
    mask = np.memmap(folder / "mask.bin", np.uint8, "r", shape=(meta["tokens"],)) if meta.get("masked") else None
    return Cache(folder, tokens, counts, np.load(folder / "docs.npy"), meta, mask)


def build(files: list[Path], names: tuple[str, ...], spec: str | None, tok, folder: Path,
          workers: int | None = None) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(folder)
        scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        (scratch / OWNER).write_text(owner())
    except OSError as e:
        raise UserError(f"data.cache_dir={str(folder.parent)!r}: cannot write there ({e.strerror or e})") from None
    try:
        lengths, masked = _encode_all(files, names, spec, tok, scratch, workers)
        if not lengths or sum(len(x) for x in lengths) == 0:
            raise UserError(f"data.path: the {len(files)} file(s) hold no documents with text in "
                            f"{formats.describe(names)}")
        doc_lengths = np.concatenate(lengths)
        starts = np.concatenate([[0], np.cumsum(doc_lengths)]).astype(np.int64)
        for i in range(len(files) if not masked else 0):  # every target counts: no mask to keep
            (scratch / f"mask.{i}").unlink()
        for name in ("tokens", "bytes", "mask")[:3 if masked else 2]:  # the parts, joined in file order
            with open(scratch / f"{name}.bin", "wb") as out:
                for i in range(len(files)):
                    part = scratch / f"{name}.{i}"
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
                    part.unlink()
        np.save(scratch / "docs.npy", starts)
        tokens = np.memmap(scratch / "tokens.bin", token_dtype(tok.vocab_size), "r") if starts[-1] else np.zeros(0)
        meta = {"largest_token": int(tokens.max()) if len(tokens) else -1, "format": FORMAT,
                "dtype": np.dtype(token_dtype(tok.vocab_size)).name, "tokens": int(starts[-1]),
                "documents": len(doc_lengths), "vocab_size": tok.vocab_size, "bos": tok.bos, "eos": tok.eos,
                "field": names[0] if len(names) == 1 else list(names), "masked": masked,
                "tokenizer": spec or "bytes", "files": [str(f) for f in files]}
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


OWNER = "owner"  # in a scratch folder: the host and process id building it


def owner() -> str:
    return f"{socket.gethostname()} {os.getpid()}"


def remove_abandoned(folder: Path) -> None:
    """Scratch folders of this cache that a killed build left: those whose builder was a process of this host
    that no longer runs. Another host's (on a shared file system), or a live one's, stay."""
    for scratch in folder.parent.glob(f".{folder.name}.*"):
        try:
            host, pid = (scratch / OWNER).read_text().split()
        except (OSError, ValueError):
            continue  # not ours to judge (a build that has not written its owner yet, or another layout)
        if host == socket.gethostname() and not _alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _encode_all(files, names, spec, tok, scratch: Path, workers: int | None) -> tuple[list[np.ndarray], bool]:
    """Each file's document lengths (in tokens), and whether any target is left out of training; its tokens,
    byte counts and mask are written to `scratch`."""
    sizes = [f.stat().st_size for f in files]
    workers = min(workers or os.cpu_count() or 1, len(files))
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"tokenizing {len(files)} file(s)",
               disable=None, leave=False, file=sys.stderr)
    jobs = [(i, f, names, spec, scratch) for i, f in enumerate(files)]
    lengths, masked = [None] * len(files), False
    with bar:
        if workers <= 1 or sum(sizes) < PARALLEL_MIN_BYTES:
            for job in jobs:
                lengths[job[0]], some = _encode_file(*job, tok=tok)
                masked |= some
                bar.update(sizes[job[0]])
        else:
            # A fork server, not a fork of this process: JAX's threads are running here, and a forked copy
            # of a threaded process may deadlock. The server imports this module once (a second or two);
            # each worker is a fork of it.
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__])
            with context.Pool(workers, initializer=tokenizer_lib.quiet_parallelism) as pool:
                for i, (got, some) in pool.imap_unordered(_encode_job, jobs):
                    lengths[i] = got
                    masked |= some
                    bar.update(sizes[i])
    return lengths, masked


def _encode_job(job) -> tuple[int, tuple[np.ndarray, bool]]:
    return job[0], _encode_file(*job)


_WORKER_TOKENIZER: dict = {}  # spec -> tokenizer, loaded once per worker process


def _encode_file(index: int, path: Path, names: tuple[str, ...], spec, scratch: Path,
                 tok=None) -> tuple[np.ndarray, bool]:
    """Tokenize one file into `scratch`/tokens.<index>, bytes.<index> and mask.<index>: its documents' lengths,
    and whether any target is not trained on. A row (shard/data/formats.py) is tokenized whole, as
    transformers tokenizes it; a token is trained where its characters overlap a trained span. The special
    tokens before a text (BOS) take its first character's mask (BOS is a target only after the previous
    row's EOS), those after it and the separator its last character's."""
    if tok is None:
        tok = _WORKER_TOKENIZER.get(spec) or _WORKER_TOKENIZER.setdefault(spec, tokenizer_lib.load(spec))
    formatter = formats.Formatter(names, tok)
    dtype = token_dtype(tok.vocab_size)
    sep_ids, sep_bytes = tokenizer_lib.separator(tok)
    lengths, masked = [], False
    with open(scratch / f"tokens.{index}", "wb") as out, open(scratch / f"bytes.{index}", "wb") as out_bytes, \
            open(scratch / f"mask.{index}", "wb") as out_mask:
        for batch in documents.rows(path, names):
            rows = [formatter.row(values, f"{path}:row {len(lengths) + n + 1}") for n, values in enumerate(batch)]
            rows = [r for r in rows if r is not None]
            encoded = tok.encode_rows([r.text for r in rows], [r.special for r in rows])
            parts, byte_parts, mask_parts = [], [], []
            for row, (ids, offsets, counts) in zip(rows, encoded):
                if not len(ids):
                    continue
                whole = row.trained == [(0, len(row.text))]  # a document: every token trained
                around = (len(tok.head), len(tok.tail)) if row.special else (0, 0)
                mask = np.ones(len(ids), np.uint8) if whole else \
                    trained_mask(offsets, row.trained, len(row.text), *around)
                ends_in_eos = tok.eos is not None and ids[-1] == tok.eos
                sep = (sep_ids[:0], sep_bytes[:0]) if ends_in_eos else (sep_ids, sep_bytes)
                parts += [ids.astype(dtype), sep[0].astype(dtype)]
                byte_parts += [counts, sep[1]]
                mask_parts += [mask, np.full(len(sep[0]), mask[-1], np.uint8)]
                masked |= not mask.all()
                lengths.append(len(ids) + len(sep[0]))
            if parts:
                out.write(np.concatenate(parts).tobytes())
                out_bytes.write(np.concatenate(byte_parts).astype(np.uint16).tobytes())
                out_mask.write(np.concatenate(mask_parts).tobytes())
    return np.asarray(lengths, np.int64), masked


def trained_mask(offsets: np.ndarray, spans: list[tuple[int, int]], length: int, head: int = 0,
                 tail: int = 0) -> np.ndarray:
    """1 for each token whose characters overlap a trained span (transformers' assistant mask). The `head`
    special ids before the text take its first character's mask (BOS is a target only after the previous
    row), the `tail` ones after it its last character's."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), bool)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
    first = any(lo <= 0 < hi for lo, hi in spans)
    last = any(lo < length <= hi for lo, hi in spans)
    mask[:head] = first
    if tail:
        mask[-tail:] = last
    return mask.astype(np.uint8)
