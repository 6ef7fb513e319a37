"""A tokenizer holding more tokens than its model embeds, as users bring one: gemma-3-1b-it's tokenizer has
262,146 tokens (two image tokens past the embedding), its config.json 262,144 rows. transformers takes the pair;
so do training from the folder, generation and the server, and each refuses in one line only what cannot work: a
token id past the embedding, which JAX's gather would silently read as the last row."""

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "shared/fixtures/hf"
if not (FIXTURES / "gemma-3-1b-it").is_dir():
    pytest.skip(f"{FIXTURES} is absent (a clone without ../shared): gemma-3-1b-it's files are not here",
                allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard import config  # noqa: E402
from shard.data import tokenizer as tokenizer_lib  # noqa: E402
from shard.errors import UserError  # noqa: E402
from shard.run import trainer  # noqa: E402
from shard.server import app, chat, scheduler  # noqa: E402
from shard.use import generate  # noqa: E402

REAL = FIXTURES / "gemma-3-1b-it"
IMAGE = "<image_soft_token>"  # id 262145: past the embedding
TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "generation_config.json")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """gemma-3-1b-it's own config.json, vocabulary size included, with tiny layers; its tokenizer files as
    published; random weights saved by transformers."""
    c = json.loads((REAL / "config.json").read_text())
    c.update(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=1, num_key_value_heads=1,
             head_dim=16, query_pre_attn_scalar=16)
    path = tmp_path_factory.mktemp("gemma-3")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**c)).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REAL / name, path / name)
    return path


def test_the_pair_is_what_transformers_takes(folder):
    tok = tokenizer_lib.load(str(folder))
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.vocab_size == len(hf_tok) == 262146
    assert transformers.AutoConfig.from_pretrained(folder).vocab_size == 262144
    assert tok.encode(f"a {IMAGE}") == hf_tok(f"a {IMAGE}")["input_ids"] and tok.encode(IMAGE)[-1] == 262145


def corpus(tmp_path, extra: str = "") -> Path:
    rows = [{"text": f"Document {i}: the quick brown fox jumps over the lazy dog. {extra if i == 3 else ''}"}
            for i in range(12)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(folder, tmp_path, data) -> list[str]:
    return [f"train.init_from={folder}", "data.name=documents", f"data.path={data}", "data.seq_len=16",
            "data.batch_size=2", "data.eval_fraction=0.2", "train.steps=1", "train.eval_batches=1",
            "train.sample_len=4", "run.progress=false", "run.cpu_devices=1", "checkpoint.enabled=false",
            f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}"]


@pytest.mark.slow  # a 262,144-row embedding: 40 s alone
def test_training_from_the_folder_takes_its_own_tokenizer_and_refuses_an_image_token(folder, tmp_path):
    cfg = config.load(None, overrides(folder, tmp_path, corpus(tmp_path)))
    assert cfg.model.kwargs["vocab_size"] == 262144 and cfg.data.tokenizer == str(folder)
    result = trainer.run(cfg)
    assert np.isfinite(result.history[-1]["loss"]) and result.sample  # the end-of-run sample is not skipped

    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(UserError) as e:
        trainer.run(config.load(None, overrides(folder, bad, corpus(bad, f"see {IMAGE}"))))
    assert "\n" not in str(e.value) and "262145" in str(e.value) and IMAGE in str(e.value)
    assert not (bad / "run").exists()


def test_dpo_pairs_past_the_embedding_are_refused_before_training(folder, tmp_path):
    """DPO's pairs are read into memory, not a token cache: their largest id is checked all the same."""
    import jax

    from shard.run import job

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Question {i}?", "chosen": " yes", "rejected": f" no {IMAGE}" if i == 2 else " no"}
            for i in range(8)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config.load(None, [*overrides(folder, tmp_path, pairs), "data.prompt_field=prompt",
                             "data.chosen_field=chosen", "data.rejected_field=rejected", "train.objective=dpo"])
    with pytest.raises(UserError) as e:
        job.workload(cfg, jax.devices()[:1])
    assert "\n" not in str(e.value) and "262145" in str(e.value) and "past the model's 262144" in str(e.value)


def test_generate_refuses_a_prompt_past_the_embedding(folder, capsys):
    assert generate.main([str(folder), "--prompt", "Hello", "--max-new-tokens", "3", "--temperature", "1"]) == 0
    with pytest.raises(UserError) as e:
        generate.main([str(folder), "--prompt", f"look: {IMAGE}", "--max-new-tokens", "3"])
    assert "\n" not in str(e.value) and "262145" in str(e.value) and "262144 embedded tokens" in str(e.value)


class _Idle:
    """An engine stand-in: nothing runs, so a request waits in the queue with its prompt's tokens."""
    slots, recompiles = 1, 0


def test_the_server_answers_400_for_a_token_past_the_embedding(folder):
    import httpx

    tok = tokenizer_lib.load(str(folder))
    queue = scheduler.Scheduler(_Idle(), tok, max_queue=4)
    served = app.build(queue, tok, chat.Template(tok), "m", 1 << 10, embedded=262144)

    async def post(route: str, body: dict):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://t") as c:
            pending = asyncio.create_task(c.post(route, json=body))
            while not queue.waiting and not pending.done():
                await asyncio.sleep(0.01)
            if pending.done():
                return pending.result()
            queue.waiting.popleft()
            pending.cancel()
            return None

    chat_body = {"messages": [{"role": "user", "content": f"what is {IMAGE}?"}], "max_tokens": 2}
    for route, body, field in (("/v1/chat/completions", chat_body, "messages"),
                               ("/v1/completions", {"prompt": f"a {IMAGE}", "max_tokens": 2}, "prompt"),
                               ("/v1/completions", {"prompt": [2, 262144], "max_tokens": 2}, "prompt")):
        answer = asyncio.run(post(route, body))
        assert answer is not None and answer.status_code == 400, (route, body)
        error = answer.json()["error"]
        assert error["param"] == field and "past the model's 262144 embedded tokens" in error["message"]
    # in the embedding: queued as usual
    assert asyncio.run(post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})) is None
