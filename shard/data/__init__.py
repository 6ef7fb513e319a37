"""Input: a source picked by `data.name`, a Grain pipeline, and batches placed on the devices ahead of the step.

Pipeline: source -> shuffle (seeded) -> batch -> transforms. Global batch `s` is a pure function of
(seed, s), so a run that restarts at step s sees exactly the batches it would have seen, and each
process reads only its own rows of each global batch, with one batched read from the source (not one
read per example). A background thread keeps `data.prefetch` batches already on the devices, so
reading and transferring overlap the step.
"""

import functools
import queue
import sys
import threading
from dataclasses import dataclass

import grain
import jax
import numpy as np

from shard.data import sources
from shard.errors import UserError

TARGET_DTYPES = {"lm": np.int32, "classification": np.int32, "binary": np.float32, "regression": np.float32}


@dataclass
class Data:
    task: str                # lm, classification, binary or regression
    train: grain.MapDataset  # this process's share of global batch s at index s (endless)
    eval: "EvalBatches"      # the whole eval split, this process's share, padded and masked
    batch_size: int          # global
    tokens_per_example: int  # seq_len for sequence data, else 0
    num_classes: int         # classes (or vocabulary) the targets range over; 0 for binary and regression
    rows: "Rows" = None      # which rows of each global batch this process reads (train and eval)
    eval_parts: dict = None  # data.mixture: each source's eval split by its label (data.eval is them all)
    largest_token: int | None = None  # the largest token id a tokenizer gave the data (None: not tokenized)

    def abstract_batch(self, eval: bool = False) -> dict:
        """Shapes and dtypes of one global batch (eval batches also carry a `mask`)."""
        local = self.eval[0] if eval else self.train[0]
        return {k: jax.ShapeDtypeStruct((self.batch_size,) + v.shape[1:], v.dtype) for k, v in local.items()}


