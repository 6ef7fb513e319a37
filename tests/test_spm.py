"""shard.data.spm against transformers 5 itself: the same ids, offsets and decoded text as
`AutoTokenizer.from_pretrained(folder)` for real SentencePiece models with no tokenizer.json (and for small
models trained here that exercise what the real ones don't: Unigram, normalizer specs, user-defined pieces,
configs with unusual added tokens)."""

import io
import json
import random
import shutil
from pathlib import Path

import pytest

from shard.data import spm
from shard.errors import UserError

FIXTURES = Path(__file__).resolve().parents[2] / "shared/fixtures/hf"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"no reference tokenizer files at {FIXTURES}")

EDGES = ["", " ", "  ", " leading", "trailing  ", "\n", "\n\n", "a  b", "ça va? naïve 日本語 😀👍🏽", "<bos>hi",
         "<s> x", "<start_of_turn>user\nHi<end_of_turn>\n", "12345 3.14", "\t\tx\r\n  y", "a\u00a0b\u200dc",
         "<unk></s><eos><pad> <mask>", "👩\u200d💻 done.  \n"]


def document(size: int, seed: int = 0) -> str:
    """Varied text of about `size` characters: prose, indented code, runs of spaces, tabs and newlines,
    CRLF, accents, CJK, emoji with skin tones and zero-width joiners, NBSP."""
    rng = random.Random(seed)
    words = ("the of and to in model tokenizer shard training value returns naïve café über straße déjà "
             "日本語 中文 한국어 Ελληνικά русский 😀 👍🏽 👩\u200d💻 🇫🇷 don't it's 3.14 12345 1e-5").split()
    code = ["def f(x):\n    return x + 1\n", "\tif (a  ==  b) {\n\t\treturn;\n\t}\n",
            "for i in range(10):\n        print(i, end='  ')\n", "x\u00a0=\u00a0[1,\u00a02]\r\n", "  \n\n\n   \t \n"]
    parts, n = [], 0
    while n < size:
        kind = rng.random()
        if kind < 0.6:
            part = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) + rng.choice(".!?,;") + " "
        elif kind < 0.85:
            part = rng.choice(code)
        else:
            part = rng.choice([" " * rng.randint(2, 40), "\n" * rng.randint(1, 5), "\t" * rng.randint(1, 4),
                               "\r\n", "<s> ", "<bos>", "<start_of_turn>model\n", "<end_of_turn>"])
        parts.append(part)
        n += len(part)
    return "".join(parts)




def transformers_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def converted(folder: Path):
    config = folder / "tokenizer_config.json"
    return spm.to_tokenizers(folder / "tokenizer.model", json.loads(config.read_text()) if config.exists() else {})


def same_as_transformers(mine, ref, texts):
    """Each text's ids, offsets and decoding (with and without special tokens) are transformers'."""
    for text in texts:
        want = ref(text, add_special_tokens=False, return_offsets_mapping=True)
        got = mine.encode(text, add_special_tokens=False)
        assert got.ids == want.input_ids, f"ids differ for {text[:60]!r}"
        assert got.offsets == [tuple(o) for o in want.offset_mapping], f"offsets differ for {text[:60]!r}"
        for skip in (True, False):
            assert mine.decode(got.ids, skip_special_tokens=skip) == ref.decode(got.ids, skip_special_tokens=skip)


def same_added_tokens(mine, ref):
    assert mine.get_added_tokens_decoder() == ref._tokenizer.get_added_tokens_decoder()


def same_json(mine, ref):
    """The whole pipeline as transformers builds it (vocabulary, merges in order, normalizer, pre-tokenizer,
    decoder, added tokens), less the post-processor that BOS/EOS insertion is the caller's job for."""
    want = json.loads(ref._tokenizer.to_str())
    got = json.loads(mine.to_str())
    for key in ("post_processor", "truncation", "padding"):
        want.pop(key), got.pop(key)
    if ref.clean_up_tokenization_spaces and got["model"]["type"] == "Unigram":
        got["decoder"] = got["decoder"]["decoders"][0]  # transformers cleans up in Python, after this decoder
    assert got == want


