"""The one tokenizer object of a run: training, eval, generation, serving and export all hold one of these.

`load(spec)` gives `Bytes` (`data.tokenizer=bytes`: one token per UTF-8 byte, no special ids) or `Text`, a
`tokenizers` tokenizer built from a folder's files (shard/data/tokenizer_files.py finds them) so that it
encodes exactly as transformers' `AutoTokenizer.from_pretrained(folder)(text)` does:

- tokenizer.json as written, except where transformers builds it with a tokenizer class whose constructor
  rebuilds the text pipeline around the file's vocabulary (Llama, Gemma, Qwen2, GPT-2: shard/data/pipelines.py);
  the class is tokenizer_config.json's, or the one config.json's model_type picks (shard/data/auto_class.py: a
  Phi-3 folder says LlamaTokenizer and is read as written); a SentencePiece .model converted as transformers
  converts it (shard/data/spm.py); vocab.json + merges.txt read as the class's byte-level BPE.
- Special tokens around a text (BOS, EOS) as tokenizer.json's post-processor says (transformers 5 drops
  tokenizer_config.json's add_bos_token/add_eos_token where there is a tokenizer.json); without one, as those
  flags say; else none.
- Never truncated or padded, whatever tokenizer.json's `truncation` and `padding` fields hold.

`encode(text)` is AutoTokenizer's input_ids; `prompt(text)` the same without what follows the text (the
tokens a model is asked to continue: training's row for that text starts with them); `encode(text,
special=False)` the text alone (a rendered chat template writes its own special tokens).

Every tokenizer also says how many bytes of the original text each token stands for (eval's bits per
byte): a token covers the bytes from the end of the previous token's span to the end of its own, so a
text's counts add up to its UTF-8 length exactly; special tokens stand for none.

`stream(prompt)` decodes an answer as its tokens come (`Detokenizer`), and `end_ids` are the ids that end one:
EOS and generation_config.json's `eos_token_id`s.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shard.data import auto_class, byte_counts, pipelines, spm, tokenizer_files
from shard.data.tokenizer_files import Found
from shard.errors import UserError, first_line

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")  # where the config names none
BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]")
CONTEXT = 4  # prompt tokens decoded along with an answer: enough for a character split over byte-fallback tokens
REPLACEMENT = "\ufffd"


class Detokenizer:
    """An answer's text as its tokens come (`tokenizer.stream(prompt)`): `add(id)` is the text that token
    completes, `flush()` at the end what is still held back; joined, they are `continuation(prompt, ids)`.

    As vLLM does it, each add decodes a short window, the tokens of the last text shown (the first `read`)
    and those after them, and emits what the window's text adds to theirs: decoded after the token before
    it, a token keeps what it owes to it (a SentencePiece word's leading space), and the cost stays linear.
    Text is held back while it may still change: with SentencePiece's byte fallback, which decodes a run of
    <0x..> tokens as one (a stray byte to come turns the run's characters into U+FFFD), while the window
    ends in such a token; else while it ends in U+FFFD, unless what came before the new token is settled
    (the two decode apart as together), so that bytes that never make a character do not widen the window
    for ever.
    """

    def __init__(self, decode: Callable[[list[int]], str], seed: list[int], dropped: Callable[[int], bool],
                 runs: frozenset[int] = frozenset()):
        self._decode, self._dropped, self._runs = decode, dropped, runs
        self._start([i for i in seed if not dropped(i)])

    def _start(self, seed: list[int]) -> None:
        self.ids, self.read = list(seed), len(seed)
        self.shown = self.text = self._decode(seed)  # the first `read` tokens' text; the window's as last decoded
        self.prompt_text = self.shown  # until the first text, which must start with it as in continuation

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        if self._dropped(token_id):  # as decode drops special and unknown ids
            return ""
        self.ids.append(token_id)
        if token_id in self._runs:
            return ""
        before, self.text = self.text, self._decode(self.ids)
        if self._runs or not self.text.endswith(REPLACEMENT):
            return self._show(self.text, len(self.ids))
        alone = self._decode(self.ids[-1:])
        if before + alone == self.text:  # no character across the new token's start
            return self._show(before, len(self.ids) - 1, alone)
        return ""

    def flush(self) -> str:
        """What is held back at the end of the answer (U+FFFD for bytes that never made a character)."""
        return self._show(self._decode(self.ids), len(self.ids), final=True)

    def _show(self, text: str, end: int, rest: str = "", final: bool = False) -> str:
        """What `text`, the first `end` tokens', adds to those shown; the window then starts at `read`."""
        if self.prompt_text is not None:
            if not text.startswith(self.prompt_text):  # the answer changed how the prompt's tail decodes:
                answer = self.ids[self.read:]          # continuation then decodes the answer alone
                self._start([])
                out = "".join(map(self.add, answer))
                return out + self.flush() if final else out
            self.prompt_text = None
        new = text[len(self.shown):]
        del self.ids[:self.read]
        self.read = end - self.read
        self.shown = self._decode(self.ids[:self.read])
        self.text = self.shown + rest
        return new


class Bytes:
    """The byte-level vocabulary of `data.name=text`: token = byte, no BOS or EOS (documents are joined
    by a newline byte)."""
    kind, vocab_size, bos, eos, chat_template, found = "bytes", 256, None, None, None, None
    head, tail = (), ()  # no special ids around a text
    end_ids = frozenset()

    def identity(self) -> str:
        return "bytes"

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    prompt = encode

    def encode_rows(self, texts: list[str], special: list[bool]):
        """(ids, character offsets (n, 2), byte counts) per text."""
        out = []
        for text in texts:
            ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint32)
            chars = np.repeat(np.arange(len(text)), byte_counts.char_widths(text))
            out.append((ids, np.stack([chars, chars + 1], 1), np.ones(len(ids), np.uint16)))
        return out

    def decode(self, ids) -> str:
        return bytes(int(t) % 256 for t in ids).decode("utf-8", errors="replace")

    def continuation(self, prompt, ids) -> str:
        return self.decode(ids)

    def stream(self, prompt) -> Detokenizer:
        return Detokenizer(self.decode, [], lambda token_id: False)  # continuation decodes the answer alone

    def special(self, key: str) -> str | None:
        return None

    def special_text(self, token_id: int) -> str | None:
        return None


class Text:
    """A tokenizer read from a folder's files (see the module's docstring)."""
    kind = "huggingface"

    def __init__(self, found: Found, where: str):
        self.found, self.where = found, where
        self.tok, self._byte_level = _backend(found, where)
        self.cls, self.picked = _class(found, found.config, found.model, self._byte_level)  # the class it is read with
        self.tok.no_truncation()  # transformers' tokenizer(text) truncates only when asked
        self.tok.no_padding()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        special = [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special]
        self.bos = self._id(found.special("bos_token") or next((n for n in BOS_NAMES if n in special), None))
        self.eos = self._id(found.special("eos_token") or next((n for n in EOS_NAMES if n in special), None))
        self.head, self.tail = self._around()
        self.chat_template = found.chat_template
        self.end_ids = self._ends()
        self._special = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
        self._bytes = frozenset()  # byte fallback's <0x..> tokens, where the decoder reads them
        if "ByteFallback" in _types(self.tok.decoder):
            self._bytes = frozenset(i for b in range(256) if (i := self.tok.token_to_id(f"<0x{b:02X}>")) is not None)

    def read_as(self, config: dict, model: dict) -> tuple[str, str | None]:
        """auto_class.of_folder for these files beside this tokenizer_config.json and config.json's MODEL_KEYS: the
        class AutoTokenizer builds them with (an exported folder's config.json may pick another than the run's).
        vocab.json + merges.txt where nothing names a class: AutoTokenizer tries the file as written (a tokenizer.json
        it does not find) and fails, where the run reads GPT-2's class; the answer is then GENERIC, so an export
        names the run's class in its tokenizer_config.json."""
        if self.found.kind == "bpe" and auto_class.choose(config, model, byte_level=False) is None:
            return auto_class.GENERIC, None
        return _class(self.found, config, model, self._byte_level)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    def _around(self) -> tuple[list[int], list[int]]:
        """The special ids before and after every text, as transformers places them."""
        add_bos, add_eos = self.found.flag("add_bos_token"), self.found.flag("add_eos_token")
        if (add_bos is not None or add_eos is not None) and self.found.kind != "json":
            return ([self.bos] if add_bos and self.bos is not None else [],
                    [self.eos] if add_eos and self.eos is not None else [])
        if self.tok.post_processor is None:
            return [], []
        enc = self.tok.encode("a", add_special_tokens=True)
        body = [i for i, s in enumerate(enc.special_tokens_mask) if not s]
        if not body:
            return list(enc.ids), []
        return list(enc.ids[:body[0]]), list(enc.ids[body[-1] + 1:])

    def _ends(self) -> frozenset[int]:
        """EOS and generation_config.json's eos_token_id (one id or a list: Llama 3 instruct's three, Qwen3's
        two, Gemma 3's <end_of_turn>), as transformers' generate stops; ids outside the vocabulary left out."""
        listed = self.found.generation.get("eos_token_id")
        listed = listed if isinstance(listed, list) else [listed]
        return frozenset(i for i in (self.eos, *listed) if type(i) is int and self._known(i))

    def _known(self, token_id: int) -> bool:
        return 0 <= token_id < 1 << 32 and self.tok.id_to_token(token_id) is not None

    def special(self, key: str) -> str | None:
        return self.found.special(key)

    def special_text(self, token_id: int) -> str | None:
        """A special token's own text (<|endoftext|>, which decode drops), else None: how a server's logprobs
        name it."""
        return self.tok.id_to_token(int(token_id)) if int(token_id) in self._special else None

    def added_id(self, text: str) -> int | None:
        """The id of the added token (special or not: <|im_end|>, <end_of_turn>) whose text is `text`."""
        return next((i for i, t in self.tok.get_added_tokens_decoder().items() if t.content == text), None)

    def identity(self) -> str:
        digest = hashlib.sha256()
        for name, content in sorted(self.found.files().items()):
            digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
        if self.picked:  # config.json changed the class: the same files give other tokens
            digest.update(b"class\0" + self.picked.encode())
        return f"huggingface:{digest.hexdigest()[:16]}"

    def encode(self, text: str, special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return self.head + ids + self.tail if special else ids

    def prompt(self, text: str) -> list[int]:
        """What a model is asked to continue: the special tokens before the text, and the text."""
        return self.head + self.tok.encode(text, add_special_tokens=False).ids

    def encode_rows(self, texts: list[str], special: list[bool]):
        """(ids, character offsets (n, 2), byte counts) per text; where `special` says, the special ids
        before a text (offsets (0, 0)) and after it (len, len)."""
        out = []
        for text, around, enc in zip(texts, special, self.tok.encode_batch(texts, add_special_tokens=False)):
            head, tail = (self.head, self.tail) if around else ([], [])
            ids = np.array(head + enc.ids + tail, np.uint32)
            offsets = np.array(enc.offsets, np.int64).reshape(-1, 2)
            offsets = np.concatenate([np.zeros((len(head), 2), np.int64), offsets,
                                      np.full((len(tail), 2), len(text), np.int64)])
            counts = byte_counts.of_offsets(text, offsets[:, 1]) if len(ids) else np.zeros(0, np.uint16)
            counts[:len(head)] = 0
            if len(tail) and len(ids) > len(tail):  # what the last text token did not reach stays with the text
                counts[len(ids) - len(tail) - 1] += counts[len(ids) - len(tail):].sum()
                counts[len(ids) - len(tail):] = 0
            out.append((ids, offsets, counts))
        return out

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def continuation(self, prompt, ids) -> str:
        """The text `ids` add after `prompt`. Decoded alone they would lose what their first token owes to the
        one before it (a SentencePiece answer's leading space), so the last few prompt tokens decode along."""
        before = [int(i) for i in prompt[-CONTEXT:]]
        head, whole = self.decode(before), self.decode([*before, *(int(i) for i in ids)])
        return whole[len(head):] if whole.startswith(head) else self.decode(ids)

    def stream(self, prompt) -> Detokenizer:
        """The answer to `prompt` decoded as its tokens come, each add's text as `continuation` has it."""
        return Detokenizer(self.decode, [int(i) for i in prompt[-CONTEXT:]], self._dropped, self._bytes)

    def _dropped(self, token_id: int) -> bool:
        return token_id in self._special or not self._known(token_id)


def load(spec: str | None, key: str = "data.tokenizer"):
    """The tokenizer `spec` names: bytes, or a tokenizer's file or folder (tokenizer_files.find)."""
    if spec in (None, tokenizer_files.BYTES):
        return Bytes()
    return Text(tokenizer_files.find(spec, key), f"{key}={spec!r}")


RUN_FOLDER = "tokenizer"  # in a run folder: a copy of data.tokenizer's files


def of_run(data_cfg, run_folder: Path | None = None):
    """The tokenizer a run's text went through: data.tokenizer for documents, else bytes; the run folder's own
    copy where it has one (the original may have moved, or be on another machine)."""
    if data_cfg.name != "documents":
        return Bytes()
    kept = run_folder / RUN_FOLDER if run_folder is not None else None
    return load(str(kept) if kept is not None and kept.is_dir() else data_cfg.tokenizer)


def keep(data_cfg, run_folder: Path) -> None:
    """Copy data.tokenizer's files into the run folder, where generation, serving and export find them."""
    kept = run_folder / RUN_FOLDER
    if data_cfg.name != "documents" or data_cfg.tokenizer in (None, tokenizer_files.BYTES):
        if kept.is_dir():  # an earlier run's copy in this folder would otherwise be read for this one's text
            shutil.rmtree(kept)
        return
    files = tokenizer_files.find(data_cfg.tokenizer).kept()
    fresh = Path(tempfile.mkdtemp(prefix=f".{RUN_FOLDER}.", dir=run_folder))
    for name, content in files.items():
        (fresh / name).write_bytes(content)
    if kept.is_dir():
        shutil.rmtree(kept)
    os.replace(fresh, kept)


def separator(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """What ends each document in the stream, and its byte counts: EOS (one byte), or where the tokenizer
    has none, its encoding of a newline (one byte in all)."""
    if tokenizer.eos is not None:
        return np.array([tokenizer.eos], np.uint32), np.ones(1, np.uint16)
    ids = np.array(tokenizer.encode("\n", special=False), np.uint32)
    counts = np.zeros(len(ids), np.uint16)
    counts[:1] = 1
    return ids, counts


# ----------------------------------------------------------------------------- building the backend

def _backend(found: Found, where: str):
    """The `tokenizers` Tokenizer of `found`, its text pipeline as transformers' class for it builds it, and
    whether the file is byte-level (which the class may depend on)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    try:
        if found.kind == "sentencepiece":  # its class pipeline and added tokens are the converter's
            cls, _ = _class(found, found.config, found.model, byte_level=False)
            return spm.to_tokenizers(found.main, found.config, cls), False
        elif found.kind == "bpe":
            tok = Tokenizer(BPE.from_file(str(found.main), str(found.extra["merges"])))
        else:
            tok = Tokenizer.from_file(str(found.main))
    except UserError:
        raise
    except Exception as e:  # the libraries raise their own Exception subclasses for a bad file
        raise UserError(f"{where}: {found.main.name} is not a readable tokenizer: {first_line(e)}") from None
    byte_level = found.kind == "json" and _byte_level(tok)
    cls, _ = _class(found, found.config, found.model, byte_level)
    if cls in pipelines.CLASSES:
        pipelines.CLASSES[cls](tok, found.config)
    _add_named(tok, found, cls)
    return tok, byte_level


def _class(found: Found, config: dict, model: dict, byte_level: bool) -> tuple[str, str | None]:
    """auto_class.of_folder for `found`'s kind of files (`byte_level`: its tokenizer.json's, as read)."""
    fallback = "GPT2Tokenizer" if found.kind == "bpe" else auto_class.GENERIC  # two files: GPT-2's, whose they are
    return auto_class.of_folder(config, model, byte_level, fallback)


def _byte_level(tok) -> bool:
    """Whether the pre-tokenizer or decoder is (or holds) ByteLevel, as transformers asks of a tokenizer.json."""
    return "ByteLevel" in _types(tok.pre_tokenizer, tok.decoder)


def _types(*parts) -> set[str]:
    """The types of these pipeline parts and of those a Sequence of them holds."""
    parts = [json.loads(part.__getstate__()) for part in parts if part is not None]
    parts += [p for part in list(parts) for p in part.get("pretokenizers", part.get("decoders", []))]
    return {p.get("type") for p in parts}


def _add_named(tok, found: Found, cls: str | None) -> None:
    """tokenizer_config.json's added tokens and named special tokens, where the file lacks them (transformers
    adds both); named ones count as special."""
    from tokenizers import AddedToken

    have = {t.content for t in tok.get_added_tokens_decoder().values()}
    new = []
    for index, entry in sorted((found.config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
        if isinstance(entry, dict) and entry.get("content") not in have:
            new.append(AddedToken(entry["content"], single_word=entry.get("single_word", False),
                                  lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                                  normalized=entry.get("normalized", True), special=entry.get("special", False)))
            have.add(entry["content"])
    defaults = pipelines.CLASS_DEFAULTS.get(cls, {})
    for key in tokenizer_files.SPECIAL_KEYS:
        text = found.special(key) if key in found.config else defaults.get(key)
        if text and text not in have:
            new.append(AddedToken(text, special=True, normalized=False))
            have.add(text)
    if new:
        tok.add_tokens(new)


def quiet_parallelism() -> None:
    """In a worker process of a parallel build: the processes are the parallelism, not each one's threads."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def unembedded(tok, ids, rows: int) -> str | None:
    """What is wrong where a token id falls past a model's `rows` embedded tokens, else None. A tokenizer may
    hold more tokens than the model embeds (gemma-3-1b's two image tokens past its 262,144), as transformers
    allows; such an id must be refused, since JAX's gather would read the last row in its place."""
    ids = np.asarray(ids).ravel()
    if not ids.size or (bad := int(ids.max())) < rows:
        return None
    inner = getattr(tok, "tok", None)
    name = inner.id_to_token(bad) if hasattr(inner, "id_to_token") else None
    return (f"token {bad}{f' ({name!r})' if name else ''} is past the model's {rows} embedded tokens (its tokenizer "
            f"has {tok.vocab_size}); the model cannot read it")
