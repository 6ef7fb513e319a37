"""The tokenizers users bring (../shared/fixtures/hf: real files, byte for byte as published) encode as
transformers' AutoTokenizer does, through the corpus cache, fine-tuning rows, chats and the server's prompts."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shard.data import formats, token_cache, tokenizer as tokenizer_lib
from shard.errors import UserError
from shard.server import chat

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures" / "hf"
if not FIXTURES.is_dir():
    pytest.skip(f"{FIXTURES} is absent (a clone without ../shared): the real tokenizer files are not here",
                allow_module_level=True)
transformers = pytest.importorskip("transformers")

# name -> how transformers reads it (the reference). Folders AutoTokenizer cannot read alone are read with the
# class their files are for (gpt2: vocab.json + merges.txt and no config).
TOKENIZERS = ["llama-2-7b-hf", "llama-2-spm-only", "gemma-2b-it", "gemma-3-1b-it", "gemma-4-tokenizer",
              "mistral-7b-v0.1-tokenizer", "gpt2", "olmo-2-tokenizer", "qwen2.5-0.5b-instruct", "qwen3-4b",
              "qwen3-truncating", "deepseek-r1-on-qwen3", "phi3", "phi3-as-llama"]
WITH_TEMPLATE = ["gemma-2b-it", "gemma-3-1b-it", "qwen2.5-0.5b-instruct", "qwen3-4b", "deepseek-r1-on-qwen3", "phi3",
                 "phi3-as-llama"]
EDGES = ["", " ", "  ", " leading", "trailing  ", "\n", "\n\n", "a  b", "tab\there", "x\r\ny", "ça va? naïve café",
         "日本語のテキスト", "😀👍🏽 👨‍👩‍👧", "a\u00a0b", "e\u0301", "12345 3.14159", "<s> literal", "<bos>hi",
         "<|im_start|>user\nHi<|im_end|>\n", "don't  stop\n\n  indented"]
PAIRS = [("Cheese in French:", " fromage"), ("Q: 2+2?\nA:", " 4"), ("Translate: pain →", " bread 🍞"),
         ("Say it twice:", "  ok ok\n")]
CHATS = [[{"role": "user", "content": "How do you say bread in French?"},
          {"role": "assistant", "content": "pain"}],
         [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello 👋 — how can I help?"},
          {"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1, 2, 3."}],
         [{"role": "system", "content": "Think first."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
          {"role": "user", "content": "And 2+3?"}, {"role": "assistant", "content": "5"}]]


def chats_for(name: str) -> list:
    return CHATS if name != "gemma-2b-it" else CHATS[:2]  # Gemma 1's template refuses a system message


def long_document() -> str:
    """Several hundred KB of prose, code, whitespace runs and unicode."""
    parts = [(ROOT / "README.md").read_text(), (ROOT / "train.py").read_text(), "\t\tindent\r\n" * 50,
             ("naïve café déjà vu — “quotes” ‘single’ 日本語 中文 한국어 Ελληνικά עברית العربية "
              "😀👍🏽👨‍👩‍👧 \u00a0\u200b\n") * 40]
    return "".join(parts) * 20  # about 430 KB


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> the folder (or file) the user names; some are copies of a fixture's files in another shape."""
    made = tmp_path_factory.mktemp("tokenizers")
    out = {name: FIXTURES / name for name in TOKENIZERS if (FIXTURES / name).is_dir()}
    out["llama-2-spm-only"] = made / "llama-2-spm-only"  # SentencePiece converted, as without tokenizer.json
    out["llama-2-spm-only"].mkdir()
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "llama-2-7b-hf" / name, out["llama-2-spm-only"] / name)
    out["qwen3-truncating"] = made / "qwen3-truncating"  # many real tokenizer.json files set truncation
    out["qwen3-truncating"].mkdir()
    spec = json.loads((FIXTURES / "qwen3-4b" / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4096, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 8192}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 151643, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (out["qwen3-truncating"] / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(FIXTURES / "qwen3-4b" / "tokenizer_config.json", out["qwen3-truncating"])
    # DeepSeek-R1-Distill-Qwen's config (LlamaTokenizerFast, add_bos_token) over a byte-level tokenizer.json (its
    # own, 7 MB, is not among the files; it is Qwen's vocabulary): transformers keeps the file's pipeline
    out["deepseek-r1-on-qwen3"] = made / "deepseek-r1-on-qwen3"
    out["deepseek-r1-on-qwen3"].mkdir()
    shutil.copy(FIXTURES / "qwen3-4b" / "tokenizer.json", out["deepseek-r1-on-qwen3"])
    shutil.copy(FIXTURES / "deepseek-r1-distill-qwen-32b" / "tokenizer_config.json", out["deepseek-r1-on-qwen3"])
    # Phi-3-mini's tokenizer (not among the files): its config says LlamaTokenizer, but transformers reads a phi3
    # model's tokenizer.json as written; the same files with model_type llama get LlamaTokenizer's pipeline
    out["phi3"], out["phi3-as-llama"] = phi3_folder(made / "phi3", "phi3"), phi3_folder(made / "phi3-llama", "llama")
    return out


PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
PHI3_TEMPLATE = (  # as Phi-3-mini-4k-instruct's tokenizer_config.json has it
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
    "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")


def phi3_folder(out: Path, model_type: str) -> Path:
    """Phi-3-mini-4k-instruct's tokenizer files, rebuilt: Llama 2's tokenizer.json with Phi-3's added tokens (ids
    32000-32010; </s> and all but <|endoftext|> eat the whitespace after them), a tokenizer_config.json like
    Phi-3's (LlamaTokenizer, add_bos_token false, its chat template), and a config.json."""
    out.mkdir()
    spec = json.loads((FIXTURES / "llama-2-7b-hf" / "tokenizer.json").read_text())

    def added(i, text, rstrip, special):
        return {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": rstrip,
                "normalized": False, "special": special}
    spec["added_tokens"][2] = added(2, "</s>", True, False)
    spec["added_tokens"] += [added(32000 + i, t, i > 0, True) for i, t in enumerate(PHI3_ADDED)]
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": "<s>", "chat_template": PHI3_TEMPLATE,
              "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                       for t in spec["added_tokens"]},
              "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "legacy": False,
              "model_max_length": 4096, "pad_token": "<|endoftext|>", "padding_side": "left",
              "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "config.json").write_text(json.dumps({"architectures": ["Phi3ForCausalLM"], "model_type": model_type,
                                                 "vocab_size": 32064, "hidden_size": 3072}))
    return out


