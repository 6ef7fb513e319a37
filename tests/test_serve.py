"""python -m shard.serve, checked with a real client on loopback: one server (a subprocess on a free port of
127.0.0.1, the model laid over a tensor-parallel mesh of 2 devices, 4 slots) for the module, talked to with
the `openai` client and httpx. Under greedy decoding every answer must be the tokens `shard.generate` gives
the same prompt (on one device), whatever else shares the batch."""

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import shard
from conftest import ROOT, TINY_GPT, TINY_MODELS, overrides, subprocess_env
from shard import config
from shard.errors import UserError
from shard.run import trainer
from shard.server import app, chat, engine, scheduler
from shard.use import generate

openai = pytest.importorskip("openai")  # the test extra's real client (httpx comes with it)
httpx = pytest.importorskip("httpx")

CONTEXT = 64
RUN = [*TINY_GPT, f"model.max_len={CONTEXT}", f"data.seq_len={CONTEXT}", "train.steps=1", "optimizer.lr=1e-6",
       "checkpoint.enabled=true", "run.cpu_devices=1"]  # barely trained: its greedy bytes vary
GREEDY = generate.Sampling(temperature=0, vocab=generate.BYTES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(folder, log_file, *args) -> tuple[subprocess.Popen, str]:
    """python -m shard.serve FOLDER on a free port of 127.0.0.1 (`args` after the folder), once it answers /health:
    (the process, its URL). Its output goes to `log_file`, shown if it ends first."""
    port = free_port()
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shard.serve", str(folder), "--port", str(port), *args],
                                cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        assert proc.poll() is None, log_file.read_text()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
    return proc, url


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    trainer.run(config.load(None, overrides(folder, *RUN)))
    proc, url = serving(folder, folder / "serve.log", "--slots", "4", "--mesh", "tp", "run.cpu_devices=2")
    model = shard.load_model(str(folder))
    yield {"url": url, "proc": proc, "folder": folder, "generator": generate.Generator(model)}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="none")


def solo(served, text: str, n: int) -> str:
    """What shard.generate makes of `text` alone, greedy, as text."""
    tokens = served["generator"](np.array([generate.text_tokens(text)]), n, GREEDY)[0]
    return shard.load_tokenizer(str(served["folder"])).decode(tokens.tolist())


