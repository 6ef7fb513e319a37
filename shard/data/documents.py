"""Reading documents for `data.name=documents`: the texts of one column (`data.field`) of JSON Lines
(.jsonl, .jsonl.gz), JSON (.json: an array of objects, or JSON Lines), Parquet, Arrow IPC streams (the
*.arrow files of a `datasets` save_to_disk folder) and plain text files (one document each).

Rows are streamed in batches (`BATCH` texts at a time), so a file larger than memory reads in constant
memory; a .json array is the exception (JSON has no streaming form here: it is one file's worth).
"""

import glob
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

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
    """The file's documents, in batches of at most BATCH texts."""
    reader = {".jsonl": _jsonl, ".jsonl.gz": _jsonl, ".json": _json, ".parquet": _parquet, ".arrow": _arrow,
              ".txt": _txt}[kind(path)]
    batch = []
    for text in reader(path, field):
        batch.append(text)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _txt(path: Path, field: str):
    yield path.read_bytes().decode("utf-8", errors="replace")


def _jsonl(path: Path, field: str):
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _text(_row(line, path, number), field, path, number)
    except (OSError, EOFError) as e:  # a truncated or corrupt .gz
        raise UserError(f"{path}: cannot be read ({e})") from None


def _json(path: Path, field: str):
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):  # JSON Lines under a .json name (what datasets' to_json writes)
        yield from _jsonl(path, field)
        return
    try:
        rows = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except ValueError as e:
        raise UserError(f"{path}: malformed JSON ({e})") from None
    for number, row in enumerate(rows, 1):
        yield _text(row, field, path, number, "item")


def _row(line: str, path: Path, number: int):
    try:
        return json.loads(line)
    except ValueError as e:
        raise UserError(f"{path}:{number}: malformed JSON line ({e})") from None


def _text(row, field: str, path: Path, number: int, what: str = "line"):
    if not isinstance(row, dict):
        raise UserError(f"{path}:{number}: {what} {number} is a JSON {type(row).__name__}, not an object with "
                        f"data.field={field!r}")
    if field not in row:
        raise UserError(f"{path}:{number}: no data.field={field!r}; its fields are: {', '.join(map(str, row)) or '(none)'}")
    return _string(row[field], field, f"{path}:{number}")


def _string(value, field: str, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: data.field={field!r} is a {type(value).__name__}, not text")
    return value


def _column(schema, field: str, path: Path) -> None:
    if field not in schema.names:
        raise UserError(f"{path}: no column data.field={field!r}; its columns are: {', '.join(schema.names) or '(none)'}")


def _parquet(path: Path, field: str):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    _column(parquet.schema_arrow, field, path)
    for batch in parquet.iter_batches(batch_size=BATCH, columns=[field]):
        yield from _strings(batch.column(0), field, path)


def _arrow(path: Path, field: str):
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
    _column(reader.schema, field, path)
    batches = reader if isinstance(reader, ipc.RecordBatchStreamReader) else \
        (reader.get_batch(i) for i in range(reader.num_record_batches))
    for batch in batches:
        yield from _strings(batch.column(batch.schema.get_field_index(field)), field, path)


def _strings(column, field: str, path: Path):
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise UserError(f"{path}: column data.field={field!r} is {column.type}, not text")
    for value in column.to_pylist():
        yield value or ""
