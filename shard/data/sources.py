"""Random-access data sources (len + getitem, Grain's source protocol) that need no download."""

import glob
import os
import sysconfig
from pathlib import Path

import numpy as np

from shard.errors import UserError


class ByteWindows:
    """Consecutive, non-overlapping windows of a byte stream: inputs and next-byte targets."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> dict:
        start = i * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].astype(np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}


def text_files(path: str | None) -> list[Path]:
    """The files a `text` source reads: a file, a directory (its .py/.txt/.md files, recursively) or a glob."""
    if path is None:  # The Python standard library's own sources: real text on every machine.
        root = Path(sysconfig.get_paths()["stdlib"])
        return sorted(root.glob("*.py"))
    if any(c in path for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    elif os.path.isdir(path):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".md"))
    elif os.path.isfile(path):
        files = [Path(path)]
    else:
        raise UserError(f"data.path={path!r} does not exist")
    if not files:
        raise UserError(f"data.path={path!r} matches no files")
    return files


def text_splits(path: str | None, seq_len: int, eval_fraction: float) -> tuple[ByteWindows, ByteWindows]:
    """Byte-level train and eval splits, split by file so eval text is never trained on (by bytes when
    there is a single file)."""
    files = text_files(path)
    if len(files) == 1:  # one corpus file: hold out its last bytes
        tokens = np.frombuffer(files[0].read_bytes(), dtype=np.uint8)
        cut = int(len(tokens) * (1 - eval_fraction))
        return ByteWindows(tokens[:cut], seq_len), ByteWindows(tokens[cut:], seq_len)
    n_eval = min(len(files) - 1, max(1, round(len(files) * eval_fraction)))
    eval_index = {int((k + 0.5) * len(files) / n_eval) for k in range(n_eval)}  # spread over the sorted files
    split = {"train": [], "eval": []}
    for i, f in enumerate(files):
        split["eval" if i in eval_index else "train"].append(f.read_bytes())
    streams = {k: np.frombuffer(b"\n".join(v), dtype=np.uint8) for k, v in split.items()}
    return ByteWindows(streams["train"], seq_len), ByteWindows(streams["eval"], seq_len)


class Synthetic:
    """Gaussian inputs with targets from a fixed random linear teacher, so the task is learnable.

    Example i is a pure function of (seed, split, i): any example can be read in any order.
    """

    def __init__(self, size: int, features: tuple, task: str, classes: int, seed: int, split: int):
        self.size, self.features, self.task, self.seed, self.split = size, tuple(features), task, seed, split
        outputs = {"classification": classes, "binary": 1, "regression": 1}[task]
        teacher = np.random.default_rng([seed, 7])
        self.weights = teacher.standard_normal((int(np.prod(self.features)), outputs)).astype(np.float32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        x = np.random.default_rng([self.seed, self.split, i]).standard_normal(self.features).astype(np.float32)
        score = x.reshape(-1) @ self.weights / np.sqrt(x.size)
        if self.task == "classification":
            y = np.int32(np.argmax(score))
        elif self.task == "binary":
            y = np.float32(score[0] > 0)
        else:
            y = score.astype(np.float32)
        return {"inputs": x, "targets": y}