def test_completion_chat_stream_and_stop_strings_equal_generating_alone(served):
    c = client(served)
    name = c.models.list().data[0].id
    assert name == served["folder"].name
    want = solo(served, "def f(x):", 20)
    assert len(set(want)) > 3
    got = c.completions.create(model=name, prompt="def f(x):", max_tokens=20, temperature=0)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "length")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (9, 20)
    streamed = c.completions.create(model=name, prompt="def f(x):", max_tokens=20, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(streamed)
    pieces = [chunk.choices[0].text for chunk in chunks[:-1]]
    assert "".join(pieces) == want and len(pieces) > 2
    assert not chunks[-1].choices and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (9, 20)
    stop = want[5:7]
    cut = c.completions.create(model=name, prompt="def f(x):", max_tokens=20, temperature=0, stop=[stop, "\x00zz"])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (want[:want.index(stop)], "stop")
    streamed = c.completions.create(model=name, prompt="def f(x):", max_tokens=20, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == want[:want.index(stop)]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    want = solo(served, chat.plain(messages), 12)
    answer = c.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
    assert (answer.choices[0].message.role, answer.choices[0].message.content) == ("assistant", want)
    streamed = list(c.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0,
                                              stream=True))
    assert streamed[0].choices[0].delta.role == "assistant" and streamed[-1].choices[0].finish_reason == "length"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == want
    hot = c.completions.create(model=name, prompt="def f(x):", max_tokens=20, temperature=1.5, top_p=0.9)
    assert hot.choices[0].finish_reason == "length" and hot.usage.completion_tokens == 20


def test_logprobs_are_the_models_own_log_softmax_in_every_shape(served):
    """Completions' token_logprobs/top_logprobs and chat's content entries, whole and streamed, against the
    log-softmax of one forward pass over the prompt and the answer (one device; the server runs on two)."""
    c, name = client(served), served["folder"].name
    prompt = generate.text_tokens("def f(x):")
    answer = served["generator"](np.array([prompt]), 6, GREEDY)[0].tolist()
    logits = np.asarray(shard.load_model(str(served["folder"]))(np.array([prompt + answer[:-1]])), np.float64)
    logp = logits[0, len(prompt) - 1:] - np.log(np.exp(logits[0, len(prompt) - 1:]).sum(-1, keepdims=True))
    want = [logp[i, t] for i, t in enumerate(answer)]
    best = -np.sort(-logp, axis=-1)

    got = c.completions.create(model=name, prompt="def f(x):", max_tokens=6, temperature=0, logprobs=3).choices[0]
    np.testing.assert_allclose(got.logprobs.token_logprobs, want, atol=2e-4)
    for i, top in enumerate(got.logprobs.top_logprobs):  # keyed by text: ids that decode alike keep the likelier
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(best[i, 0], abs=2e-4)
    assert got.logprobs.text_offset[0] == 0 and len(got.logprobs.tokens) == 6
    # past a stop string: the tokens reported are those of the text returned, whole and streamed alike
    want = solo(served, "def f(x):", 12)
    stop = want[4:6]
    ask = {"model": name, "prompt": "def f(x):", "max_tokens": 12, "temperature": 0, "logprobs": 2, "stop": stop}
    whole = c.completions.create(**ask).choices[0]
    parts = [chunk.choices[0].logprobs for chunk in c.completions.create(**ask, stream=True)
             if chunk.choices[0].logprobs]
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    assert {f: [v for part in parts for v in getattr(part, f)] for f in fields} == \
        {f: getattr(whole.logprobs, f) for f in fields}
    assert (whole.text, whole.finish_reason) == (want[:want.index(stop)], "stop")
    # they hold the text returned, and each begins in it (one may run on into the stop string: returned in part)
    assert "".join(whole.logprobs.tokens).startswith(whole.text) and whole.logprobs.text_offset[-1] < len(whole.text)

    messages = [{"role": "user", "content": "hi"}]
    prompt = generate.text_tokens(chat.plain(messages))
    answer = served["generator"](np.array([prompt]), 5, GREEDY)[0].tolist()
    whole = c.chat.completions.create(model=name, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                      top_logprobs=2).choices[0].logprobs.content
    streamed = [e for chunk in c.chat.completions.create(model=name, messages=messages, max_tokens=5, temperature=0,
                                                          logprobs=True, top_logprobs=2, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole] and len(whole) == 5
    logits = np.asarray(shard.load_model(str(served["folder"]))(np.array([prompt + answer[:-1]])), np.float64)
    logp = logits[0, len(prompt) - 1:] - np.log(np.exp(logits[0, len(prompt) - 1:]).sum(-1, keepdims=True))
    for i, entry in enumerate(whole):
        assert entry.logprob == pytest.approx(logp[i, answer[i]], abs=2e-4) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(np.max(logp[i]), abs=2e-4)
        assert entry.bytes == list(entry.token.encode())
    none = c.completions.create(model=name, prompt="x", max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None


def test_64_concurrent_requests_of_mixed_lengths_each_get_their_own_answer(served):
    """More requests than slots: they queue, join the running batch as slots free, and each answer is its
    prompt's alone (the reference: one left-padded batch, which tests/test_generate.py holds equal to solo)."""
    rng = np.random.default_rng(0)
    words = ["def", "x", "import os", "return", "class A:", "  ", "for i in range(3):", "print(", "if x:", "#"]
    prompts = ["".join(rng.choice(words, rng.integers(1, 4))) for _ in range(64)]
    lengths = [int(n) for n in rng.integers(1, 25, 64)]
    tokens = served["generator"]([generate.text_tokens(p) for p in prompts], max(lengths), GREEDY)
    tok = shard.load_tokenizer(str(served["folder"]))
    want = [tok.decode(row[:n].tolist()) for row, n in zip(tokens, lengths)]
    assert len(set(want)) > 32

    async def ask_all():
        c = openai.AsyncOpenAI(base_url=served["url"] + "/v1", api_key="none", max_retries=0, timeout=600)
        answers = await asyncio.gather(*(c.completions.create(model=served["folder"].name, prompt=p, max_tokens=n,
                                                              temperature=0) for p, n in zip(prompts, lengths)))
        return [a.choices[0].text for a in answers]

    assert asyncio.run(ask_all()) == want
    health = httpx.get(served["url"] + "/health").json()
    assert (health["recompiles"], health["active"], health["waiting"]) == (0, 0, 0)


def test_bad_requests_get_a_400_naming_the_field_and_the_server_goes_on(served):
    url = served["url"]
    for body, field in ((b'{"prompt": "x",', "body"), (b'{"max_tokens": 3}', "prompt"),
                        (b'{"prompt": "abc", "max_tokens": 62}', "max_tokens"),
                        (b'{"prompt": "x", "model": "nobody"}', "model"), (b'{"prompt": "x", "n": 2}', "n"),
                        (b'{"prompt": "x", "temperature": -1}', "temperature")):
        answer = httpx.post(url + "/v1/completions", content=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, (body, answer.text)
    answer = httpx.post(url + "/v1/chat/completions", json={"messages": []})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    fine = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 61, "temperature": 0})
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 61


def test_a_client_that_leaves_mid_stream_frees_its_slot(served):
    url = served["url"]
    before = httpx.get(url + "/health").json()["cancelled"]
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "max_tokens": 60, "stream": True},
                      timeout=60) as stream:
        next(stream.iter_lines())
    for _ in range(200):
        health = httpx.get(url + "/health").json()
        if health["active"] == 0:
            break
        time.sleep(0.1)
    assert health["active"] == 0 and health["cancelled"] == before + 1 and health["recompiles"] == 0


