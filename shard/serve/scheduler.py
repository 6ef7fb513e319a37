"""Continuous batching: requests wait in a bounded queue, take a free slot of the engine's cache as soon as
one is free (between two steps), and leave it when they end (EOS, a stop string, max_tokens, or the client
gone), so that the next one can take it at the next step.

One thread runs the engine (every JAX call is made from it); the web server's handlers hand requests in
through `submit` and read what they produce from `Request.events`, an asyncio queue filled thread-safely.
"""

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from shard.serve.engine import Engine

log = logging.getLogger("shard.serve")


class QueueFull(Exception):
    """More requests are waiting than the queue holds: the caller answers 503."""


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (text delta, finish reason or None)
    tokens: list[int] = field(default_factory=list)
    sent: str = ""               # the text handed out so far
    cancelled: bool = False      # the client went away: the slot is freed at the next step
    finish: str | None = None

    def emit(self, delta: str, finish: str | None) -> None:
        if self.loop is None:  # no event loop (a direct caller): the queue is read from this thread
            self.events.put_nowait((delta, finish))
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (delta, finish))


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` might begin a stop string (not to be sent yet)."""
    for keep in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-keep:]) for s in stops):
            return keep
    return 0


class Scheduler:
    def __init__(self, engine: Engine, tokenizer, max_queue: int):
        self.engine, self.tok, self.max_queue = engine, tokenizer, max_queue
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request | None] = [None] * engine.slots
        self.index = np.zeros(engine.slots, np.int32)   # each slot's next write
        self.last = np.zeros(engine.slots, np.int32)    # each slot's newest token
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.stopping, self.served, self.cancelled = False, 0, 0
        self.thread = threading.Thread(target=self._loop, name="shard-serve-engine", daemon=True)

    def submit(self, request: Request) -> None:
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the queue holds {self.max_queue})")
            self.waiting.append(request)
        self.wake.set()

    def counts(self) -> dict:
        return {"slots": self.engine.slots, "active": sum(r is not None for r in self.active),
                "waiting": len(self.waiting), "served": self.served, "cancelled": self.cancelled,
                "recompiles": self.engine.recompiles}

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the loop once nothing is waiting or running (the web server stopped taking requests first)."""
        self.stopping = True
        self.wake.set()
        self.thread.join()

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        while True:
            try:
                self._admit()
                if any(r is not None for r in self.active):
                    self._step()
                    continue
            except Exception:  # a failed program: its requests end with an error, the others go on
                log.exception("the engine failed; ending the running requests")
                for slot, request in enumerate(self.active):
                    if request is not None:
                        self._finish(slot, "error")
                continue
            if self.stopping and not self.waiting:
                return
            self.wake.wait(0.5)
            self.wake.clear()

    def _admit(self) -> None:
        """Free slots take waiting requests: each prompt's prefill, and its first token."""
        for slot in range(self.engine.slots):
            request = self.active[slot]
            if request is not None and request.cancelled:
                self._finish(slot, "cancelled")
            while self.active[slot] is None:
                with self.lock:
                    if not self.waiting:
                        return
                    request = self.waiting.popleft()
                if request.cancelled:
                    continue
                token = self.engine.start(slot, request.prompt, request.temperature, request.top_k, request.top_p)
                self.active[slot], self.index[slot], self.last[slot] = request, len(request.prompt), token
                self._took(slot, token)

    def _step(self) -> None:
        settings = self.engine.settings(self.engine.slots)
        for slot, request in enumerate(self.active):
            if request is not None:
                settings[0][slot], settings[1][slot], settings[2][slot] = (request.temperature, request.top_k,
                                                                           request.top_p)
        tokens = self.engine.advance(self.last, self.index, *settings)
        for slot, request in enumerate(self.active):
            if request is not None:
                self.index[slot] += 1
                self.last[slot] = tokens[slot]
                self._took(slot, int(tokens[slot]))

    def _took(self, slot: int, token: int) -> None:
        """A slot's request gets `token`: its new text goes out, unless it ends the request."""
        request = self.active[slot]
        if token == self.tok.eos:
            return self._finish(slot, "stop")
        request.tokens.append(token)
        text = self.tok.continuation(request.prompt, request.tokens)
        hits = [i for i in (text.find(s, max(len(request.sent) - len(s), 0)) for s in request.stop) if i >= 0]
        if hits:
            return self._finish(slot, "stop", text[:min(hits)])
        if len(request.tokens) >= request.max_tokens or self.index[slot] >= self.engine.capacity:
            return self._finish(slot, "length", text)
        ready = len(text) - held_back(text, request.stop)
        while ready > len(request.sent) and text[ready - 1] == "\ufffd":  # a character still coming, byte by byte
            ready -= 1
        if ready > len(request.sent):
            request.emit(text[len(request.sent):ready], None)
            request.sent = text[:ready]

    def _finish(self, slot: int, reason: str, text: str | None = None) -> None:
        request = self.active[slot]
        text = self.tok.continuation(request.prompt, request.tokens) if text is None else text
        request.finish = reason
        if reason == "cancelled":
            self.cancelled += 1
        else:
            request.emit(text[len(request.sent):], reason)
            request.sent = text
        self.active[slot] = None
        self.served += 1