_THEIRS: dict = {}


def theirs(name, folders):
    if name not in _THEIRS:
        if name == "gpt2":
            _THEIRS[name] = transformers.GPT2Tokenizer.from_pretrained(str(folders[name]))
        else:
            _THEIRS[name] = transformers.AutoTokenizer.from_pretrained(str(folders[name]))
    return _THEIRS[name]


_OURS: dict = {}


def ours(name, folders):
    if name not in _OURS:
        _OURS[name] = tokenizer_lib.load(str(folders[name]))
    return _OURS[name]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_texts_encode_and_decode_as_transformers(name, folders):
    ref, tok = theirs(name, folders), ours(name, folders)
    for text in EDGES:
        assert tok.encode(text) == ref(text).input_ids, (name, text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref(text).input_ids, skip_special_tokens=True), (name, text)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_corpus_caches_each_document_as_transformers_encodes_it_whole(name, folders, tmp_path):
    ref, tok = theirs(name, folders), ours(name, folders)
    docs = [long_document(), *[t for t in EDGES if t]]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cache = token_cache.load([corpus], "text", str(folders[name]), tmp_path / "cache")
    assert cache.documents == len(docs) and cache.mask is None
    for i, doc in enumerate(docs):
        want = ref(doc).input_ids
        got = cache.tokens[cache.doc_starts[i]:cache.doc_starts[i + 1]].tolist()
        if tok.eos is not None and (not want or want[-1] != tok.eos):
            assert got[-1] == tok.eos  # the separator between documents
            got = got[:-1]
        assert got == want, (name, i, len(got), len(want))
        counts = cache.token_bytes[cache.doc_starts[i]:cache.doc_starts[i + 1]]
        assert counts.sum() == len(doc.encode("utf-8")) + (tok.eos is not None and want[-1:] != [tok.eos])
    assert len(ref(docs[0]).input_ids) > 90_000  # nothing truncated, whatever tokenizer.json says