def test_past_the_queue_the_server_answers_503_with_retry_after():
    """A scheduler whose engine never runs (no thread): one request waits, the next finds the queue full."""
    queue, served_app = idle(max_queue=1)

    async def two():
        transport = httpx.ASGITransport(app=served_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
            while not queue.waiting:
                await asyncio.sleep(0.01)
            second = await c.post("/v1/completions", json={"prompt": "y"})
            first.cancel()
            return second

    second = asyncio.run(two())
    assert second.status_code == 503 and second.headers["Retry-After"] == "1"
    assert "busy" in second.json()["error"]["message"]


def test_after_warm_up_no_request_compiles_and_a_trace_is_logged_as_a_recompile(served, caplog):
    generator = served["generator"]
    slots = engine.Engine(generator, slots=2, context=CONTEXT, vocab=generate.BYTES)
    slots.allocate()
    slots.warm_up()
    prompt = generate.text_tokens("import os")
    first = slots.start(1, prompt, 0.0, 0, 1.0).tokens  # a prompt length between two buckets
    assert first == generator(np.array([prompt]), 1, GREEDY)[0, 0] and slots.recompiles == 0
    with caplog.at_level(logging.WARNING, logger="shard.serve"):  # a shape no bucket has
        _, slots.cache = slots.first(generator.state, slots.cache, np.int32(0), np.zeros((1, 5), np.int32),
                                     np.ones(1, np.int32), np.int32(0), *slots.settings(1))
    assert slots.recompiles == 1 and "recompile after warm-up: prefill (1, 5)" in caplog.text


def test_a_client_that_leaves_before_its_whole_answer_frees_its_place():
    """Called as uvicorn would: the body, then the client's disconnect; the waiting request is cancelled."""
    queue, served_app = idle(max_queue=4)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("t", 80)}
    messages = [{"type": "http.request", "body": b'{"prompt": "x", "max_tokens": 4}', "more_body": False}]
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        while not queue.waiting:  # the request is queued: now the client goes
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(served_app(scope, receive, send))
    assert queue.waiting[0].cancelled and sent[0]["status"] == 499


def test_chat_messages_go_through_the_tokenizers_template_or_the_plain_one(tmp_path):
    from tokenizers import Tokenizer, models

    from shard.data import tokenizer as tokenizer_lib

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert chat.Template(_Bytes()).text(messages) == "system: Be brief.\nuser: hi\nassistant:\n"  # as chats train
    Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"},
                                                                "chat_template": template}))
    assert chat.Template(tokenizer_lib.load(str(tmp_path))).text(messages) == \
        "<|system|>Be brief.</s><|user|>hi</s><|assistant|>"

    def loaded(source: str):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
        return chat.Template(tokenizer_lib.load(str(tmp_path)))

    async def ask(template):
        _, served = idle(max_queue=1, template=template)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json={"messages": messages})

    # the template's raise_exception refuses the request's role order: the request's fault (400, as vLLM)
    refused = loaded("{% if messages[0]['role'] != 'user' %}{{ raise_exception('begin with a user message') }}"
                     "{% endif %}")
    with pytest.raises(chat.Refused, match="begin with a user message"):
        refused(messages)
    answer = asyncio.run(ask(refused))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    # the template's own bug (an undefined name, a TypeError) on checked messages: the server's fault (500)
    for bug, said in (("{{ bos_tokn.strip() }}", "'bos_tokn' is undefined"), ("{{ messages | length + 'x' }}",
                                                                               "unsupported operand")):
        with pytest.raises(chat.Broken, match=said):
            loaded(bug)(messages)
        answer = asyncio.run(ask(loaded(bug)))
        assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error", bug
        assert said in answer.json()["error"]["message"]
    with pytest.raises(UserError, match="not a valid template"):  # compiled as the server starts: it refuses
        loaded("{% for m in messages %}")


