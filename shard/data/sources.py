"""Random-access data sources (len + getitem, Grain's source protocol) that need no download.

Each also reads many examples at once: `read_batch(indices)` returns the examples stacked, exactly the
arrays that stacking `source[i]` for each index would give, with one vectorised read where it can."""

import glob
import io
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

    def read_batch(self, indices: np.ndarray) -> dict:
        positions = np.asarray(indices, np.int64)[:, None] * self.seq_len + np.arange(self.seq_len)
        return {"inputs": self.tokens[positions].astype(np.int32),
                "targets": self.tokens[positions + 1].astype(np.int32)}


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
    split = text_documents(path, eval_fraction)
    streams = [np.frombuffer(b"\n".join(d.tobytes() for d in docs), dtype=np.uint8) for docs in split]
    return ByteWindows(streams[0], seq_len), ByteWindows(streams[1], seq_len)


def text_documents(path: str | None, eval_fraction: float) -> tuple[list, list]:
    """The `text` files' bytes as documents (one per file), train and eval, split by file so eval text is
    never trained on (a single file: its last bytes held out, each part one document)."""
    files = text_files(path)
    read = lambda f: np.frombuffer(f.read_bytes(), dtype=np.uint8)
    if len(files) == 1:  # one corpus file: hold out its last bytes
        tokens = read(files[0])
        cut = int(len(tokens) * (1 - eval_fraction))
        return [tokens[:cut]], [tokens[cut:]]
    n_eval = min(len(files) - 1, max(1, round(len(files) * eval_fraction)))
    eval_index = {int((k + 0.5) * len(files) / n_eval) for k in range(n_eval)}  # spread over the sorted files
    split = ([], [])
    for i, f in enumerate(files):
        split[i in eval_index].append(read(f))
    return split


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

    def read_batch(self, indices: np.ndarray) -> dict:
        # Every example draws from its own seeded stream, and one matrix product for the whole batch would
        # round the teacher's scores differently from the per-example one: so example by example.
        return stack([self[int(i)] for i in indices])


class Arrays:
    """Examples held in memory as aligned arrays (first dimension = example)."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        return {"inputs": self.inputs[i], "targets": self.targets[i]}

    def read_batch(self, indices: np.ndarray) -> dict:
        return {"inputs": self.inputs[indices], "targets": self.targets[indices]}


class Subset:
    """Some examples of a source, by index."""

    def __init__(self, source, indices: np.ndarray):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return self.source[int(self.indices[i])]

    def read_batch(self, indices: np.ndarray) -> dict:
        return self.source.read_batch(self.indices[indices])


def stack(examples: list[dict]) -> dict:
    """Examples (dicts of arrays) as one batch: each array gains a leading example dimension."""
    return {k: np.stack([ex[k] for ex in examples]) for k in examples[0]}


SPLIT_SEED = 1234  # the held-out split is a property of the data set, not of a run's seed


def held_out_indices(n: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random split: (train indices, eval indices), eval at least one example."""
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def infer_task(targets: np.ndarray) -> str:
    """The task a set of targets implies, when data.task=auto: 0/1 -> binary; integer labels (an
    integer dtype, or at most 20 whole-number values read from text) -> classification; else regression."""
    values = np.unique(targets)
    if targets.ndim == 1 and np.all(np.isin(values, (0, 1))):
        return "binary"
    whole = np.all(np.mod(values, 1) == 0) and values.min() >= 0
    if targets.ndim == 1 and whole and (np.issubdtype(targets.dtype, np.integer) or len(values) <= 20):
        return "classification"
    return "regression"