def _row(cache, i):
    lo, hi = cache.doc_starts[i], cache.doc_starts[i + 1]
    return cache.tokens[lo:hi].tolist(), cache.mask[lo:hi].tolist()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_prompt_completion_rows_are_the_whole_texts_tokens_with_the_completion_trained(name, folders, tmp_path):
    ref, tok = theirs(name, folders), ours(name, folders)
    corpus = tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS))
    cache = token_cache.load([corpus], ("prompt", "completion"), str(folders[name]), tmp_path / "cache")
    for i, (p, c) in enumerate(PAIRS):
        enc = ref(p + c, return_offsets_mapping=True)
        tokens, mask = _row(cache, i)
        n = len(enc.input_ids)
        assert tokens[:n] == enc.input_ids, (name, p, c)
        # trained: every token with a character of the completion (one that straddles the boundary included)
        specials = set(ref.all_special_ids)
        want = [int(e > len(p) or (s == e and t in specials and s >= len(p) + len(c)))
                for t, (s, e) in zip(enc.input_ids, enc.offset_mapping)]
        assert mask[:n] == want, (name, p, c)
        assert all(mask[n:])  # the separator ends the answer: trained
        prompt = tok.prompt(p)  # what generate and the server feed for this prompt
        assert tokens[:len(prompt)] == prompt


@pytest.mark.parametrize("name", WITH_TEMPLATE)
def test_chat_rows_are_the_templates_tokens_with_the_assistant_trained(name, folders, tmp_path):
    ref, tok = theirs(name, folders), ours(name, folders)
    chats = chats_for(name)
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    cache = token_cache.load([corpus], "messages", str(folders[name]), tmp_path / "cache")
    for i, messages in enumerate(chats):
        want = ref.apply_chat_template(messages, tokenize=True, return_dict=False)
        tokens, mask = _row(cache, i)
        assert tokens[:len(want)] == want, name
        trained = ref.decode([t for t, m in zip(tokens, mask) if m])
        rest = ref.decode([t for t, m in zip(tokens, mask) if not m])
        closing = end_of_turn(ref)
        for m in messages:  # (a reasoning template keeps an earlier answer's reasoning out of the text)
            shown = m["content"].split("</think>")[-1].strip()
            if m["role"] == "assistant":  # with the end of its turn: the model learns to close every turn
                assert shown + closing in trained, (name, m, closing)
            else:
                assert shown in rest and shown not in trained, (name, m)
        if name == "qwen3-4b" and i == 1:  # its template rewrites earlier turns once later ones follow
            assert trained == ("Hello 👋 — how can I help?<|im_end|>\n<think>\n\n</think>\n\n1, 2, 3.<|im_end|>\n"
                               "<|im_end|>")
        # the server's prompt for the conversation before the last answer starts the training row
        prompt = chat.Template(tok)(messages[:-1])
        assert prompt == ref.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
        assert tokens[:len(prompt)] == prompt


def end_of_turn(ref) -> str:
    """What transformers' rendering of the template writes after an assistant's content (its end of turn): the
    tokens after a last turn's and after one followed by another share (Phi-3 adds EOS after the last alone),
    decoded (an added token may eat the whitespace after it: Phi-3's <|end|>)."""
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "@@"}, {"role": "user", "content": "y"},
             {"role": "assistant", "content": "z"}]
    shown = (ref.apply_chat_template(turns[:n], tokenize=False) for n in (2, 4))
    last, more = (ref(t[t.index("@@") + 2:], add_special_tokens=False).input_ids for t in shown)
    shared = next((i for i, (a, b) in enumerate(zip(last, more)) if a != b), len(last))
    return ref.decode(last[:shared])


