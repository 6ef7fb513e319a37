"""A Hugging Face export carries tokenizer files that transformers' AutoTokenizer loads as they are (what
lm-evaluation-harness's `hf` model does with the folder), giving the ids the run trained on, for each kind of
tokenizer a run reads (tests/tiny_tokenizers.py) and each family the exporter writes."""

import json

import pytest

from shard.data import tokenizer as tokenizer_lib
from shard.errors import UserError

import tiny_tokenizers

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = tmp_path_factory.mktemp("tokenizers")
    return {kind: tiny_tokenizers.make(kind, made / kind) for kind in tiny_tokenizers.KINDS}


@pytest.mark.parametrize("kind", tiny_tokenizers.KINDS)
def test_an_export_loads_in_autotokenizer_as_it_is_with_the_runs_ids(kind, sources, tmp_path):
    """vocab.json + merges.txt without a tokenizer_config.json (GPT-2's files) was exported as it was, and
    AutoTokenizer, told nothing of its class, could not build it: the export names the class the run read it with."""
    from shard import load_tokenizer
    from shard.use import export

    run, out = tiny_tokenizers.trained(sources[kind], tmp_path), tmp_path / "hf"
    assert export.main([str(run), "--format", "hf", "--out", str(out)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    source, ours = tiny_tokenizers.reference(kind, sources[kind]), load_tokenizer(str(run))
    for text in tiny_tokenizers.TEXTS:
        assert exported(text).input_ids == ours.encode(text) == source(text).input_ids, text
    assert exported.eos_token_id == ours.eos


@pytest.mark.parametrize("kind", tiny_tokenizers.KINDS)
def test_every_family_the_exporter_writes_carries_a_tokenizer_autotokenizer_reads_as_the_run(kind, sources, tmp_path):
    """The run's tokenizer files as a folder of each model_type holds them, beside its config.json: AutoTokenizer's
    ids are the run's (olmoe's registered class, GPTNeoXTokenizer, rebuilt a .model's pieces as byte-level BPE), or
    the export is refused in one line (qwen2 and qwen3_5_moe_text, whose registered classes rebuild any tokenizer as
    Qwen2's and Qwen3.5's)."""
    from shard.hf import arch, write

    ours, refused = tokenizer_lib.load(str(sources[kind])), set()
    for model_type in arch.SUPPORTED:
        config = {"model_type": model_type}
        try:
            files = write._tokenizer_files(sources[kind], config)
        except UserError as e:
            assert len(str(e).splitlines()) == 1 and f"model_type {model_type}" in str(e)
            refused.add(model_type)
            continue
        folder = tmp_path / model_type
        folder.mkdir()
        for name, content in files.items():
            (folder / name).write_bytes(content)
        (folder / "config.json").write_text(json.dumps(config))
        exported = transformers.AutoTokenizer.from_pretrained(str(folder))
        for text in tiny_tokenizers.TEXTS:
            assert exported(text).input_ids == ours.encode(text), (model_type, text)
    assert refused == {"qwen2", "qwen3_5_moe_text"}
