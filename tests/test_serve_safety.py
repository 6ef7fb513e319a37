"""The server under what production brings: clients that leave from any slot, programs that fail, bodies too
large, slow tokenizing, end tokens, answers split into chunks. The scheduler is driven by hand (`tick`, no
thread) over a scripted engine where the model's numbers do not matter, and over the real one where they do."""

import asyncio
import threading
import time

import numpy as np
import pytest

from conftest import TINY_MODELS
from shard import config
from shard.core import registry
from shard.core import state as state_lib
from shard.data import tokenizer as tokenizer_lib
from shard.server import app, chat, engine, protocol, scheduler
from shard.use import generate

httpx = pytest.importorskip("httpx")
BYTES = tokenizer_lib.Bytes()
GREEDY = generate.Sampling(temperature=0, vocab=generate.BYTES)


class Scripted:
    """An engine that answers from a script: slot s's request gets `script` (token ids) in order. `fail`
    makes the next start raise; `lose` makes a failure take the cache with it."""

    def __init__(self, slots: int, script: list[int], context: int = 64, burst: int = 1):
        self.slots, self.script, self.context, self.burst, self.recompiles = slots, script, context, burst, 0
        self.fail, self.lose, self.lost, self.allocations, self.at = False, False, False, 0, {}

    def _picked(self, tokens):
        tokens = np.asarray(tokens, np.int32)
        return engine.Picked(tokens, np.zeros(tokens.shape, np.float32), np.zeros((*tokens.shape, 2), np.int32),
                             np.zeros((*tokens.shape, 2), np.float32))

    def start(self, slot, prompt, temperature, top_k, top_p):
        if self.fail:
            self.fail = False
            self.lost = self.lose
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory in prefill\nmore detail")
        self.at[slot] = 1
        return self._picked(self.script[0])

    def advance(self, tokens, index, temperature, top_k, top_p, steps=1, active=None, logprobs=True):
        out = []
        for slot in range(self.slots):
            at = self.at.get(slot, 0)
            out.append([self.script[min(at + i, len(self.script) - 1)] for i in range(steps)])
            self.at[slot] = at + steps
        return self._picked(out)

    def intact(self):
        return not self.lost

    def allocate(self):
        if self.lose == "again":
            raise RuntimeError("RESOURCE_EXHAUSTED: no memory for the cache")
        self.lost, self.allocations = False, self.allocations + 1
        return 0

    @staticmethod
    def settings(rows):
        return engine.Engine.settings(rows)


def drained(request) -> list:
    pieces = []
    while not request.events.empty():
        pieces.append(request.events.get_nowait())
    return pieces


def text_of(request) -> str:
    return "".join(p.text for p in drained(request))


@pytest.mark.parametrize("queued", [0, 2])
def test_a_cancelled_request_frees_its_slot_within_one_round_in_every_slot(queued):
    """Whatever slot it holds and whether or not others wait, a cancelled request's slot is free (or taken by
    the next waiting one) after one round."""
    slots = 3
    for victim in range(slots):
        queue = scheduler.Scheduler(Scripted(slots, [ord("a")]), BYTES, max_queue=8)
        running = [scheduler.Request([1, 2], 50) for _ in range(slots)]
        waiting = [scheduler.Request([3], 50) for _ in range(queued)]
        for request in running:
            queue.submit(request)
        queue.tick()
        assert queue.active == running
        for request in waiting:
            queue.submit(request)
        running[victim].cancelled = True
        queue.tick()
        assert queue.active[victim] is (waiting[0] if queued else None), (victim, queued)
        assert queue.cancelled == 1 and running[victim].finish == "cancelled"
        assert [r.finish for i, r in enumerate(running) if i != victim] == [None] * (slots - 1)


def test_requests_whose_client_left_take_no_place_in_the_queue():
    """One long answer holds the only slot: requests posted then dropped by their clients count against no
    --max-queue and leave the queue at the next round (not when a slot frees: they would pile up), and the long
    one goes on."""
    queue = scheduler.Scheduler(Scripted(1, [ord("a")], context=256), BYTES, max_queue=3)
    long, dropped = scheduler.Request([1], 60), [scheduler.Request([2] * 64, 10) for _ in range(500)]
    queue.submit(long)
    queue.tick()
    for request in dropped:
        queue.submit(request)
        request.cancelled = True  # as the web server's release() marks a request whose client left
    fresh = [scheduler.Request([3], 2) for _ in range(3)]
    for request in fresh:
        queue.submit(request)
    with pytest.raises(scheduler.QueueFull):
        queue.submit(scheduler.Request([4], 2))
    queue.tick()
    assert list(queue.waiting) == fresh and queue.active == [long] and queue.cancelled == 500
    assert {r.finish for r in dropped} == {"cancelled"} and not any(r.events.qsize() for r in dropped)
    while queue.waiting or any(queue.active):
        queue.tick()
    assert (text_of(long), long.finish) == ("a" * 60, "length")
    assert [(text_of(r), r.finish) for r in fresh] == [("aa", "length")] * 3 and queue.served == 4


