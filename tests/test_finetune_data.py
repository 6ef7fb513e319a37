"""Fine-tuning rows: prompt/completion pairs and chats train only on the completion's (the assistant's) tokens,
under both packings; a chat goes through the tokenizer's chat template (as transformers renders it) or the
plain one; the loss is the trained tokens' mean over the whole global batch, whatever the mesh and the
microbatches; bad rows are one line."""

import json

import numpy as np
import pytest

from conftest import TINY_GPT
from shard import config
from shard.data import documents, formats, packing, token_cache
from shard.errors import UserError

PAIRS = [{"prompt": f"Q{i}: what is {i}+{i}?", "completion": f" {2 * i}."} for i in range(60)]
CHATS = [{"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": f"Add {i} and {i + 1}."},
                       {"role": "assistant", "content": f"{2 * i + 1}"},
                       {"role": "user", "content": "Thanks!"},
                       {"role": "assistant", "content": f"You are welcome, {i}."}]} for i in range(40)]
# Llama 3's shape of template: BOS written by the template, a header per turn, each turn closed by <|eot_id|>
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("finetune")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    pq.write_table(pa.Table.from_pylist(CHATS), root / "chats.parquet")  # messages: a list<struct> column
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CHATS for m in c["messages"]]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = root / "tok"
    folder.mkdir()
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": TEMPLATE}))
    return root


def cfg_of(*extra):
    return config.load(None, ["data.name=documents", "data.seq_len=32", *extra]).data


def trained_and_not(cache, decode) -> list[tuple[str, str]]:
    """Per document: the text of the targets trained on, and of the rest."""
    out = []
    for d in range(cache.documents):
        tokens = np.asarray(cache.tokens[cache.doc_starts[d]:cache.doc_starts[d + 1]])
        mask = np.asarray(cache.mask[cache.doc_starts[d]:cache.doc_starts[d + 1]]).astype(bool)
        out.append((decode(tokens[mask]), decode(tokens[~mask])))
    return out


def byte_text(ids) -> str:
    return bytes(int(i) for i in ids).decode()


def test_prompt_completion_rows_mask_the_prompt(made, tmp_path):
    files = [made / "pairs.jsonl"]
    cache = token_cache.load(files, ("prompt", "completion"), "bytes", tmp_path)
    # bytes has no EOS: a newline ends each row, trained with the completion it closes
    assert trained_and_not(cache, byte_text) == [(r["completion"] + "\n", r["prompt"]) for r in PAIRS]
    plain = token_cache.load(files, "prompt", "bytes", tmp_path)  # one column: a document, every target trained
    assert plain.mask is None and plain.folder != cache.folder


@pytest.mark.parametrize("packing_kind", ["concat", "documents"])
def test_rows_carry_the_mask_of_their_targets(made, tmp_path, packing_kind):
    cfg = cfg_of(f"data.path={made / 'pairs.jsonl'}", "data.prompt_field=prompt", "data.completion_field=completion",
                 f"data.packing={packing_kind}")
    train, held, cache = packing.splits(cfg, tmp_path)
    wanted = {r["completion"] + "\n" for r in PAIRS}
    for source in (train, held):
        batch = source.read_batch(np.arange(len(source)))
        mask = batch["loss_mask"].astype(bool)
        if packing_kind == "documents":  # whole rows: each document's trained targets are its completion
            for row, seg, m in zip(batch["targets"], batch["segment_ids"], mask):
                for s in set(seg[seg > 0].tolist()):
                    assert byte_text(row[(seg == s) & m]) in wanted
        else:  # windows cut anywhere: every trained target is a completion's character, every other a prompt's
            stream = byte_text(batch["targets"][mask].ravel())
            assert set(stream) <= set("".join(wanted)) and ".\n" in stream and "Q" not in stream
        assert 0 < mask.mean() < 0.5
    eval_batch = held.read_batch(np.arange(len(held)))  # bits per byte counts the trained targets' bytes only
    assert eval_batch["bytes"].sum() == eval_batch["loss_mask"].sum()


def test_a_chat_renders_with_the_tokenizers_template_and_trains_the_assistant(made, tmp_path):
    from shard.data import tokenizer as tokenizer_lib

    spec = str(made / "tok")
    tok = tokenizer_lib.load(spec)
    decode = lambda ids: tok.tok.decode([int(i) for i in ids], skip_special_tokens=False)
    cache = token_cache.load([made / "chats.jsonl"], "messages", spec, tmp_path)
    for (trained, rest), chat in zip(trained_and_not(cache, decode), CHATS):
        answers = [m["content"] for m in chat["messages"] if m["role"] == "assistant"]
        assert trained == "".join(a + "<|eot_id|>" for a in answers) + "<|end_of_text|>"
        assert rest.startswith("<|begin_of_text|><|start_header_id|>system") and rest.count("<|begin_of_text|>") == 1
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(made / "tok" / "tokenizer.json"),
                                                  bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    theirs.chat_template = TEMPLATE
    first = cache.tokens[cache.doc_starts[0]:cache.doc_starts[1] - 1].tolist()  # without the separator
    assert first == theirs.apply_chat_template(CHATS[0]["messages"], tokenize=True, return_dict=False)
    prompt = formats.Formatter(("messages",), tok).prompt(CHATS[0]["messages"][:2])
    assert prompt == theirs.apply_chat_template(CHATS[0]["messages"][:2], tokenize=False, add_generation_prompt=True)


