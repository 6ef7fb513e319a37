"""Tokenizers for `data.tokenizer`: `bytes` (one token per UTF-8 byte, 256 ids, no special ids), a Hugging
Face `tokenizer.json` (or a folder holding one), or a SentencePiece `.model`.

Every tokenizer also says how many bytes of the original text each token stands for (`encode_batch`'s
second result), so that eval can report bits per byte whatever the vocabulary: a token covers the bytes
from the end of the previous token's span to the end of its own, so a document's counts add up to its
UTF-8 length exactly (tokens that share a character, as byte-level BPE pieces of one character do, count
it once). Between documents stands EOS (the tokenizer's own; where it has none, its encoding of a newline),
counted as one byte: the newline it stands for, as the byte-level vocabulary's separator is one.
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from shard.errors import UserError

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]")


class Bytes:
    """The byte-level vocabulary of `data.name=text`: token = byte, no BOS or EOS (documents are joined
    by a newline byte)."""
    kind, vocab_size, bos, eos = "bytes", 256, None, None

    def identity(self) -> str:
        return "bytes"

    def encode_batch(self, texts: list[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        ids = [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
        return ids, [np.ones(len(i), np.uint16) for i in ids]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(t) % 256 for t in ids).decode("utf-8", errors="replace")


class HuggingFace:
    """A `tokenizers` tokenizer.json, encoded without the post-processor's special tokens (BOS and EOS
    are placed by the document stream, once per document)."""
    kind = "huggingface"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path = path
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own Exception subclasses for a bad file
            raise UserError(f"data.tokenizer={str(path)!r} is not a readable tokenizer.json: {_line(e)}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        named = config_tokens(path.parent / "tokenizer_config.json")
        special = [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special]
        self.bos = self._id(named.get("bos_token") or next((n for n in BOS_NAMES if n in special), None))
        self.eos = self._id(named.get("eos_token") or next((n for n in EOS_NAMES if n in special), None))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    def identity(self) -> str:
        return f"huggingface:{_files_hash(self.path)}"  # tokenizer_config.json too: it names BOS and EOS

    def encode_batch(self, texts: list[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        encodings = self.tok.encode_batch(texts, add_special_tokens=False)
        ids, counts = [], []
        for text, enc in zip(texts, encodings):
            ids.append(np.array(enc.ids, np.uint32))
            ends = np.array([end for _, end in enc.offsets], np.int64) if enc.ids else np.zeros(0, np.int64)
            counts.append(_counts(text, ends))
        return ids, counts

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


class SentencePiece:
    """A SentencePiece `.model`; its pieces carry byte offsets into the text, which give the counts."""
    kind = "sentencepiece"

    def __init__(self, path: Path):
        import sentencepiece

        self.path = path
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # OSError or RuntimeError, depending on what is wrong with the file
            raise UserError(f"data.tokenizer={str(path)!r} is not a readable SentencePiece model: {_line(e)}") from None
        self.vocab_size = self.sp.vocab_size()
        self.bos = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def identity(self) -> str:
        return f"sentencepiece:{_files_hash(self.path)}"

    def encode_batch(self, texts: list[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        ids, counts = [], []
        for text, proto in zip(texts, self._protos(texts)):
            ids.append(np.array([p.id for p in proto.pieces], np.uint32))
            # begin/end are byte offsets into the text; the counts come straight from them
            ends = np.array([p.end for p in proto.pieces], np.int64)
            counts.append(_byte_counts(ends, len(text.encode("utf-8"))))
        return ids, counts

    def _protos(self, texts: list[str]):
        try:  # sentencepiece >= 0.2.1 names it proto; 0.2.0 immutable_proto
            return self.sp.encode(texts, out_type="proto")
        except ValueError:
            return self.sp.encode(texts, out_type="immutable_proto")

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


def load(spec: str | None):
    """The tokenizer `data.tokenizer` names: bytes, a tokenizer.json (or a folder with one) or a .model."""
    if spec in (None, "bytes"):
        return Bytes()
    path = tokenizer_file(spec)
    if not path.is_file():
        raise UserError(f"data.tokenizer={spec!r} does not exist; give bytes, a tokenizer.json (or a folder holding "
                        "one) or a SentencePiece .model")
    return SentencePiece(path) if path.suffix == ".model" else HuggingFace(path)


def tokenizer_file(spec: str) -> Path:
    """The tokenizer's file: the path itself, or in a folder its tokenizer.json, else its one .model."""
    path = Path(spec).expanduser()
    if path.is_dir():
        models = sorted(path.glob("*.model"))
        path = path / "tokenizer.json" if (path / "tokenizer.json").is_file() or len(models) != 1 else models[0]
    return path


def files(spec: str | None) -> dict[str, bytes]:
    """name -> content of the files a tokenizer is read from (none for bytes): its own file, and a
    tokenizer.json's tokenizer_config.json (BOS and EOS) where there is one beside it."""
    if spec in (None, "bytes"):
        return {}
    path = tokenizer_file(spec)
    found = {path.name if path.suffix == ".model" else "tokenizer.json": path.read_bytes()}
    if path.suffix == ".json" and (path.parent / "tokenizer_config.json").is_file():
        found["tokenizer_config.json"] = (path.parent / "tokenizer_config.json").read_bytes()
    return found


def separator(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """What ends each document in the stream, and its byte counts: EOS (one byte), or where the tokenizer
    has none, its encoding of a newline (one byte in all)."""
    if tokenizer.eos is not None:
        return np.array([tokenizer.eos], np.uint32), np.ones(1, np.uint16)
    ids, _ = tokenizer.encode_batch(["\n"])
    counts = np.zeros(len(ids[0]), np.uint16)
    counts[:1] = 1
    return ids[0].astype(np.uint32), counts


def _counts(text: str, char_ends: np.ndarray) -> np.ndarray:
    """Byte counts from character end offsets (Hugging Face offsets are in characters)."""
    data = text.encode("utf-8")
    if len(data) != len(text) and len(char_ends):  # not ASCII: character offsets -> byte offsets
        points = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), np.uint32)
        widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000).astype(np.int64)
        char_ends = np.concatenate([[0], np.cumsum(widths)])[np.clip(char_ends, 0, len(text))]
    return _byte_counts(char_ends, len(data))


def _byte_counts(ends: np.ndarray, total: int) -> np.ndarray:
    """Each token's new bytes: the rise of the running maximum of its end offset; what no token's span
    reaches (trailing text a normaliser dropped) goes to the last token, so the sum is `total`."""
    if not len(ends):
        return np.zeros(0, np.uint16)
    reach = np.maximum.accumulate(np.clip(ends, 0, total))
    counts = np.diff(reach, prepend=0)
    counts[-1] += total - reach[-1]
    return np.minimum(counts, np.iinfo(np.uint16).max).astype(np.uint16)


def config_tokens(path: Path) -> dict:
    """bos_token / eos_token from a tokenizer_config.json beside the tokenizer (a string or {"content": ...})."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def _files_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for name, content in sorted(files(str(path)).items()):
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()[:16]


def _line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def quiet_parallelism() -> None:
    """In a worker process of a parallel build: the processes are the parallelism, not each one's threads."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