def test_a_failure_anywhere_in_the_loop_ends_every_request_it_holds():
    """Not only a program: a tokenizer that fails while decoding an answer ends the running and the waiting
    requests with the reason, and the loop goes on."""
    class Failing(type(BYTES)):
        def stream(self, prompt):
            raise ValueError("the decoder broke")

    queue = scheduler.Scheduler(Scripted(1, [ord("a")]), Failing(), max_queue=8)
    requests = [scheduler.Request([1], 5) for _ in range(3)]
    for request in requests:
        queue.submit(request)
    queue.start()
    try:
        settled(requests)
    finally:
        queue.stop()
    assert [r.finish for r in requests] == ["error"] * 3
    assert drained(requests[0])[-1].error == "ValueError: the decoder broke" and queue.thread is not None


def test_cancelled_requests_still_waiting_never_take_a_slot():
    queue = scheduler.Scheduler(Scripted(1, [ord("a")]), BYTES, max_queue=8)
    first, gone, last = (scheduler.Request([1], 50) for _ in range(3))
    for request in (first, gone, last):
        queue.submit(request)
    queue.tick()
    gone.cancelled, first.cancelled = True, True
    queue.tick()
    assert queue.active == [last] and queue.cancelled == 2 and not queue.waiting


@pytest.mark.parametrize("lose", [False, True])
def test_a_failed_prefill_is_answered_with_its_reason_and_the_others_go_on(lose):
    """The failing request ends with "error" and the first line of the reason. If the failure took the cache
    (a donated buffer), the running requests end too and the cache is made again; the next request runs."""
    scripted = Scripted(2, [ord("a")])
    queue = scheduler.Scheduler(scripted, BYTES, max_queue=8)
    running, failing, after = (scheduler.Request([1], 5) for _ in range(3))
    queue.submit(running)
    queue.tick()
    scripted.fail, scripted.lose = True, lose
    queue.submit(failing)
    queue.submit(after)
    queue.tick()
    last = drained(failing)[-1]
    assert (last.finish, last.error) == ("error", "RuntimeError: RESOURCE_EXHAUSTED: out of memory in prefill")
    assert scripted.allocations == int(lose)
    assert (running.finish == "error") is lose
    while any(queue.active):
        queue.tick()
    assert after.finish == "length" and text_of(after) == "aaaaa" and queue.unhealthy() is None


def test_an_engine_that_cannot_remake_its_cache_says_so_and_answers_everyone():
    scripted = Scripted(1, [ord("a")])
    queue = scheduler.Scheduler(scripted, BYTES, max_queue=8)
    failing, waiting = scheduler.Request([1], 5), scheduler.Request([2], 5)
    scripted.fail, scripted.lose = True, "again"
    queue.submit(failing)
    queue.submit(waiting)
    queue.tick()
    assert failing.finish == "error" and waiting.finish == "error"
    assert "could not be made again" in queue.unhealthy()
    with pytest.raises(scheduler.Unhealthy):
        queue.submit(scheduler.Request([3], 5))

    async def health():
        served = app.build(queue, BYTES, chat.Template(BYTES), "m", 64)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://t") as c:
            return await c.get("/health"), await c.post("/v1/completions", json={"prompt": "x"})

    status, refused = asyncio.run(health())
    assert status.status_code == 503 and "could not be made again" in status.json()["reason"]
    assert refused.status_code == 503 and "could not be made again" in refused.json()["error"]["message"]


def test_a_failed_request_gets_a_500_naming_the_reason_over_http():
    scripted = Scripted(1, [ord("a")])
    queue = scheduler.Scheduler(scripted, BYTES, max_queue=8)
    scripted.fail = True

    async def ask():
        served = app.build(queue, BYTES, chat.Template(BYTES), "m", 64)
        queue.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://t") as c:
                failed = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
                fine = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
                streamed = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
                return failed, fine, streamed
        finally:
            queue.stop()

    failed, fine, streamed = asyncio.run(ask())
    assert failed.status_code == 500 and "out of memory in prefill" in failed.json()["error"]["message"]
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == "aaa"
    assert streamed.text.endswith("data: [DONE]\n\n")