# a local layer (window 6) beside a global one, its prompts prefilled in chunks of 8 (the first right-padded)
WINDOWED = [*TINY_GPT, "model.position=rope", "model.windows=[6,0]"]
SINKS = [*WINDOWED, "model.attn_sinks=true"]  # and GPT-OSS's attention sinks, on both kinds of layer


@pytest.mark.parametrize("name", ["gpt", "lstm", "sinks"])
def test_a_request_joining_mid_way_decodes_as_it_would_alone(name):
    """The scheduler driven by hand (no thread): one request runs three steps alone, a second joins; each
    one's tokens are its prompt's alone. The LSTM's carry passes over its prompt's right padding unchanged; the
    local layer's slots are a ring of its window, written past by the padding of a prompt's chunk."""
    from shard.core import registry
    from shard.core import state as state_lib

    windowed = name in ("windowed", "sinks")
    cfg = config.load(None, {"windowed": WINDOWED, "sinks": SINKS}.get(name) or TINY_MODELS[name])
    generator = generate.Generator(state_lib.build_model(*registry.load(cfg.model), seed=3 if windowed else 1))
    slots = engine.Engine(generator, slots=2, context=32, vocab=generate.BYTES, burst=1,
                          **dict(chunk=8) if windowed else {})
    slots.allocate()
    if windowed:  # (layers of a kind, slots, positions, heads, head_dim): the ring, and every position
        assert {kind: c["k"].shape for kind, c in slots.cache[0][0].caches.items()} == {
            0: (1, 2, 32, 8, 4), 6: (1, 2, 6, 8, 4)}
    queue = scheduler.Scheduler(slots, _Bytes(), 4)
    first, second = (scheduler.Request(generate.text_tokens(text), 10, temperature=0) for text in ("def f(x):", "ab"))
    queue.submit(first)
    for _ in range(3):
        queue.tick()
    queue.submit(second)
    while queue.waiting or any(queue.active):
        queue.tick()
    # both prompts as one left-padded batch: each row its solo tokens (test_generate.py), in one compile
    for request, want in zip((first, second), generator([first.prompt, second.prompt], 10, GREEDY).tolist()):
        assert request.tokens == want and request.finish == "length" and len(set(want)) > 2


def _Bytes():
    from shard.data import tokenizer

    return tokenizer.load("bytes")


class Idle:
    """An engine stand-in for the HTTP side alone: nothing runs, so requests wait."""
    slots, recompiles = 1, 0


def idle(max_queue: int, template=None):
    """A scheduler over an engine that never runs (no thread started), and the app over it."""
    queue = scheduler.Scheduler(Idle(), _Bytes(), max_queue=max_queue)
    return queue, app.build(queue, _Bytes(), template or chat.Template(_Bytes()), "m", CONTEXT)


def test_the_serving_bench_checks_its_answers_and_reports_every_figure():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), *TINY_GPT, "--requests", "6",
                           "--slots", "2", "--clients", "1,3", "--max-prompt", "8", "--max-tokens", "8",
                           "--alone", "6"],
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["requests"] == 6 and figures["resident_bytes"] > 0 and "per device" in figures["cache"]
    for way in ("clients_1", "clients_3"):
        assert figures[way]["tokens_per_s"] > 0 and figures[way]["p50_s"] <= figures[way]["p99_s"]
    assert figures["alone"]["served_tokens_per_s"] > 0 and figures["alone"]["generate_tokens_per_s"] > 0


def test_sigterm_finishes_the_running_requests_then_exits_0(served):
    """Last in the module: it stops the server."""
    url, proc = served["url"], served["proc"]
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": "x", "max_tokens": 60, "temperature": 0, "stream": True}) as stream:
        lines = stream.iter_lines()
        events = [next(lines)]
        proc.send_signal(signal.SIGTERM)
        events += [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1])
    assert text == solo(served, "x", 60)  # the whole answer, not cut short
    assert proc.wait(timeout=60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health")
