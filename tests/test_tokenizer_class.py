"""The tokenizer class transformers 5's AutoTokenizer builds a folder with depends on config.json's model_type for
some families (shard/data/auto_class.py): real tokenizer files (../shared/fixtures/hf) beside a config.json encode as
AutoTokenizer reads that folder. (Phi-3's own folder, chat template included: tests/test_real_tokenizers.py.)"""

import json
import shutil
from pathlib import Path

import pytest

from shard.data import auto_class, pipelines, tokenizer as tokenizer_lib

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf"
transformers = pytest.importorskip("transformers")

# name: (tokenizer files and where from, tokenizer_config.json changes, config.json, the class transformers builds)
LLAMA2 = {"tokenizer.json": "llama-2-7b-hf", "tokenizer_config.json": "llama-2-7b-hf"}
QWEN3 = {"tokenizer.json": "qwen3-4b", "tokenizer_config.json": "qwen3-4b"}
CASES = {
    "mistral says LlamaTokenizer": (LLAMA2, {}, {"model_type": "mistral"}, "TokenizersBackend"),
    "internlm2, a type of remote code": (LLAMA2, {}, {"model_type": "internlm2"}, "TokenizersBackend"),
    "phi3 with its own tokenizer code": (LLAMA2, {"auto_map": {"AutoTokenizer": ["t.T", None]}},
                                         {"model_type": "phi3"}, "LlamaTokenizer"),
    "phi3 with a SentencePiece model alone": ({"tokenizer.model": "llama-2-7b-hf",
                                               "tokenizer_config.json": "llama-2-7b-hf"}, {}, {"model_type": "phi3"},
                                              "TokenizersBackend"),
    # (Qwen3's tokenizer.json is Qwen2Tokenizer's pipeline; Qwen3.5's keeps combining marks with their letters)
    "qwen3_5 says LlamaTokenizer over byte-level": ({"tokenizer.json": "qwen3-4b",
                                                     "tokenizer_config.json": "deepseek-r1-distill-qwen-32b"}, {},
                                                    {"model_type": "qwen3_5"}, "Qwen3_5Tokenizer"),
    "qwen3_5 says Qwen2Tokenizer": (QWEN3, {}, {"model_type": "qwen3_5"}, "Qwen3_5Tokenizer"),
    "qwen3_5_text names no class": (QWEN3, {"tokenizer_class": None}, {"model_type": "qwen3_5_text"},
                                    "Qwen3_5Tokenizer"),
}
TEXTS = ["  héllo", "naïve e\u0301 नमस्ते มีที่นี่ مُحَمَّد", "\tTab\n\n  indented", " leading", "trailing  ",
         "a  b\r\nc", "don't  stop 😀👍🏽", "<s> literal </s>"]


def folder_of(tmp_path: Path, files: dict, changes: dict, config: dict | None) -> Path:
    folder = tmp_path / ("with-config" if config is not None else "without")
    folder.mkdir()
    for name, source in files.items():
        shutil.copy(FIXTURES / source / name, folder / name)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.update(changes)
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"{FIXTURES} is absent: the real tokenizer files are not here")
@pytest.mark.parametrize("case", CASES)
def test_config_jsons_model_type_picks_the_class_as_in_transformers(case, tmp_path):
    files, changes, config, cls = CASES[case]
    folder = folder_of(tmp_path, files, changes, config)
    ref, tok = transformers.AutoTokenizer.from_pretrained(str(folder)), tokenizer_lib.load(str(folder))
    assert type(ref).__name__ == cls  # the branch of transformers' rule this case stands for
    for text in TEXTS:
        assert tok.encode(text) == ref(text).input_ids, (case, text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref(text).input_ids, skip_special_tokens=True), (case, text)
    if cls != "LlamaTokenizer":  # the same files without config.json: another class, other tokens
        alone = tokenizer_lib.load(str(folder_of(tmp_path, files, changes, None)))
        assert any(alone.encode(t) != tok.encode(t) for t in TEXTS) and alone.identity() != tok.identity()


def test_the_model_types_are_transformers_own():
    """The lists in shard/data/auto_class.py are the installed transformers' (update them with it)."""
    from transformers.models.auto import tokenization_auto as theirs

    if not hasattr(theirs, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS"):
        pytest.skip(f"transformers {transformers.__version__} has no such list (transformers 5 has)")
    assert auto_class.HUB_CLASS_WRONG == set(theirs.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
    kept = {*pipelines.CLASSES, auto_class.GENERIC}
    registered = {kind: (cls or "").removesuffix("Fast") for kind, cls in theirs.TOKENIZER_MAPPING_NAMES.items()}
    assert {k: c for k, c in auto_class.REGISTERED.items() if c in kept} == \
        {k: c for k, c in registered.items() if c in kept}
    assert all(registered[k] == c for k, c in auto_class.REGISTERED.items())