def test_end_tokens_stop_a_request_and_multi_byte_characters_and_stop_strings_never_split():
    """Every id of `ends` stops (generation_config.json may list several); chunks never end inside a UTF-8
    character or inside what may begin a stop string, and a stop string never reaches the client."""
    text = "héllo 日本語 🙂 end"
    script = list(text.encode()) + [7]
    queue = scheduler.Scheduler(Scripted(1, script, context=256), BYTES, max_queue=8, ends={9, 7})
    plain, stopped = scheduler.Request([1], 100), scheduler.Request([1], 100, stop=("🙂 e", "xyz"))
    for request, want, why in ((plain, text, "stop"), (stopped, "héllo 日本語 ", "stop")):
        queue.submit(request)
        while queue.waiting or any(queue.active):
            queue.tick()
        pieces = drained(request)
        assert "".join(p.text for p in pieces) == want and pieces[-1].finish == why
        assert len(pieces) > 5 and all("\ufffd" not in p.text for p in pieces)


def test_each_tokens_logprobs_go_with_the_chunk_that_carries_its_text():
    """A token whose text is held back (it may begin a stop string) is reported with the chunk that sends it."""
    texts = {1: "ab", 2: "c-", 3: "de", 4: "-", 5: "x"}  # token 2's "-" may begin the stop string "-x"

    class Pieces:
        def stream(self, prompt):
            return type("Decoder", (), {"add": lambda _, t: texts[t], "flush": lambda _: ""})()

    queue = scheduler.Scheduler(Scripted(1, [1, 2, 3, 4, 5]), Pieces(), max_queue=8)
    request = scheduler.Request([1], 9, stop=("-x",), logprobs=1)
    queue.submit(request)
    while queue.waiting or any(queue.active):
        queue.tick()
    pieces = drained(request)
    assert "".join(p.text for p in pieces) == "abc-de" and pieces[-1].finish == "stop"
    sent = released = ""
    for piece in pieces:  # a token goes with the chunk that completes its text, never before
        sent += piece.text
        released += "".join(t.text for t in piece.tokens)
        assert sent.startswith(released) or piece.finish, (sent, released)
    # the tokens past the stop string ("-", "x") are not reported: the tokens given are those of the text returned
    assert [t.id for p in pieces for t in p.tokens] == [1, 2, 3]
    for stop, text, ids in (("e-", "abc-d", [1, 2, 3]), ("bc", "a", [1]), ("ab", "", [])):  # "de", "ab": in part
        request = scheduler.Request([1], 9, stop=(stop,), logprobs=1)
        queue.submit(request)
        while queue.waiting or any(queue.active):
            queue.tick()
        pieces = drained(request)
        assert ("".join(p.text for p in pieces), [t.id for p in pieces for t in p.tokens]) == (text, ids), stop


def test_a_burst_decodes_several_tokens_per_call_only_while_no_one_waits():
    scripted = Scripted(2, [ord("a")], burst=4)
    calls = []
    advance = scripted.advance
    scripted.advance = lambda *a, steps=1, **_: calls.append(steps) or advance(*a, steps=steps)
    queue = scheduler.Scheduler(scripted, BYTES, max_queue=8)
    long, short = scheduler.Request([1], 9), scheduler.Request([1], 3)
    queue.submit(long)
    queue.tick()   # alone, 8 tokens to go: a burst
    queue.submit(short)
    queue.tick()   # short joins; 2 to go: one token
    while any(queue.active):
        queue.tick()
    assert calls[0] == 4 and calls[1] == 1
    assert text_of(long) == "a" * 9 and text_of(short) == "aaa"


def test_bodies_past_the_limit_get_413_before_they_are_read_whole_and_stop_lists_are_bounded():
    queue = scheduler.Scheduler(Scripted(1, [ord("a")]), BYTES, max_queue=8)
    served = app.build(queue, BYTES, chat.Template(BYTES), "m", 64, max_body=200)

    async def chunks():
        for _ in range(100):
            yield b"x" * 50

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://t") as c:
            return [await c.post("/v1/completions", content=b'{"prompt": "' + b"x" * 300 + b'"}'),
                    await c.post("/v1/completions", content=chunks()),
                    await c.post("/v1/completions", json={"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}),
                    await c.post("/v1/completions", json={"prompt": "x", "presence_penalty": 0.5}),
                    await c.post("/v1/completions", json={"prompt": "x", "logprobs": 6}),
                    await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "top_logprobs": 2})]

    whole, streamed, stops, penalty, logprobs, top = asyncio.run(ask())
    assert whole.status_code == 413 and "at most 200" in whole.json()["error"]["message"]
    assert streamed.status_code == 413
    assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop"
    assert penalty.status_code == 400 and penalty.json()["error"]["param"] == "presence_penalty"
    assert logprobs.status_code == 400 and logprobs.json()["error"]["param"] == "logprobs"
    assert top.status_code == 400 and top.json()["error"]["param"] == "top_logprobs"
    one = protocol.parse(b'{"prompt": "x", "stop": "a stop longer than four"}', protocol.Completion)
    assert one.stops() == ("a stop longer than four",)  # one string of any length: the limit is on the list


