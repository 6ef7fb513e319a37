"""Reading documents for `data.name=documents`: the values of one column (`data.field`), or two (a prompt's
and its completion's), of JSON Lines (.jsonl, .jsonl.gz), JSON (.json: an array of objects, or JSON
Lines), Parquet, Arrow IPC streams (the *.arrow files of a `datasets` save_to_disk folder) and plain text
files (one document each). A value is text, or a chat's list of messages (shard/data/formats.py says what
each becomes).

Rows are streamed in batches (`BATCH` texts at a time), so a file larger than memory reads in constant
memory; a .json array is the exception (JSON has no streaming form here: it is one file's worth).
"""

import glob
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

from shard.data import formats
from shard.errors import UserError

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow", ".txt")
DATASETS_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk's, beside its .arrow files
BATCH = 1024  # texts per batch handed to the tokenizer


def kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def corpus_files(path: str | None) -> list[Path]:
    """The files `data.path` names: a file, a folder (its readable files, recursively) or a glob."""
    if path is None:
        raise UserError("data.name=documents needs data.path: a file, folder or glob of .jsonl, .jsonl.gz, .json, "
                        ".parquet, .txt files, or a datasets save_to_disk folder")
    if any(c in path for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    elif os.path.isdir(path):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file() and kind(p) and p.name not in DATASETS_METADATA)
    elif os.path.isfile(path):
        files = [Path(path)]
    else:
        raise UserError(f"data.path={path!r} does not exist")
    unknown = [str(f) for f in files if not kind(f)]
    if unknown:
        raise UserError(f"data.path={path!r}: {unknown[0]} is none of {', '.join(SUFFIXES)}")
    if not files:
        raise UserError(f"data.path={path!r} holds no {', '.join(SUFFIXES)} files")
    return files


def texts(path: Path, field: str) -> Iterator[list[str]]:
    """The file's documents (the text in `field`), in batches of at most BATCH texts."""
    for batch in rows(path, (field,)):
        yield [formats.text_value(values[0], formats.describe((field,)), str(path)) for values in batch]


def rows(path: Path, names: tuple[str, ...]) -> Iterator[list[tuple]]:
    """The file's rows as tuples of the values in columns `names` (text, or a chat's list of messages), in
    batches of at most BATCH rows. A missing column is one line naming the columns there are."""
    reader = {".jsonl": _jsonl, ".jsonl.gz": _jsonl, ".json": _json, ".parquet": _parquet, ".arrow": _arrow,
              ".txt": _txt}[kind(path)]
    batch = []
    for values in reader(path, names):
        batch.append(values)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _txt(path: Path, names: tuple[str, ...]):
    if len(names) > 1:
        raise UserError(f"{path}: a .txt file is one document; prompt/completion rows come from JSON Lines, JSON, "
                        "Parquet or Arrow files")
    yield (path.read_bytes().decode("utf-8", errors="replace"),)


def _jsonl(path: Path, names: tuple[str, ...]):
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _values(_row(line, path, number), names, path, number)
    except (OSError, EOFError) as e:  # a truncated or corrupt .gz
        raise UserError(f"{path}: cannot be read ({e})") from None


def _json(path: Path, names: tuple[str, ...]):
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):  # JSON Lines under a .json name (what datasets' to_json writes)
        yield from _jsonl(path, names)
        return
    try:
        items = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except ValueError as e:
        raise UserError(f"{path}: malformed JSON ({e})") from None
    for number, row in enumerate(items, 1):
        yield _values(row, names, path, number, "item")


def _row(line: str, path: Path, number: int):
    try:
        return json.loads(line)
    except ValueError as e:
        raise UserError(f"{path}:{number}: malformed JSON line ({e})") from None


def _values(row, names: tuple[str, ...], path: Path, number: int, what: str = "line") -> tuple:
    if not isinstance(row, dict):
        raise UserError(f"{path}:{number}: {what} {number} is a JSON {type(row).__name__}, not an object with "
                        f"{formats.describe(names)}")
    for name in names:
        if name not in row:
            raise UserError(f"{path}:{number}: no {formats.describe((name,), names)}; its fields are: "
                            f"{', '.join(map(str, row)) or '(none)'}")
    return tuple(row[name] for name in names)


def _columns(schema, names: tuple[str, ...], path: Path) -> None:
    for name in names:
        if name not in schema.names:
            raise UserError(f"{path}: no column {formats.describe((name,), names)}; its columns are: "
                            f"{', '.join(schema.names) or '(none)'}")


def _parquet(path: Path, names: tuple[str, ...]):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    _columns(parquet.schema_arrow, names, path)
    for batch in parquet.iter_batches(batch_size=BATCH, columns=list(names)):
        yield from _batch_values(batch, names, path)


def _arrow(path: Path, names: tuple[str, ...]):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    source = pa.memory_map(str(path))
    try:  # datasets' save_to_disk writes the stream format; the file format is read as well
        reader = ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            reader = ipc.open_file(source)
        except pa.ArrowInvalid as e:
            raise UserError(f"{path}: not an Arrow IPC stream or file ({e})") from None
    _columns(reader.schema, names, path)
    batches = reader if isinstance(reader, ipc.RecordBatchStreamReader) else \
        (reader.get_batch(i) for i in range(reader.num_record_batches))
    for batch in batches:
        yield from _batch_values(batch, names, path)


def _batch_values(batch, names: tuple[str, ...], path: Path):
    """A record batch's rows as tuples: text columns, or list columns (a chat's messages)."""
    import pyarrow as pa

    columns = []
    for name in names:
        column = batch.column(batch.schema.get_field_index(name))
        text = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
        if not (text or pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise UserError(f"{path}: column {formats.describe((name,), names)} is {column.type}, not text (or a "
                            "chat's messages)")
        columns.append(column.to_pylist())
    yield from zip(*columns)