def load_splits(cfg, seed: int, cache_dir=None) -> tuple:
    """(train source, eval source, the source's own task). `cache_dir`: documents' token caches, unless
    data.cache_dir says where."""
    if cfg.tokenizer != "bytes" and cfg.name != "documents":
        raise UserError(f"data.tokenizer={cfg.tokenizer} is read by data.name=documents only (data.name={cfg.name})")
    if cfg.packing == "documents" and cfg.name not in ("text", "documents"):
        raise UserError(f"data.packing=documents packs language-model documents; data.name={cfg.name} has "
                        "none (use data.name=text or documents, or data.packing=concat)")
    if cfg.packing == "documents" and cfg.name == "text":  # each file a document
        from shard.data import packing

        return (*(packing.PackedRows(packing.Documents.of_arrays(docs), cfg.seq_len)
                  for docs in sources.text_documents(cfg.path, cfg.eval_fraction)),
                "lm")
    if cfg.name == "text":
        return (*sources.text_splits(cfg.path, cfg.seq_len, cfg.eval_fraction), "lm")
    if cfg.name == "documents":
        from shard.data import packing

        train, held, cache = packing.splits(cfg, cache_dir or ".token_cache")
        train.largest_token = cache.largest_token  # read back by build(): the ids the model must embed
        return train, held, "lm"
    if cfg.name == "digits":
        return sources.digits(cfg.eval_fraction)
    if cfg.name == "tabular":
        return sources.tabular(cfg.path, cfg.target, cfg.eval_fraction)
    if cfg.name == "arrays":
        return sources.arrays(cfg.path, cfg.eval_fraction)
    if cfg.name == "array_record":
        return sources.array_record(cfg.path, cfg.eval_fraction)
    task = "classification" if cfg.task == "auto" else cfg.task
    if task == "lm":
        raise UserError("data.task=lm needs a text source (data.name=text or documents)")
    features = tuple(cfg.features)
    return (sources.Synthetic(cfg.size, features, task, cfg.classes, seed, split=0),
            sources.Synthetic(max(cfg.batch_size, cfg.size // 10), features, task, cfg.classes, seed, split=1), task)


def build(cfg, seed: int, cache_dir=None) -> Data:
    if cfg.mixture:
        return _build_mixture(cfg, seed, cache_dir)
    train_src, eval_src, own_task = load_splits(cfg, seed, cache_dir)
    task = own_task if cfg.task == "auto" else cfg.task
    if (task == "lm") != (own_task == "lm"):
        raise UserError(f"data.task={task}: the {cfg.name} source's task is {own_task}; "
                        "lm goes with text and documents only")
    dtype = TARGET_DTYPES[task]
    # a packed batch's segment_ids, positions and loss_mask (shard/data/packing.py) pass through
    cast = lambda batch: {**batch, "targets": np.asarray(batch["targets"], dtype)}
    tokens = cfg.seq_len if task == "lm" else 0
    classes = {"lm": vocab_size(cfg), "classification": _num_classes(cfg, train_src, task)}.get(task, 0)
    data = of_sources(cfg, seed, train_src, eval_src, task, cast, tokens, classes)
    data.largest_token = getattr(train_src, "largest_token", None)
    return data


def of_sources(cfg, seed: int, train_src, eval_src, task: str, cast, tokens: int, classes: int) -> Data:
    """Batches of two random-access sources (`read_batch(indices)`): the train split's shuffled, endless, each
    process reading its rows; the eval split's whole, padded and masked. `cast`: each batch, as read, to what
    the step takes."""
    n_proc, proc = jax.process_count(), jax.process_index()
    rows = Rows(proc * (cfg.batch_size // n_proc), cfg.batch_size // n_proc)  # until the mesh says otherwise
    if cfg.batch_size % n_proc:
        raise UserError(f"data.batch_size={cfg.batch_size} must be divisible by the {n_proc} processes")
    if len(train_src) < cfg.batch_size:
        raise UserError(f"data.batch_size={cfg.batch_size} is larger than the train split "
                        f"({len(train_src)} examples of data.name={cfg.name})")
    # Grain's index shuffle costs 10-60 us an index, most of what reading an in-memory example used to cost:
    # those sources are ordered by a numpy permutation of each epoch instead. Records on disk keep Grain's
    # shuffle (and their order): there may be more of them than a permutation array should hold, and
    # decoding a record costs more than shuffling its index.
    order = (GrainOrder if cfg.name == "array_record" else EpochOrder)(len(train_src), seed)
    train = grain.MapDataset.source(TrainBatches(train_src, order, cfg.batch_size, rows)).map(cast)
    eval_batches = EvalBatches(eval_src, cast, cfg.batch_size, rows)
    return Data(task=task, train=train, eval=eval_batches, batch_size=cfg.batch_size, tokens_per_example=tokens,
                num_classes=classes, rows=rows)


def _build_mixture(cfg, seed: int, cache_dir) -> Data:
    """data.mixture: the sources' train splits mixed by weight (`mixture.MixOrder`), their eval splits apart."""
    from shard.data import mixture

    if cfg.name != "documents":
        raise UserError(f"data.mixture is read by data.name=documents only (data.name={cfg.name})")
    if cfg.task not in ("auto", "lm"):
        raise UserError(f"data.task={cfg.task}: a mixture of documents is language modelling (lm)")
    trains, evals, weights, largest = mixture.splits(cfg, cache_dir or ".token_cache")
    n_proc, proc = jax.process_count(), jax.process_index()
    if cfg.batch_size % n_proc:
        raise UserError(f"data.batch_size={cfg.batch_size} must be divisible by the {n_proc} processes")
    rows = Rows(proc * (cfg.batch_size // n_proc), cfg.batch_size // n_proc)
    concat = mixture.Concat(trains)
    train = grain.MapDataset.source(TrainBatches(concat, mixture.MixOrder(concat, weights, seed), cfg.batch_size, rows))
    parts = {name: EvalBatches(src, lambda b: b, cfg.batch_size, rows) for name, src in evals.items()}
    everything = EvalBatches(mixture.Concat(list(evals.values())), lambda b: b, cfg.batch_size, rows)
    return Data(task="lm", train=train, eval=everything, batch_size=cfg.batch_size, tokens_per_example=cfg.seq_len,
                num_classes=vocab_size(cfg), rows=rows, eval_parts=parts, largest_token=largest)


def vocab_size(cfg) -> int:
    """A language model's vocabulary: the tokenizer's (documents), else the 256 byte values."""
    if cfg.name != "documents":
        return 256
    from shard.data import tokenizer

    return tokenizer.load(cfg.tokenizer).vocab_size


def _num_classes(cfg, train_src, task: str) -> int:
    if cfg.name == "synthetic":
        return cfg.classes
    targets = getattr(train_src, "targets", None)
    return int(np.max(targets)) + 1 if targets is not None else 0


class EpochOrder:
    """Stream position -> example: the examples repeated endlessly, epoch `e` in the order of a numpy
    permutation drawn from (seed, e): any position's example is known without reading the ones before it."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        epochs, within = np.divmod(positions, self.n)
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs):  # a batch spans at most two epochs
            rows = epochs == epoch
            indices[rows] = _permutation(self.n, self.seed, int(epoch))[within[rows]]
        return indices


SHUFFLE_STREAM = 0x5348_5546  # "SHUF": keeps the shuffle's draws apart from the sources' (seed, ...) streams


@functools.lru_cache(maxsize=2)  # the epoch being read and the next: a batch may cross into it
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, SHUFFLE_STREAM, epoch]).permutation(n)


class GrainOrder:
    """Stream position -> example by Grain's `MapDataset.shuffle` (a fresh shuffle each epoch): constant
    memory however many examples there are, one Grain lookup per position."""

    def __init__(self, n: int, seed: int):
        self.stream = grain.MapDataset.range(n).seed(seed).shuffle().repeat()

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return np.array([self.stream[int(p)] for p in positions], np.int64)


@dataclass
class Rows:
    """The rows of every global batch this process reads: those its devices hold. By default its
    1/processes block; `use_rows` sets them from the batch's sharding (an axis that replicates the
    batch across processes, such as tensor or context parallelism, gives each process more of it)."""
    offset: int
    count: int


def use_rows(data: Data, sharding, global_shape: tuple) -> None:
    """Point data's readers at the rows of the global batch this process's devices hold under `sharding`."""
    spans = sorted({(s[0].start or 0, global_shape[0] if s[0].stop is None else s[0].stop)
                    for s in sharding.addressable_devices_indices_map(global_shape).values()})
    start, stop = spans[0][0], max(b for _, b in spans)
    covered = start
    for a, b in spans:
        if a > covered:
            raise UserError(f"this process's devices hold rows {spans} of each batch, not one block; order the "
                            "mesh so that each process's devices hold neighbouring batch rows")
        covered = max(covered, b)
    data.rows.offset, data.rows.count = start, stop - start


class TrainBatches:
    """This process's rows of global batch `s` at index `s`, endlessly (Grain's source protocol). Global batch
    s is positions [s*B, (s+1)*B) of the shuffled stream; each process reads its contiguous block of them
    (`Rows`), in one `read_batch` from the source."""

    def __init__(self, source, order, batch_size: int, rows: Rows):
        self.source, self.order, self.batch_size, self.rows = source, order, batch_size, rows

    def __len__(self) -> int:
        return sys.maxsize  # endless, as a repeated Grain dataset is

    def __getitem__(self, s: int) -> dict:
        start = s * self.batch_size + self.rows.offset
        return self.source.read_batch(self.order(np.arange(start, start + self.rows.count)))


class EvalBatches:
    """Every example of the eval split exactly once, in global batches; the last is padded and carries
    `mask` 0 on its padding so metrics count only real examples."""

    def __init__(self, source, cast, batch_size: int, rows: Rows):
        self.source, self.cast, self.batch_size, self.rows = source, cast, batch_size, rows

    def __len__(self) -> int:
        return -(-len(self.source) // self.batch_size)

    def __getitem__(self, i: int) -> dict:
        rows = i * self.batch_size + self.rows.offset + np.arange(self.rows.count)
        real = rows < len(self.source)
        batch = self.cast(self.source.read_batch(np.where(real, rows, 0)))  # padding: example 0, masked out
        batch["mask"] = real.astype(np.float32)
        return batch


def device_batches(batches, shardings: dict, start: int = 0, prefetch: int = 2, batch_size: int | None = None):
    """Yield global, sharded batches start, start+1, ... of `batch_size` rows (default: this process's
    rows times the processes). A background thread reads and transfers up to `prefetch` batches ahead
    while the current step runs (0: read in the loop, nothing overlaps)."""

    def put(index: int) -> dict:
        local = batches[index]
        shape = lambda v: None if batch_size is None else (batch_size, *np.shape(v)[1:])
        return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v), shape(v))
                for k, v in local.items()}

    if prefetch == 0:
        index = start
        while True:
            yield put(index)
            index += 1
    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def produce():
        index = start
        while not stop.is_set():
            try:
                item = put(index)
            except Exception as e:  # hand the error to the consumer
                item = e
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Exception):
                return
            index += 1

    thread = threading.Thread(target=produce, name="shard-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()  # never leave it inside a JAX call while the interpreter shuts down
