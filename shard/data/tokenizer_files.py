"""Where a tokenizer's files are, and what its tokenizer_config.json says: the one place either is read.

`find(spec)` takes what a user names (`data.tokenizer`, a Hugging Face folder, a run folder's copy) and
returns the files one tokenizer is built from, in transformers' order of preference:

    tokenizer.json                  the `tokenizers` library's own file
    tokenizer.model (or one .model) a SentencePiece model, converted as transformers converts it
    vocab.json + merges.txt         a byte-level BPE's two files (GPT-2, Qwen2)

with tokenizer_config.json (special tokens, add_bos_token/add_eos_token, the tokenizer class, the chat
template) and chat_template.jinja / chat_template.json (newer folders keep the template apart) beside them,
a model folder's generation_config.json (the ids that end a generated answer), and what its config.json says
of the tokenizer (`model_type` picks transformers' tokenizer class for some families: shard/data/auto_class.py).
A folder with none of the first three is refused in one line naming what was looked for: text is never
read with another vocabulary by default.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from shard.data.auto_class import MODEL_KEYS
from shard.errors import UserError

BYTES = "bytes"
LOOKED_FOR = "tokenizer.json, tokenizer.model (SentencePiece), vocab.json with merges.txt"
TIKTOKEN_HINT = ("original/tokenizer.model is a tiktoken file, which is not read here (nor by AutoTokenizer): add the "
                 "model's tokenizer.json, as its Hub repository has it")
GENERATION = "generation_config.json"
MODEL_CONFIG = "config.json"
# transformers' order
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass
class Found:
    """One tokenizer's files: `kind` is json, sentencepiece or bpe (vocab.json + merges.txt)."""
    kind: str
    main: Path                   # tokenizer.json, the .model, or vocab.json
    config: dict = field(default_factory=dict)  # tokenizer_config.json ({} where there is none)
    chat_template: str | None = None
    extra: dict[str, Path] = field(default_factory=dict)  # merges.txt, tokenizer_config.json, chat_template.*
    generation: dict = field(default_factory=dict)  # generation_config.json ({} where there is none)
    generation_file: Path | None = None
    model: dict = field(default_factory=dict)  # config.json's MODEL_KEYS ({} where there is none)

    def files(self) -> dict[str, bytes]:
        """name -> content of every file the text's tokens depend on (the tokenizer's identity hashes them), the
        main one under the name `find` looks for first."""
        main = {"json": "tokenizer.json", "sentencepiece": "tokenizer.model", "bpe": "vocab.json"}[self.kind]
        return {main: self.main.read_bytes(), **{p.name: p.read_bytes() for p in self.extra.values()}}

    def kept(self) -> dict[str, bytes]:
        """What a run folder keeps a copy of: the files, generation_config.json (where generation stops), and
        config.json's MODEL_KEYS alone (the class they pick is in the identity only where they change it)."""
        extra = {GENERATION: self.generation_file.read_bytes()} if self.generation_file else {}
        if self.model:
            extra[MODEL_CONFIG] = json.dumps(self.model, sort_keys=True).encode()
        return {**self.files(), **extra}

    def special(self, key: str) -> str | None:
        """A named special token's text (bos_token, ...), written as a string or as {"content": ...}."""
        value = self.config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else None

    def flag(self, key: str) -> bool | None:
        """add_bos_token / add_eos_token where the config sets them, else None."""
        value = self.config.get(key)
        return value if isinstance(value, bool) else None


def present(folder: Path) -> bool:
    """Whether `folder` holds a tokenizer `find` would read."""
    return (folder / "tokenizer.json").is_file() or any(folder.glob("*.model")) or \
        ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())


def find(spec: str, key: str = "data.tokenizer") -> Found:
    """The tokenizer `spec` names: a tokenizer.json, a .model, a vocab.json, or a folder holding one."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"{key}={spec!r} does not exist; give bytes, a tokenizer.json, a SentencePiece .model, or a "
                        f"folder holding {LOOKED_FOR}")
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        main = _main_file(folder, key, spec)
    else:
        main = path
    kind = {".json": "json", ".model": "sentencepiece"}.get(main.suffix)
    if main.name == "vocab.json":
        kind = "bpe"
    if kind is None:
        raise UserError(f"{key}={spec!r} is none of {LOOKED_FOR}")
    extra = {}
    if kind == "bpe":
        if not (folder / "merges.txt").is_file():
            raise UserError(f"{key}={spec!r}: vocab.json without merges.txt beside it (a byte-level BPE needs both)")
        extra["merges"] = folder / "merges.txt"
    config = _read_config(folder / "tokenizer_config.json", key, spec)
    if config is not None:
        extra["config"] = folder / "tokenizer_config.json"
    template = _template(folder, config or {}, extra, key, spec)
    generation = _read_config(folder / GENERATION, key, spec)
    model = _read_config(folder / MODEL_CONFIG, key, spec) or {}
    model = {k: model[k] for k in MODEL_KEYS if isinstance(model.get(k), str)}
    return Found(kind, main, config or {}, template, extra, generation or {},
                 None if generation is None else folder / GENERATION, model)


def _main_file(folder: Path, key: str, spec: str) -> Path:
    if (folder / "tokenizer.json").is_file():
        return folder / "tokenizer.json"
    models = sorted(folder.glob("*.model"))
    if (folder / "tokenizer.model").is_file():
        return folder / "tokenizer.model"
    if len(models) == 1:
        return models[0]
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return folder / "vocab.json"
    hint = f"; {TIKTOKEN_HINT}" if (folder / "original" / "tokenizer.model").is_file() else ""
    several = f" (several .model files: name one)" if len(models) > 1 else ""
    give = "give one with data.tokenizer=PATH" if key in ("data.tokenizer", "train.init_from") else \
        "put the model's tokenizer files in the folder"
    raise UserError(f"{key}={spec!r}: no tokenizer in the folder{several}; looked for {LOOKED_FOR}{hint}; {give}")


def _read_config(path: Path, key: str, spec: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{key}={spec!r}: {path.name} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{key}={spec!r}: {path.name} holds a JSON {type(config).__name__}, not an object")
    return config


def _template(folder: Path, config: dict, extra: dict, key: str, spec: str) -> str | None:
    """The chat template: chat_template.jinja, else chat_template.json's, else tokenizer_config.json's (as
    transformers prefers them); of several named templates, the one named default."""
    if (folder / "chat_template.jinja").is_file():
        extra["template"] = folder / "chat_template.jinja"
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    source = config.get("chat_template")
    if (folder / "chat_template.json").is_file():
        extra["template"] = folder / "chat_template.json"
        source = (_read_config(folder / "chat_template.json", key, spec) or {}).get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    return source if isinstance(source, str) else None