def digits(eval_fraction: float) -> tuple[Arrays, Arrays, str]:
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), as (8, 8, 1) images in [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[..., None]
    labels = bunch.target.astype(np.int32)
    train, held = held_out_indices(len(labels), eval_fraction)
    return Arrays(images[train], labels[train]), Arrays(images[held], labels[held]), "classification"


def tabular(path: str | None, target: str, eval_fraction: float) -> tuple[Arrays, Arrays, str]:
    """A table of numeric features: scikit-learn's `diabetes` (regression) or `breast_cancer` (binary),
    or a CSV file with a header and the target in column `target`. Features (and regression targets)
    are standardised with statistics of the train split only."""
    name = path or "diabetes"
    if name in ("diabetes", "breast_cancer"):
        from sklearn import datasets

        bunch = getattr(datasets, f"load_{name}")()
        features, labels = bunch.data.astype(np.float64), bunch.target.astype(np.float64)
        task = "regression" if name == "diabetes" else "binary"
    else:
        features, labels = _read_csv(name, target)
        task = infer_task(labels)
    train, held = held_out_indices(len(labels), eval_fraction)
    mean, std = features[train].mean(0), features[train].std(0) + 1e-8
    features = ((features - mean) / std).astype(np.float32)
    if task == "regression":
        labels = (labels - labels[train].mean()) / (labels[train].std() + 1e-8)
        labels = labels.astype(np.float32)[:, None]
    else:
        labels = labels.astype(np.float32 if task == "binary" else np.int32)
    return Arrays(features[train], labels[train]), Arrays(features[held], labels[held]), task


def _read_csv(path: str, target: str) -> tuple[np.ndarray, np.ndarray]:
    if not os.path.isfile(path):
        raise UserError(f"data.path={path!r} does not exist (tabular takes diabetes, breast_cancer or a CSV file)")
    with open(path) as f:
        header = [h.strip() for h in f.readline().strip().split(",")]
    if target not in header:
        raise UserError(f"data.target={target!r} is not a column of {path}; its columns are: {', '.join(header)}")
    try:
        table = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    except ValueError as e:
        raise UserError(f"data.path={path!r}: every value must be a number ({str(e).splitlines()[0]})") from None
    if len(table) < 2:
        raise UserError(f"data.path={path!r} has {len(table)} rows; it needs at least 2")
    column = header.index(target)
    return np.delete(table, column, axis=1), table[:, column]


def arrays(path: str | None, eval_fraction: float) -> tuple[Arrays, Arrays, str]:
    """A user's arrays: an .npz with `inputs` and `targets`, or a folder with inputs.npy and targets.npy."""
    if path is None:
        raise UserError("data.name=arrays needs data.path: an .npz file or a folder with inputs.npy and targets.npy")
    if os.path.isdir(path):
        files = {k: Path(path) / f"{k}.npy" for k in ("inputs", "targets")}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise UserError(f"data.path={path!r} lacks {', '.join(missing)}")
        loaded = {k: np.load(f) for k, f in files.items()}
    elif os.path.isfile(path):
        with np.load(path) as npz:
            if not {"inputs", "targets"} <= set(npz.files):
                raise UserError(f"data.path={path!r} must hold arrays named inputs and targets; "
                                f"it has: {', '.join(npz.files)}")
            loaded = {k: npz[k] for k in ("inputs", "targets")}
    else:
        raise UserError(f"data.path={path!r} does not exist")
    inputs, targets = loaded["inputs"], loaded["targets"]
    if len(inputs) != len(targets):
        raise UserError(f"data.path={path!r}: inputs have {len(inputs)} examples but targets {len(targets)}; "
                        "the first dimensions must match")
    if len(inputs) < 2:
        raise UserError(f"data.path={path!r} holds {len(inputs)} example; it needs at least 2")
    task = infer_task(targets)
    targets = targets.astype(np.float32 if task in ("binary", "regression") else np.int32)
    inputs = inputs.astype(np.float32) if np.issubdtype(inputs.dtype, np.floating) else inputs
    train, held = held_out_indices(len(inputs), eval_fraction)
    return Arrays(inputs[train], targets[train]), Arrays(inputs[held], targets[held]), task


class Records:
    """Grain's ArrayRecord files, read record by record (data sets larger than memory). Each record is
    one example saved by `write_array_record`: an .npz of `inputs` and `targets`."""

    def __init__(self, paths: list[str]):
        import grain

        self.records = grain.sources.ArrayRecordDataSource(paths)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return self._decode(self.records[i])

    def read_batch(self, indices: np.ndarray) -> dict:
        # One lookup for the whole batch (the ArrayRecord source's batched read); decoding stays per record.
        return stack([self._decode(r) for r in self.records.__getitems__([int(i) for i in indices])])

    @staticmethod
    def _decode(record: bytes) -> dict:
        with np.load(io.BytesIO(record)) as npz:
            return {"inputs": npz["inputs"], "targets": npz["targets"]}


def array_record(path: str | None, eval_fraction: float) -> tuple:
    if path is None:
        raise UserError("data.name=array_record needs data.path: a file, folder or glob of .array_record files")
    if any(c in path for c in "*?["):
        files = sorted(glob.glob(path))
    elif os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).glob("*.array_record"))
    else:
        files = [path] if os.path.isfile(path) else []
    if not files:
        raise UserError(f"data.path={path!r} matches no .array_record files")
    source = Records(files)
    if len(source) < 2:
        raise UserError(f"data.path={path!r} holds {len(source)} record; it needs at least 2")
    train, held = held_out_indices(len(source), eval_fraction)
    probe = np.stack([source[int(i)]["targets"] for i in held[:256]])
    return Subset(source, train), Subset(source, held), infer_task(probe)


def write_array_record(path: str, inputs: np.ndarray, targets: np.ndarray) -> None:
    """Write examples in the format `data.name=array_record` reads."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for x, y in zip(inputs, targets):
        buffer = io.BytesIO()
        np.savez(buffer, inputs=x, targets=y)
        writer.write(buffer.getvalue())
    writer.close()
