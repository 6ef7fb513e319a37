"""An answer's text streamed token by token (tokenizer.stream) is what continuation decodes for the whole
answer, at a linear cost, on every tokenizer of ../shared/fixtures/hf that loads and on bytes; and the ids
that end an answer (end_ids, formats.end_of_turn_id) are the folder's."""

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from shard.data import formats, tokenizer as tokenizer_lib
from shard.errors import UserError

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf"
BYTE_LEVEL = ["qwen3-4b", "qwen2.5-0.5b-instruct", "gpt2", "olmo-2-tokenizer"]
SENTENCEPIECE = ["llama-2-7b-hf", "gemma-2b-it", "gemma-3-1b-it", "gemma-4-tokenizer", "mistral-7b-v0.1-tokenizer"]
TEXTS = ["héllo 日本語 🙂 naïve", "ça va? 👨‍👩‍👧 €100 — “quotes” 🧀", "  leading\n\ttab  x", "ᚠᛇᚻ 𝔘𝔫𝔦 한국어 עברית ∮",
         "plain words, numbers 3.14159 and\nlines"]
REPLACEMENT = "\ufffd"

_LOADED: dict = {}


def needs_fixtures() -> None:
    if not FIXTURES.is_dir():
        pytest.skip(f"{FIXTURES} is absent (a clone without ../shared): the real tokenizer files are not here")


def tokenizer(name: str):
    if name == "bytes":
        return tokenizer_lib.Bytes()
    needs_fixtures()
    if name not in _LOADED:
        _LOADED[name] = tokenizer_lib.load(str(FIXTURES / name))
    return _LOADED[name]


def single_bytes(tok) -> list[int]:
    """The ids that stand for one byte each: byte fallback's <0x..> tokens, a byte-level BPE's 256 letters."""
    if isinstance(tok, tokenizer_lib.Bytes):
        return list(range(256))
    from tokenizers.pre_tokenizers import ByteLevel

    names = [f"<0x{b:02X}>" for b in range(256)] + ByteLevel.alphabet()
    return sorted({i for n in names if (i := tok.tok.token_to_id(n)) is not None})


def special_ids(tok) -> list[int]:
    if isinstance(tok, tokenizer_lib.Bytes):
        return []
    return sorted(i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special)


class Ids:
    """Random id sequences that stress a streamed decode: the multi-byte characters' ids of encoded texts,
    cut anywhere and joined out of order, single bytes (stray and continuation bytes), any id (unknown ones
    above the vocabulary), special ids."""

    def __init__(self, tok, seed: int):
        self.rng = random.Random(seed)
        self.pieces = [tok.encode(t, special=False) for t in TEXTS]
        self.bytes = single_bytes(tok)
        self.special = special_ids(tok)
        self.vocab = tok.vocab_size

    def __call__(self, n: int) -> list[int]:
        out, rng = [], self.rng
        while len(out) < n:
            pick = rng.random()
            if pick < 0.45:
                piece = rng.choice(self.pieces)
                start = rng.randrange(len(piece))
                out += piece[start:rng.randrange(start, len(piece) + 1)]
            elif pick < 0.75:
                out += rng.choices(self.bytes, k=rng.randint(1, 4))
            elif pick < 0.9:
                out.append(rng.randrange(self.vocab + 64))
            elif self.special:
                out.append(rng.choice(self.special))
        return out[:n]


def streamed(tok, prompt, ids) -> list[str]:
    stream = tok.stream(prompt)
    return [stream.add(i) for i in ids] + [stream.flush()]


@pytest.mark.parametrize("name", ["bytes", *BYTE_LEVEL, *SENTENCEPIECE])
def test_a_streamed_answer_is_its_continuation_for_any_ids(name):
    tok = tokenizer(name)
    draw = Ids(tok, seed=len(name))
    prompts = [tok.prompt(t) for t in TEXTS]
    for trial in range(600):
        prompt = draw(draw.rng.randrange(8)) if trial % 3 else draw.rng.choice(prompts)
        ids = draw(draw.rng.randrange(1, 40))
        pieces = streamed(tok, prompt, ids)
        whole = tok.continuation(prompt, ids)
        assert "".join(pieces) == whole, (name, prompt, ids, pieces)
        if REPLACEMENT not in whole:  # never half a character
            assert not any(REPLACEMENT in p for p in pieces), (name, prompt, ids, pieces)


@pytest.mark.parametrize("name", ["bytes", *BYTE_LEVEL, *SENTENCEPIECE])
def test_an_answer_streams_as_written_with_its_leading_space(name):
    tok = tokenizer(name)
    for prompt, answer in [("Cheese in French:", " fromage 🧀, naïve café"), ("Q: 2+2?\nA:", " 4 — 日本語 🙂\n")]:
        whole, before = tok.prompt(prompt + answer), tok.prompt(prompt)
        assert whole[:len(before)] == before
        pieces = streamed(tok, before, whole[len(before):])
        assert "".join(pieces) == answer and pieces[0].startswith(" ") and not any(REPLACEMENT in p for p in pieces)


def decoded_ids(tok, monkeypatch, prompt, ids) -> int:
    """How many ids a streamed answer passes to the tokenizer's decode in all."""
    count, decode = [0], tok.decode

    def counted(xs):
        count[0] += len(xs)
        return decode(xs)

    monkeypatch.setattr(tok, "decode", counted)
    assert "".join(streamed(tok, prompt, ids)) == tok.continuation(prompt, ids)
    monkeypatch.undo()
    return count[0]