# ----------------------------------------------------------------------------- real models

def llama2_folder(tmp: Path) -> Path:
    """Llama 2 with only its .model and config: transformers has to convert the .model."""
    folder = tmp / "llama-2-7b-hf"
    folder.mkdir()
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "llama-2-7b-hf" / name, folder / name)
    return folder


REAL = ["gemma-2b-it", "gemma-3-1b-it", "gemma-4-tokenizer", "mistral-7b-v0.1-tokenizer", "llama-2-7b-hf"]


@pytest.fixture(scope="module", params=REAL)
def real(request, tmp_path_factory):
    """(converted, transformers' tokenizer) for one real folder, built once for the module."""
    if not FIXTURES.is_dir():
        pytest.skip(f"no reference tokenizer files at {FIXTURES}")
    name = request.param
    folder = llama2_folder(tmp_path_factory.mktemp("llama")) if name.startswith("llama") else FIXTURES / name
    return converted(folder), transformers_tokenizer(folder)


@needs_fixtures
def test_real_models_encode_and_decode_as_transformers(real):
    mine, ref = real
    same_added_tokens(mine, ref)
    same_as_transformers(mine, ref, EDGES)  # a 430 KB document: tests/test_real_tokenizers.py, through the cache


@needs_fixtures
def test_real_models_pipeline_is_transformers(real):
    """Normalizer, pre-tokenizer, decoder and model options; vocabularies and merge order too where small
    (the long document above covers the 256k ones' merges)."""
    mine, ref = real
    if mine.get_vocab_size(with_added_tokens=False) < 100_000:
        same_json(mine, ref)
        return
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        have, want = getattr(mine, part), getattr(ref._tokenizer, part)
        assert (have and json.loads(have.__getstate__())) == (want and json.loads(want.__getstate__()))
    options = ("unk_token", "fuse_unk", "byte_fallback", "ignore_merges")
    assert {k: getattr(mine.model, k) for k in options} == {k: getattr(ref._tokenizer.model, k) for k in options}


@needs_fixtures
def test_special_tokens_are_split_out_with_character_offsets(real):
    mine, _ = real
    specials = [t.content for t in mine.get_added_tokens_decoder().values() if t.special]
    assert specials
    for content in specials[:10]:
        text = f"😀{content}naïve"
        got = mine.encode(text, add_special_tokens=False)
        assert got.tokens.count(content) == 1
        assert got.offsets[got.tokens.index(content)] == (1, 1 + len(content))  # the emoji is one character
        assert all(0 <= a <= b <= len(text) for a, b in got.offsets)
        assert content not in mine.decode(got.ids, skip_special_tokens=True)
        assert content in mine.decode(got.ids, skip_special_tokens=False)


# ----------------------------------------------------------------------------- configs and models made here

def trained(tmp: Path, **options) -> Path:
    """A small SentencePiece model trained on `document`, written as tmp/tokenizer.model."""
    import sentencepiece

    out = io.BytesIO()
    lines = [line for line in document(60_000, seed=1).splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=600, hard_vocab_limit=False,
        minloglevel=2, byte_fallback=True, user_defined_symbols=["<tool>", "```"], control_symbols=["<ctl>"],
        **options)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.model").write_bytes(out.getvalue())
    return tmp


def with_config(folder: Path, config: dict | None) -> Path:
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def added(content, special, **flags):
    return {"content": content, "special": special, "lstrip": False, "rstrip": False, "normalized": not special,
            "single_word": False, **flags}


# Added tokens that transformers handles in ways worth checking: a new token past the vocabulary, one
# renaming an existing piece, lstrip/rstrip, a normalized non-special one with a space in it
ADDED = {"5": added("<tool_call>", True), "32000": added("<|im_start|>", True, rstrip=True),
         "32001": added("<|im_end|>", True, lstrip=True), "32002": added("hello world", False)}