def test_a_templates_generation_blocks_are_what_is_trained(folders, tmp_path):
    """SmolLM3's template marks the assistant's text with {% generation %}: the mask is transformers'
    assistant mask (here over Qwen3's tokenizer: SmolLM3's own tokenizer.json is not among the files)."""
    folder = tmp_path / "marked"
    folder.mkdir()
    shutil.copy(FIXTURES / "qwen3-4b" / "tokenizer.json", folder)
    shutil.copy(FIXTURES / "smollm3-3b" / "chat_template.jinja", folder)
    config = json.loads((FIXTURES / "qwen3-4b" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    cache = token_cache.load([corpus], "messages", str(folder), tmp_path / "cache")
    for i, messages in enumerate(CHATS):
        want = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        tokens, mask = _row(cache, i)
        n = len(want["input_ids"])
        assert tokens[:n] == want["input_ids"] and mask[:n] == want["assistant_masks"] and sum(mask) > 0


def test_a_runs_copy_of_a_phi3_folder_keeps_what_picks_its_class(folders, tmp_path):
    """config.json's model_type changes a Phi-3 folder's tokens: the run's copy keeps it (the copy encodes as the
    folder does, in transformers too), and the identity that names token caches tells the two readings apart."""
    from types import SimpleNamespace

    data = SimpleNamespace(name="documents", tokenizer=str(folders["phi3"]))
    tokenizer_lib.keep(data, tmp_path)
    again, kept = tokenizer_lib.of_run(data, tmp_path), tmp_path / tokenizer_lib.RUN_FOLDER
    text = "  héllo\n\tworld"
    want = theirs("phi3", folders)(text).input_ids
    assert again.found.main.parent == kept and again.encode(text) == want
    assert transformers.AutoTokenizer.from_pretrained(str(kept))(text).input_ids == want
    assert want != theirs("phi3-as-llama", folders)(text).input_ids
    assert again.identity() == ours("phi3", folders).identity() != ours("phi3-as-llama", folders).identity()


LLAMA_SHAPED = ["model.name=gpt", "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32",
                "model.max_len=32", "model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu"]
ODD_SPACES = ["  héllo", "\thello\tworld", "   leading", "a\t\tb  c", "x \n  y"]
SPACED_CHAT = [{"role": "user", "content": "  héllo\tworld"}, {"role": "assistant", "content": "  ok\t ok"},
               {"role": "user", "content": "\t again"}]


def trained(tokenizer: Path, tmp_path: Path, *extra: str) -> Path:
    """A tiny Llama-shaped run (`extra`: options beyond Llama's) trained one step on documents through `tokenizer`."""
    from shard import config
    from shard.run import trainer

    from conftest import overrides

    corpus = tmp_path / "corpus.jsonl"
    text = "  héllo\tdoc {0}:  le fromage, c'est bon.\n" * 2  # long enough for a row of the held-out split
    corpus.write_text("".join(json.dumps({"text": text.format(i)}) + "\n" for i in range(16)))
    run = tmp_path / "run"
    trainer.run(config.load(None, overrides(run, *LLAMA_SHAPED, *extra, "data.name=documents", f"data.path={corpus}",
                                            f"data.tokenizer={tokenizer}", "data.seq_len=16", "data.batch_size=4",
                                            "train.steps=1", "checkpoint.enabled=true", "run.cpu_devices=1")))
    return run


def trained_and_exported(tokenizer: Path, tmp_path: Path, *extra: str, kind: str = "llama") -> tuple[Path, Path]:
    """`trained`'s run and its Hugging Face export, written as model_type `kind` (no window, rotary or scaling beyond
    Llama's: llama): (run, exported folder)."""
    from shard.use import export

    run, out = trained(tokenizer, tmp_path, *extra), tmp_path / "hf"
    assert export.main([str(run), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == kind
    return run, out


def test_a_phi3_tokenizers_run_exported_as_llama_encodes_there_as_it_trained(folders, tmp_path):
    """A Phi-3 folder's tokenizer (its config names LlamaTokenizer; model_type phi3 reads tokenizer.json as written)
    trained a model the exporter writes as llama, whose config.json would make AutoTokenizer rebuild the Llama
    pipeline: the exported tokenizer_config.json names TokenizersBackend, so the folder's tokens are training's
    and the source folder's, texts and chat alike; no other byte of the run's tokenizer files changes."""
    from shard import load_tokenizer

    run, out = trained_and_exported(folders["phi3"], tmp_path)
    exported, source = transformers.AutoTokenizer.from_pretrained(str(out)), theirs("phi3", folders)
    trained = load_tokenizer(str(run))
    assert type(exported).__name__ == "TokenizersBackend"
    for text in ODD_SPACES:
        assert exported(text).input_ids == trained.encode(text) == source(text).input_ids, text
    assert exported("  héllo").input_ids != theirs("phi3-as-llama", folders)("  héllo").input_ids  # what it was
    want = source.apply_chat_template(SPACED_CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert exported.apply_chat_template(SPACED_CHAT, tokenize=True, add_generation_prompt=True,
                                        return_dict=False) == chat.Template(trained)(SPACED_CHAT) == want
    kept = run / tokenizer_lib.RUN_FOLDER
    for f in kept.iterdir():
        if f.name not in ("config.json", "tokenizer_config.json"):
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    named = ('"tokenizer_class": "LlamaTokenizer"', '"tokenizer_class": "TokenizersBackend"')
    assert (out / "tokenizer_config.json").read_text() == (kept / "tokenizer_config.json").read_text().replace(*named)


def test_a_llama2_tokenizers_run_exported_as_llama_keeps_its_tokenizer_files(tmp_path):
    """Where the exported config.json picks the class the run read its tokenizer with, nothing is renamed."""
    from shard import load_tokenizer

    run, out = trained_and_exported(FIXTURES / "llama-2-7b-hf", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (FIXTURES / "llama-2-7b-hf" / name).read_bytes(), name
    exported, source = (transformers.AutoTokenizer.from_pretrained(str(p)) for p in (out, FIXTURES / "llama-2-7b-hf"))
    assert type(exported).__name__ == type(source).__name__ == "LlamaTokenizer"
    trained = load_tokenizer(str(run))
    assert all(exported(t).input_ids == trained.encode(t) == source(t).input_ids for t in ODD_SPACES)


# (llama-2-spm-only: a lone .model's BOS written into the file's post-processor, as Gemma's would be; gemma-2b-it's
# 256k pieces cost 30 s for no other path)
@pytest.mark.parametrize("name", ["llama-2-7b-hf", "llama-2-spm-only", "qwen2.5-0.5b-instruct"])
def test_a_windowed_llamas_run_exported_as_mistral_encodes_there_as_it_trained(name, folders, tmp_path):
    """A Llama whose layers all slide alike is written as mistral, for which transformers reads tokenizer.json as
    written whatever class the files name; the run read Llama 2's tokenizer.json or lone .model (LlamaTokenizer; the
    .model's BOS from tokenizer_config.json's flags), Qwen2.5's vocab.json + merges.txt (Qwen2Tokenizer) or Gemma's
    .model (GemmaTokenizer) with its class's pipeline. The exported tokenizer.json is that pipeline: AutoTokenizer
    gives training's ids, texts and chat alike."""
    from shard import load_tokenizer

    run, out = trained_and_exported(folders[name], tmp_path, "model.windows=[8]", kind="mistral")
    exported, source = transformers.AutoTokenizer.from_pretrained(str(out)), theirs(name, folders)
    trained_with = load_tokenizer(str(run))
    assert type(exported).__name__ == "TokenizersBackend" != type(source).__name__
    for text in [*ODD_SPACES, " a  b"]:
        assert exported(text).input_ids == trained_with.encode(text) == source(text).input_ids, text
    if trained_with.chat_template is not None:
        want = source.apply_chat_template(SPACED_CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert exported.apply_chat_template(SPACED_CHAT, tokenize=True, add_generation_prompt=True,
                                            return_dict=False) == chat.Template(trained_with)(SPACED_CHAT) == want
    kept = run / tokenizer_lib.RUN_FOLDER
    for f in kept.iterdir():  # the other files as the run keeps them
        if f.name not in ("config.json", "tokenizer.json"):
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_qkv_biased_llamas_run_with_a_llama2_tokenizer_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                                               monkeypatch):
    """A Llama with qkv_bias is written as qwen2, whose tokenizer transformers always builds as Qwen2Tokenizer (qwen2
    is in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), which garbles Llama 2's: the CLI refuses in one line (exit 2)
    before a parameter is gathered, and neither --out nor the parent it would make (where the weights' scratch
    folder goes) is left."""
    from shard import load_tokenizer
    from shard.errors import exit_from
    from shard.hf import write
    from shard.use import export

    run = trained(FIXTURES / "llama-2-7b-hf", tmp_path, "model.qkv_bias=true")
    out = tmp_path / "new" / "hf"
    capsys.readouterr()
    monkeypatch.setattr(write, "host_value", lambda x: pytest.fail("a parameter was gathered before the refusal"))
    with pytest.raises(SystemExit) as e:
        exit_from(export.main, [str(run), "--format", "hf", "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model_type qwen2" in err and "Qwen2Tokenizer" in err and "as LlamaTokenizer" in err, err
    assert not out.parent.exists()
    # what the refusal spares: transformers' reading of the run's tokenizer files under that model_type
    garbled = tmp_path / "as-qwen2"
    shutil.copytree(run / tokenizer_lib.RUN_FOLDER, garbled)
    (garbled / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    ref, text = transformers.AutoTokenizer.from_pretrained(str(garbled)), "  héllo\t a  b"
    assert type(ref).__name__ == "Qwen2Tokenizer" and ref(text).input_ids != load_tokenizer(str(run)).encode(text)


def test_a_qwen_tokenizer_goes_unchanged_into_a_folder_written_as_qwen2(folders, tmp_path):
    """What Qwen2Tokenizer reads as the run does (Qwen3's files name it) is not refused for qwen2, nor changed."""
    from shard.hf import write

    config = {"model_type": "qwen2"}
    files = write._tokenizer_files(folders["qwen3-4b"], config)
    assert files == {f.name: f.read_bytes() for f in folders["qwen3-4b"].iterdir()} and config["eos_token_id"] == 151645
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "config.json").write_text(json.dumps(config))
    exported, text = transformers.AutoTokenizer.from_pretrained(str(tmp_path)), "  héllo\t a  b"
    assert exported(text).input_ids == ours("qwen3-4b", folders).encode(text) \
        == theirs("qwen3-4b", folders)(text).input_ids


@pytest.mark.parametrize("name, names", [("smollm3-3b", "tokenizer.json"),
                                         ("deepseek-r1-distill-qwen-32b", "tokenizer.json"),
                                         ("llama-3.2-3b-instruct", "tiktoken")])
def test_a_folder_without_a_tokenizer_is_one_line_naming_what_was_looked_for(name, names):
    with pytest.raises(UserError, match=names) as e:
        tokenizer_lib.load(str(FIXTURES / name))
    assert "\n" not in str(e.value)


def test_the_cli_refuses_a_folder_without_a_tokenizer_with_exit_2(tmp_path):
    corpus = tmp_path / "a.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "data.name=documents", f"data.path={corpus}",
                           f"data.tokenizer={FIXTURES / 'smollm3-3b'}", f"run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "looked for tokenizer.json" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


class _Idle:
    """An engine stand-in: nothing runs, so a request waits in the queue with its prompt's tokens."""
    slots, recompiles = 1, 0


@pytest.mark.parametrize("name", ["llama-2-7b-hf", "gemma-2b-it", "qwen2.5-0.5b-instruct", "mistral-7b-v0.1-tokenizer"])
def test_the_servers_prompts_are_the_training_rows_first_tokens(name, folders, tmp_path):
    import asyncio

    import httpx

    from shard.server import app, scheduler

    tok = ours(name, folders)
    queue = scheduler.Scheduler(_Idle(), tok, max_queue=1)
    served = app.build(queue, tok, chat.Template(tok), "m", 1 << 16)

    async def asked(route: str, body: dict) -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://t") as c:
            pending = asyncio.create_task(c.post(route, json=body))
            while not queue.waiting:
                await asyncio.sleep(0.01)
            request = queue.waiting.popleft()
            pending.cancel()
            return request.prompt

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS))
    rows = token_cache.load([pairs], ("prompt", "completion"), str(folders[name]), tmp_path / "cache")
    for i, (p, _) in enumerate(PAIRS):
        prompt = asyncio.run(asked("/v1/completions", {"prompt": p, "max_tokens": 1}))
        assert prompt == _row(rows, i)[0][:len(prompt)] and prompt == theirs(name, folders)(p).input_ids
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats_for(name)))
    rows = token_cache.load([chats], "messages", str(folders[name]), tmp_path / "cache")
    for i, messages in enumerate(chats_for(name)):
        prompt = asyncio.run(asked("/v1/chat/completions", {"messages": messages[:-1], "max_tokens": 1}))
        assert len(prompt) > 2 and prompt == _row(rows, i)[0][:len(prompt)]


def test_a_folder_with_only_a_sentencepiece_model_fine_tunes_generates_and_exports_with_it(tmp_path, capsys):
    """A Llama folder whose tokenizer is tokenizer.model alone: the run reads it (not bytes), generation starts
    from BOS as training did, and the exported folder's tokenizer is transformers' same one."""
    import torch

    from shard import config, load_tokenizer
    from shard.run import trainer
    from shard.use import export, generate

    from conftest import overrides

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=32000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=64)
    folder = tmp_path / "llama-spm"
    transformers.LlamaForCausalLM(hf_config).save_pretrained(folder)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "llama-2-7b-hf" / name, folder / name)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Document {i}: le fromage, c'est bon. 🧀"}) + "\n"
                              for i in range(40)))
    run = tmp_path / "run"
    cfg = config.load(None, overrides(run, f"train.init_from={folder}", "data.name=documents", f"data.path={corpus}",
                                      "data.seq_len=16", "data.batch_size=4", "train.steps=1",
                                      "checkpoint.enabled=true", "run.cpu_devices=1"))
    assert cfg.data.tokenizer == str(folder)
    trainer.run(cfg)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "Le fromage 🧀, c'est bon"
    assert load_tokenizer(str(run)).encode(text) == ref(text).input_ids and ref(text).input_ids[0] == 1
    assert load_tokenizer(str(run)).prompt(text) == ref(text).input_ids  # what generate and the server feed
    capsys.readouterr()
    assert generate.main([str(run), "--prompt", text, "--max-new-tokens", "2", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    new = printed[len(text):].rstrip("\n")
    assert printed.startswith(text) and ref.decode(ref(text + new).input_ids, skip_special_tokens=True) == text + new
    out = tmp_path / "exported" / "hf"  # its parent is made
    assert export.main([str(run), "--format", "hf", "--out", str(out)]) == 0
    assert (out / "tokenizer.model").is_file()
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text).input_ids == ref(text).input_ids
    bare = tmp_path / "bare"  # the same model without any tokenizer: a documents run is refused
    bare.mkdir()
    for f in folder.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, bare / f.name)
    with pytest.raises(UserError, match="train.init_from=.*no tokenizer in the folder; looked for tokenizer.json"):
        config.load(None, overrides(tmp_path / "run2", f"train.init_from={bare}", "data.name=documents",
                                    f"data.path={corpus}"))