def test_tokenizing_a_large_prompt_does_not_stall_the_event_loop():
    class Slow:
        vocab_size = 256

        def prompt(self, text):
            time.sleep(1.0)
            return [1]

    queue = scheduler.Scheduler(Scripted(1, [ord("a")]), BYTES, max_queue=8)
    served = app.build(queue, Slow(), chat.Template(BYTES), "m", 64)

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://t") as c:
            slow = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
            await asyncio.sleep(0.1)
            began = time.perf_counter()
            await c.get("/health")
            answered = time.perf_counter() - began
            slow.cancel()
            return answered

    assert asyncio.run(both()) < 0.5


@pytest.fixture(scope="module")
def tiny():
    cfg = config.load(None, TINY_MODELS["gpt"])
    return generate.Generator(state_lib.build_model(*registry.load(cfg.model), seed=1))


def test_a_long_prompt_prefills_chunk_by_chunk_and_decodes_as_it_would_alone(tiny):
    """Prompts longer than the chunk, in a context that is no multiple of it, with bursts: each request's
    tokens are its prompt's alone; the cache was sized by --context, not by the model's positions."""
    slots = engine.Engine(tiny, slots=4, context=30, vocab=generate.BYTES, chunk=8, burst=3)
    assert (slots.buckets, slots.views, slots.context, slots.row_buckets) == ([8], [30], 30, [1, 4])
    slots.allocate()
    queue = scheduler.Scheduler(slots, BYTES, 8)
    texts = ("def f(x): return x", "ab", "import os, sys\nprint(1)", "x = 1", "for i in range(3):", "#")
    prompts = [generate.text_tokens(t) for t in texts]  # they end at different steps: running slots with gaps
    requests = [scheduler.Request(p, min(30 - len(p) - 1, 3 + 4 * i), temperature=0) for i, p in enumerate(prompts)]
    for request in requests:
        queue.submit(request)
    while queue.waiting or any(queue.active):
        queue.tick()
    for request in requests:
        want = tiny(np.array([request.prompt]), request.max_tokens, GREEDY)[0].tolist()
        assert request.tokens == want, request.prompt


def test_a_prefill_that_loses_the_cache_is_recovered_from_on_the_real_engine(tiny):
    slots = engine.Engine(tiny, slots=2, context=32, vocab=generate.BYTES)
    slots.allocate()
    queue = scheduler.Scheduler(slots, BYTES, 4)
    real = slots.first

    def failing(state, cache, *args):
        for leaf in __import__("jax").tree.leaves(cache):
            leaf.delete()  # as a program that failed after its inputs were donated leaves them
        raise RuntimeError("INTERNAL: the device failed")

    slots.first = failing
    broken, fine = scheduler.Request([1, 2], 4, temperature=0), scheduler.Request(generate.text_tokens("ab"), 4,
                                                                                  temperature=0)
    queue.submit(broken)
    queue.tick()
    assert broken.finish == "error" and slots.intact()
    slots.first = real
    queue.submit(fine)
    while queue.waiting or any(queue.active):
        queue.tick()
    assert fine.tokens == tiny(np.array([fine.prompt]), 4, GREEDY)[0].tolist()


def test_the_scheduler_thread_ends_every_request_it_holds_when_a_step_fails():
    scripted = Scripted(2, [ord("a")])
    scripted.advance = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("step failed"))
    queue = scheduler.Scheduler(scripted, BYTES, max_queue=8)
    requests = [scheduler.Request([1], 5) for _ in range(2)]
    for request in requests:
        queue.submit(request)
    queue.start()
    try:  # the scheduler's own thread ends them, outlives the failure, and serves on once steps succeed
        settled(requests)
        assert [r.finish for r in requests] == ["error", "error"] and not any(queue.active)
        assert queue.thread in threading.enumerate() and queue.thread.name == "shard-serve-engine"
        assert queue.thread is not threading.current_thread() and queue.unhealthy() is None
        del scripted.advance
        after = scheduler.Request([1], 3)
        queue.submit(after)
        settled([after])
        assert (text_of(after), after.finish) == ("aaa", "length")
    finally:
        if queue.thread.ident is not None:  # started: stop joins it
            queue.stop()
    assert not queue.thread.is_alive() and queue.thread not in threading.enumerate()


def settled(requests, within: float = 10.0) -> None:
    """Waits a bounded time for the engine thread to end every request (a thread that never runs fails)."""
    deadline = time.monotonic() + within
    while any(r.finish is None for r in requests):
        assert time.monotonic() < deadline, "the engine thread did not end the requests"
        time.sleep(0.01)