def test_a_chat_without_a_template_uses_the_plain_one(made, tmp_path):
    for path in ("chats.jsonl", "chats.parquet"):
        cache = token_cache.load([made / path], "messages", "bytes", tmp_path)
        first_trained, first_rest = trained_and_not(cache, byte_text)[0]
        assert first_trained == "1\nYou are welcome, 0.\n" + "\n"  # and the separator after the row
        assert first_rest == "system: Be brief.\nuser: Add 0 and 1.\nassistant:\nuser: Thanks!\nassistant:\n"
    from shard.data import tokenizer as tokenizer_lib

    plain = formats.Formatter(("messages",), tokenizer_lib.Bytes())
    assert plain.prompt([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:\n"


def test_fine_tuning_trains_the_same_under_fsdp_accumulation_pipeline_and_context(made, train):
    data = [f"data.path={made / 'pairs.jsonl'}", "data.prompt_field=prompt", "data.completion_field=completion",
            "data.name=documents", "train.steps=3", "run.log_every=1"]
    one = train(*TINY_GPT, *data, "run.cpu_devices=1", subdir="one")
    split = train(*TINY_GPT, *data, "mesh=fsdp", "run.cpu_devices=4", "train.grad_accum=2", subdir="split")
    np.testing.assert_allclose([r["loss"] for r in split.history], [r["loss"] for r in one.history], rtol=2e-5)
    for mesh in (["mesh=pp", "mesh.stage=2", "run.cpu_devices=2"], ["mesh=cp", "run.cpu_devices=4"]):
        other = train(*TINY_GPT, *data, *mesh, subdir=mesh[0])  # the loss and its mask sit outside the stack
        np.testing.assert_allclose([r["loss"] for r in other.history], [r["loss"] for r in one.history], rtol=2e-5)
    assert all(0 < r["target_tokens"] < 16 * 32 / 2 and "packing_efficiency" not in r for r in one.history)
    assert [r["target_tokens"] for r in split.history] == [r["target_tokens"] for r in one.history]


def test_a_mixture_of_chats_and_documents_trains(made, train):
    """Every source is read with the same data.field: a row whose value is text is a document (all trained)."""
    (made / "documents.jsonl").write_text("".join(json.dumps({"messages": f"plain text number {i}. " * 3}) + "\n"
                                                  for i in range(40)))
    run = train(*TINY_GPT, "data.name=documents", "train.steps=2", "run.cpu_devices=1", "data.field=messages",
                f"data.mixture={{{made / 'chats.jsonl'}: 1, {made / 'documents.jsonl'}: 1}}")
    assert np.isfinite(run.history[-1]["loss"]) and set(run.eval) >= {"eval_loss/chats", "eval_loss/documents"}


BAD = {
    "prompt field alone": (["data.prompt_field=prompt"], "pairs.jsonl", "data.prompt_field is set alone"),
    "missing completion column": (["data.prompt_field=prompt", "data.completion_field=answer"], "pairs.jsonl",
                                  "no data.completion_field='answer'; its fields are: prompt, completion"),
    "a message without content": (["data.field=messages"], "bad_chat.jsonl",
                                  "is not a {\"role\": ..., \"content\": ...}"),
    "an unknown role": (["data.field=messages"], "bad_role.jsonl",
                        "message role 'robot'; the roles are system, developer, user"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_rows_are_one_line(made, tmp_path, case):
    extra, name, message = BAD[case]
    (made / "bad_chat.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    (made / "bad_role.jsonl").write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("{", r"\{").replace("?", r"\?")) as e:
        cfg = cfg_of(f"data.path={made / name}", *extra)
        token_cache.load(documents.corpus_files(cfg.path), formats.columns(cfg), "bytes", tmp_path)
    assert "\n" not in str(e.value)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no half-built cache left behind


def test_a_stock_flax_model_fine_tunes_on_pairs_as_on_one_device(made, train):
    """Fine-tuning rows are data: a model of Flax's stock layers, split automatically, trains on the masked
    completions with the one-device curve."""
    from conftest import same_curve_as_one_device

    stock = ["model.name=stock_models:StockTransformer", "model.d=64", "data.name=documents", "data.seq_len=32",
             "data.batch_size=16", f"data.path={made / 'pairs.jsonl'}", "data.prompt_field=prompt",
             "data.completion_field=completion", "train.steps=3", "run.log_every=1"]
    same_curve_as_one_device(train, stock, ["mesh=fsdp", "run.cpu_devices=4", "train.grad_accum=2"])