CASES = {
    "generic, config tokens": ("mistral", {"added_tokens_decoder": ADDED, "bos_token": "<s>"}),
    "generic, not legacy": ("mistral", {"legacy": False, "added_tokens_decoder": ADDED}),
    "llama, legacy": ("mistral", {"tokenizer_class": "LlamaTokenizerFast", "legacy": True,
                                  "added_tokens_decoder": ADDED}),
    "llama, legacy null": ("mistral", {"tokenizer_class": "LlamaTokenizer", "legacy": None}),
    "llama, no prefix space": ("mistral", {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False,
                                           "legacy": False}),
    "gemma class, model tokens": ("mistral", {"tokenizer_class": "GemmaTokenizer", "image_token": "<img>",
                                              "extra_special_tokens": {"boi_token": "<boi>"},
                                              "additional_special_tokens": ["<x>", "<s>"]}),
    "unigram, nfkc, dummy prefix": ("unigram", None),
    "unigram, config": ("unigram", {"extra_special_tokens": ["<tool>", "<new>"], "split_special_tokens": True,
                                    "clean_up_tokenization_spaces": True, "added_tokens_decoder": ADDED}),
    "unigram, PreTrainedTokenizerFast": ("unigram", {"tokenizer_class": "PreTrainedTokenizerFast", "legacy": False}),
    "unigram as llama": ("unigram", {"tokenizer_class": "LlamaTokenizer", "legacy": False}),
    "bpe, no dummy prefix, extra spaces kept": ("bpe", None),
    "bpe, extra spaces removed": ("bpe-strip", {"pad_token": None, "eos_token": {
        "__type": "AddedToken", "content": "</s>", "lstrip": False, "rstrip": False, "normalized": False,
        "single_word": False}}),
}
MODELS = {"unigram": {"model_type": "unigram"},
          "bpe": {"model_type": "bpe", "add_dummy_prefix": False, "remove_extra_whitespaces": False,
                  "normalization_rule_name": "identity"},
          "bpe-strip": {"model_type": "bpe", "remove_extra_whitespaces": True}}
SMALL_TEXTS = EDGES + [document(20_000, seed=2), "<tool>x```y<ctl> <|im_start|> hi <|im_end|>hello world.",
                       "  hello  world , it 's  ok ! <tool_call>", "ｆｕｌｌ ｗｉｄｔｈ ① ﬁ"]


@pytest.mark.parametrize("case", CASES)
def test_small_models_and_configs_match_transformers(case, tmp_path):
    model, config = CASES[case]
    if model == "mistral":
        if not FIXTURES.is_dir():
            pytest.skip(f"no reference tokenizer files at {FIXTURES}")
        shutil.copy(FIXTURES / "mistral-7b-v0.1-tokenizer/tokenizer.model", tmp_path / "tokenizer.model")
        folder = tmp_path
    else:
        folder = trained(tmp_path, **MODELS[model])
    folder = with_config(folder, config)
    mine, ref = converted(folder), transformers_tokenizer(folder)
    same_json(mine, ref)
    assert mine.encode_special_tokens == ref._tokenizer.encode_special_tokens
    same_as_transformers(mine, ref, SMALL_TEXTS)


def test_clean_up_on_decode_follows_the_config(tmp_path):
    folder = with_config(trained(tmp_path, model_type="unigram"), {"clean_up_tokenization_spaces": True})
    mine = converted(folder)
    ids = mine.encode("a , b .", add_special_tokens=False).ids
    assert mine.decode(ids) == "a, b."


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("content", [b"", b"not a model\x00\xff" * 10, None])
def test_unreadable_model_is_one_line_user_error(content, tmp_path):
    path = tmp_path / "tokenizer.model"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError) as error:
        spm.to_tokenizers(path, {})
    assert "tokenizer.model" in str(error.value) and "\n" not in str(error.value)


def test_unsupported_class_or_model_type_is_refused(tmp_path):
    folder = trained(tmp_path, model_type="unigram")
    with pytest.raises(UserError, match="T5Tokenizer"):
        spm.to_tokenizers(folder / "tokenizer.model", {"tokenizer_class": "T5Tokenizer"})
    word = trained(tmp_path / "word", model_type="word")
    with pytest.raises(UserError, match="model type"):
        spm.to_tokenizers(word / "tokenizer.model", {})