@pytest.mark.parametrize("name", ["bytes", "qwen3-4b", "gpt2", "llama-2-7b-hf", "gemma-3-1b-it"])
def test_streaming_decodes_a_bounded_window_per_token(name, monkeypatch):
    """2,000 tokens of text, of random single bytes (never valid UTF-8 for long), of stray continuation bytes
    and of special ids: each add decodes a few ids, not the answer so far."""
    tok, n = tokenizer(name), 2000
    rng = random.Random(0)
    text = "".join(TEXTS) * 200
    stray = [tok.tok.token_to_id(f"<0x{b:02X}>") for b in range(0x80, 0xC0)] if name in SENTENCEPIECE else \
        [i for i in single_bytes(tok) if tok.decode([i]) == REPLACEMENT]
    answers = {"text": tok.encode(text, special=False)[:n], "bytes": rng.choices(single_bytes(tok), k=n),
               "stray": rng.choices(stray, k=n), "special": rng.choices(special_ids(tok) or [0], k=n)}
    for kind, ids in answers.items():
        assert len(ids) == n
        assert decoded_ids(tok, monkeypatch, tok.prompt("Hello"), ids) <= 6 * n, kind


# ----------------------------------------------------------------------------- the ids that end an answer

@pytest.mark.parametrize("name, ends", [("qwen3-4b", {151645, 151643}), ("gemma-3-1b-it", {1, 106}),
                                        ("gemma-2b-it", {1}), ("llama-2-7b-hf", {2}), ("gpt2", {50256}),
                                        ("bytes", set())])
def test_end_ids_are_eos_and_the_generation_configs(name, ends):
    tok = tokenizer(name)
    assert tok.end_ids == ends and (tok.eos is None or tok.eos in ends)
    if (FIXTURES / name / "generation_config.json").is_file():
        listed = json.loads((FIXTURES / name / "generation_config.json").read_text())["eos_token_id"]
        assert set(listed if isinstance(listed, list) else [listed]) <= ends


def folder_of(tmp_path: Path, files: dict, name: str = "tok") -> Path:
    """A folder holding fixture files: {file name: fixture folder}."""
    needs_fixtures()
    folder = tmp_path / name
    folder.mkdir()
    for file, source in files.items():
        shutil.copy(FIXTURES / source / file, folder / file)
    return folder


def test_generation_config_ids_outside_the_vocabulary_are_left_out_and_a_bad_file_is_one_line(tmp_path):
    folder = folder_of(tmp_path, {"vocab.json": "gpt2", "merges.txt": "gpt2"})
    listed = [198, 50257, -1, 1 << 40, "x", None, [2], {}]  # a newline's id, then none that is one
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
    assert tokenizer_lib.load(str(folder)).end_ids == {50256, 198}
    (folder / "generation_config.json").write_text('{"eos_token_id": [1,')
    with pytest.raises(UserError, match="generation_config.json is not readable JSON") as e:
        tokenizer_lib.load(str(folder))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("files, token", [
    ("qwen3-4b", "<|im_end|>"), ("gemma-2b-it", "<end_of_turn>"), ("gemma-3-1b-it", "<end_of_turn>"),
    ({"tokenizer.json": "qwen3-4b", "chat_template.jinja": "smollm3-3b"}, "<|im_end|>"),
    # Llama 3's and DeepSeek-R1's configs (their added tokens, their templates) over Qwen3's vocabulary: their own
    # tokenizer.json files are not among the fixtures
    ({"tokenizer.json": "qwen3-4b", "tokenizer_config.json": "llama-3.2-3b-instruct"}, "<|eot_id|>"),
    ({"tokenizer.json": "qwen3-4b", "tokenizer_config.json": "deepseek-r1-distill-qwen-32b"}, "<｜end▁of▁sentence｜>"),
    ("llama-2-7b-hf", None), ("gpt2", None), ("bytes", None),  # no template
])
def test_the_templates_end_of_turn_is_one_added_token(files, token, tmp_path):
    tok = tokenizer(files) if isinstance(files, str) else tokenizer_lib.load(str(folder_of(tmp_path, files)))
    want = None if token is None else tok.tok.token_to_id(token)
    assert formats.end_of_turn_id(tok) == want and (token is None or want is not None)


def test_a_run_keeps_the_generation_config_and_the_tokenizers_identity(tmp_path):
    """The run's copy stops where the original does; generation_config.json changes no token, so neither the
    identity that names token caches (the value below: before the file was read at all)."""
    tok = tokenizer("qwen3-4b")
    run = tmp_path / "run"
    run.mkdir()
    data = SimpleNamespace(name="documents", tokenizer=str(FIXTURES / "qwen3-4b"))
    tokenizer_lib.keep(data, run)
    kept = run / tokenizer_lib.RUN_FOLDER
    source = FIXTURES / "qwen3-4b" / "generation_config.json"
    assert (kept / "generation_config.json").read_bytes() == source.read_bytes()
    again = tokenizer_lib.of_run(data, run)
    assert again.found.main.parent == kept and again.end_ids == tok.end_ids == {151645, 151643}
    without = folder_of(tmp_path, {"tokenizer.json": "qwen3-4b", "tokenizer_config.json": "qwen3-4b"})
    assert tok.identity() == again.identity() == tokenizer_lib.load(str(without)).identity()
    assert tok.identity() == "huggingface:eb47ee78b25a8ea9"
