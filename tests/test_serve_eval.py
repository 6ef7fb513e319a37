"""The server speaks what evaluation clients send (lm-evaluation-harness's `local-completions`): echo with logprobs,
every prompt shape, several prompts a request. The prompts' log-probabilities are checked against transformers'
on the run's Hugging Face export (an independent reference). The app runs in this process (httpx's ASGI
transport) over the real engine and scheduler thread, on a tiny run with a real (tiny, offline) tokenizer."""

import asyncio
import json

import numpy as np
import pytest

import tiny_tokenizers
from shard.server import app, chat, engine, scheduler
from shard.use import generate

httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONTEXT = 32


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained a little through a byte-level BPE with BOS and EOS, and its export."""
    from shard.use import export

    tmp = tmp_path_factory.mktemp("serve-eval")
    folder = tiny_tokenizers.trained(tiny_tokenizers.make("json", tmp / "tok"), tmp, "optimizer.lr=1e-2", steps=20)
    assert export.main([str(folder), "--format", "hf", "--out", str(tmp / "hf")]) == 0
    return folder, tmp / "hf"


@pytest.fixture(scope="module")
def served(run):
    """The app over the run's engine (2 slots), its scheduler thread running."""
    import shard

    folder, _ = run
    tok = shard.load_tokenizer(str(folder))
    generator = generate.Generator(shard.load_model(str(folder)))
    slots = engine.Engine(generator, slots=2, context=CONTEXT, vocab=tok.vocab_size)
    slots.allocate()
    queue = scheduler.Scheduler(slots, tok, 8, ends=generate.stop_ids(tok))
    queue.start()
    yield app.build(queue, tok, chat.Template(tok), "m", CONTEXT), tok
    queue.stop()


def post(served, body, route="/v1/completions") -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=served[0])
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            return await c.post(route, json=body)
    return asyncio.run(go())


def reference(run, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax of the export's logits over `ids`, float64: (len(ids), vocab)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(run[1]), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_echo_with_logprobs_gives_the_prompts_own_logprobs_as_transformers_for_every_prompt(run, served):
    """lm-eval's loglikelihood request: token-id lists, echo, logprobs 1, max_tokens 1. Each choice (by index)
    holds its prompt's tokens (the first null) and then the answer's, log-probabilities within 1e-4 of
    transformers' on the export; top_logprobs hold the chosen token (up to logprobs + 1 entries), so lm-eval's
    greedy check (chosen == max of top) is transformers' argmax."""
    tok = served[1]
    texts = ["Question: what is 2 + 2?\nAnswer: 4", "the cat sat on the mat", "le fromage"]
    prompts = [tok.encode(t) for t in texts]
    answer = post(served, {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for ids, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and choice["text"].startswith(tok.decode(ids))
        generated = tok.encode(choice["text"][len(tok.decode(ids)):], special=False)
        ref = reference(run, ids)
        want = [ref[i - 1, t] for i, t in enumerate(ids) if i]
        np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], want, atol=1e-4)
        for i in range(1, len(ids) + 1):
            top = lp["top_logprobs"][i]
            assert 1 <= len(top) <= 2 and lp["tokens"][i] in top and top[lp["tokens"][i]] == lp["token_logprobs"][i]
            if i < len(ids):
                assert (lp["token_logprobs"][i] == max(top.values())) == (ref[i - 1].argmax() == ids[i]), i
        assert lp["token_logprobs"][-1] == pytest.approx(ref[-1].max(), abs=1e-4)  # greedy: the argmax
        assert generated == [] or generated[0] == int(ref[-1].argmax())
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert answer.json()["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_echo_alone_every_prompt_shape_and_several_prompts(run, served):
    """max_tokens 0 with echo answers with the prompt alone; a string, a list of strings, a list of ids and a list
    of id lists are the same prompts; several prompts are answered as one choice each, as each alone."""
    tok = served[1]
    text = "the cat sat on"
    alone = post(served, {"prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    choice = alone["choices"][0]
    assert (choice["text"], choice["finish_reason"], alone["usage"]["completion_tokens"]) == (text, "length", 0)
    ids = tok.encode(text)
    assert choice["logprobs"]["tokens"][0] == "<s>" and len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs 0: the chosen alone
    for prompt in (ids, [ids], [text]):
        again = post(served, {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0}).json()["choices"]
        assert again[0]["logprobs"] == choice["logprobs"] and len(again) == 1
    texts = ["le fromage", "one two", "red green blue"]
    singles = [post(served, {"prompt": t, "max_tokens": 5, "temperature": 0}).json()["choices"][0] for t in texts]
    together = post(served, {"prompt": texts, "max_tokens": 5, "temperature": 0}).json()["choices"]
    assert [(c["index"], c["text"]) for c in together] == [(i, c["text"]) for i, c in enumerate(singles)]
    streamed = post(served, {"prompt": texts, "max_tokens": 5, "temperature": 0, "stream": True, "echo": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    got = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)}
    assert got == {i: t + c["text"] for i, (t, c) in enumerate(zip(texts, singles))}
    ask = {"prompt": texts[:2], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    whole = post(served, ask).json()["choices"]
    chunks = [json.loads(line[6:]) for line in post(served, {**ask, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    for i, choice in enumerate(whole):  # streamed: the prompt's logprobs in the first chunk, the answer's after
        parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["index"] == i]
        assert {k: [v for part in parts if part for v in part[k]] for k in choice["logprobs"]} == choice["logprobs"]


def test_an_answer_ending_at_its_first_token_carries_it_keyed_by_its_text(served):
    """An end token answered first (a scripted engine): its logprobs are there, named by its text, as the chosen
    token among the alternatives; the answer's text is empty."""
    from test_serve_safety import Scripted

    tok = served[1]
    queue = scheduler.Scheduler(Scripted(1, [tok.eos]), tok, 4, ends={tok.eos})
    queue.start()
    try:
        got = post((app.build(queue, tok, chat.Template(tok), "m", CONTEXT), tok),
                   {"prompt": "the cat", "max_tokens": 3, "logprobs": 1})
    finally:
        queue.stop()
    choice = got.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["<|endoftext|>"] and "<|endoftext|>" in logprobs["top_logprobs"][0]


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": {"a": 1}}, "prompt", "give a string, a list of strings, a list of token ids or a list of token-id"),
    ({"prompt": []}, "prompt", "an empty list"),
    ({"prompt": [[1, 2], "x"]}, "prompt", "mixing"),
    ({"prompt": [[1, 2], [3, 10 ** 6]]}, "prompt", "prompt[1]: token ids must be in"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "echo"),
    ({"prompt": [[1]] * 9}, "prompt", "9 prompts; this server queues at most 8"),
    ({"prompt": "x", "best_of": 2}, "best_of", "best_of"),
])
def test_what_cannot_be_answered_is_one_line_naming_the_field(served, body, param, says):
    answer = post(served, body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and says in error["message"], error
    assert "\n" not in error["message"]
