"""Continuous batching: requests wait in a bounded queue, take a free slot of the engine's cache as soon as
one is free (between two steps), and leave it when they end (an end token, a stop string, max_tokens, the
client gone, or a failure), so that the next one can take it at the next step.

One thread runs the engine (every JAX call is made from it); the web server's handlers hand requests in
through `submit` and read what they produce from `Request.events`, an asyncio queue filled thread-safely.
Every request ends with a finish reason: a program that fails answers its requests with the reason, and the
engine either rebuilds its cache or reports itself unhealthy (`problem`), never leaves a request waiting.
"""

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from shard.server.engine import Engine

log = logging.getLogger("shard.serve")


class QueueFull(Exception):
    """More requests are waiting than the queue holds: the caller answers 503."""


class Unhealthy(Exception):
    """The engine cannot run requests any more: the caller answers 503."""


@dataclass
class Token:
    """One answer token with what `logprobs` reports of it: its text piece, its log-probability, and the
    likeliest alternatives (id, log-probability) at its place."""
    id: int
    text: str
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Piece:
    """What a request's stream carries: new text, the tokens it holds (those not carried before), and the
    finish reason on the last ("stop", "length", "error"; None before). A request that asked for its prompt's
    log-probabilities (`Request.score_prompt`) gets them first, in a piece of no text whose `prompt` holds them
    (shard/use/score.py's Scored)."""
    text: str
    tokens: list[Token]
    finish: str | None = None
    error: str | None = None
    prompt: object = None


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # alternatives to report per token (0: only the token's own); None: none
    score_prompt: bool = False  # the prompt's own tokens' log-probabilities first (echo with logprobs)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Piece, in order
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False      # the client went away: the slot is freed at the next step
    finish: str | None = None
    # the engine thread's: the text decoder, text held back (a stop string may begin in it), tokens not yet sent
    decoder: object = None
    held: str = ""
    unsent: list[Token] = field(default_factory=list)

    def emit(self, piece: Piece) -> None:
        if self.loop is None:  # no event loop (a direct caller): the queue is read from this thread
            self.events.put_nowait(piece)
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, piece)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` might begin a stop string (not to be sent yet)."""
    for keep in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-keep:]) for s in stops):
            return keep
    return 0


class Scheduler:
    def __init__(self, engine: Engine, tokenizer, max_queue: int, ends=frozenset()):
        self.engine, self.tok, self.max_queue, self.ends = engine, tokenizer, max_queue, frozenset(ends)
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request | None] = [None] * engine.slots
        self.index = np.zeros(engine.slots, np.int32)   # each slot's next write (0 for a free slot)
        self.last = np.zeros(engine.slots, np.int32)    # each slot's newest token
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.stopping, self.served, self.cancelled, self.failed = False, 0, 0, 0
        self.problem: str | None = None  # why the engine cannot serve (None: it can)
        self.thread = threading.Thread(target=self._loop, name="shard-serve-engine", daemon=True)

    def submit(self, *requests: Request) -> None:
        """Queue the requests (one HTTP request's prompts), all or none."""
        with self.lock:
            if self.unhealthy():
                raise Unhealthy(self.unhealthy())
            waiting = sum(not r.cancelled for r in self.waiting)  # those whose client left take no place
            if waiting + len(requests) > self.max_queue:
                brings = f" and this one brings {len(requests)}" if len(requests) > 1 else ""
                raise QueueFull(f"{waiting} requests are waiting{brings} (the queue holds {self.max_queue})")
            self.waiting.extend(requests)
        self.wake.set()

    def unhealthy(self) -> str | None:
        """Why requests cannot be served (None: they can)."""
        if self.problem:
            return self.problem
        if self.thread.ident is not None and not self.thread.is_alive() and not self.stopping:
            return "the engine thread has stopped"
        return None

    def counts(self) -> dict:
        return {"slots": self.engine.slots, "active": sum(r is not None for r in self.active),
                "waiting": len(self.waiting), "served": self.served, "cancelled": self.cancelled,
                "failed": self.failed, "recompiles": self.engine.recompiles}

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
                if self.tick():
                    continue
            except Exception as e:  # anything else that fails: every request held ends, none is left waiting
                log.exception("the engine loop failed; ending every request it holds")
                self._end_all(_reason(e))
                continue
            if self.stopping and not self.waiting:
                return
            self.wake.wait(0.5)
            self.wake.clear()

    def tick(self) -> bool:
        """One round: free the slots of cancelled requests, start waiting ones in free slots, then one step
        call. Whether it stepped (False: nothing is running)."""
        for slot, request in enumerate(self.active):
            if request is not None and request.cancelled:
                self._finish(slot, "cancelled")
        self._drop_cancelled()
        self._admit()
        if not any(r is not None for r in self.active):
            return False
        try:
            self._step()
        except Exception as e:  # a failed program: every running request ends with the reason
            log.exception("a step failed; ending the %d running requests", sum(r is not None for r in self.active))
            for slot, request in enumerate(self.active):
                if request is not None:
                    self._finish(slot, "error", error=_reason(e))
            self._recover()
        return True

    def _drop_cancelled(self) -> None:
        """Waiting requests whose client left go now, not when a slot frees: while every slot is busy they would
        pile up past --max-queue (each holding its prompt)."""
        with self.lock:
            if not any(r.cancelled for r in self.waiting):
                return
            gone = [r for r in self.waiting if r.cancelled]
            self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
        for request in gone:
            request.finish = "cancelled"
        self.cancelled += len(gone)

    def _admit(self) -> None:
        """Free slots take waiting requests: each prompt's prefill, and its first token."""
        for slot in range(self.engine.slots):
            while self.active[slot] is None and not self.problem:
                with self.lock:
                    if not self.waiting:
                        return
                    request = self.waiting.popleft()
                if request.cancelled:
                    self.cancelled += 1
                    continue
                if not self._scored(request) or request.max_tokens == 0:  # failed, or nothing to generate
                    continue
                self.active[slot] = request
                request.decoder = self.tok.stream(request.prompt)
                try:
                    picked = self.engine.start(slot, request.prompt, request.temperature, request.top_k,
                                               request.top_p)
                except Exception as e:
                    log.exception("the prefill of a %d-token prompt failed", len(request.prompt))
                    self._finish(slot, "error", error=_reason(e))
                    self._recover()
                    continue
                self.index[slot], self.last[slot] = len(request.prompt), picked.tokens
                self._took(slot, picked.tokens, picked.logprobs, picked.top_ids, picked.top_logprobs)
        if self.problem:  # nothing can start: those waiting are answered now, not left hanging
            self._end_all(self.problem)

    def _scored(self, request: Request) -> bool:
        """A request's prompt scored where it asks (its first piece), and one that generates nothing answered;
        False where it failed (answered with the reason)."""
        try:
            if request.score_prompt:
                request.emit(Piece("", [], prompt=self.engine.score(request.prompt)))
        except Exception as e:
            log.exception("scoring a %d-token prompt failed", len(request.prompt))
            request.finish, self.failed = "error", self.failed + 1
            request.emit(Piece("", [], "error", _reason(e)))
            return False
        if request.max_tokens == 0:
            request.finish, self.served = "length", self.served + 1
            request.emit(Piece("", [], "length"))
        return True

    def _end_all(self, reason: str) -> None:
        for slot, request in enumerate(self.active):
            if request is not None:
                self._finish(slot, "error", error=reason)
        with self.lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for request in waiting:
            request.finish = "error"
            request.emit(Piece("", [], "error", reason))
        self._recover()

    def _recover(self) -> None:
        """After a failure: the requests still in the cache go on where it survived; else they end, and a fresh
        cache is made (or, failing that, the engine is unhealthy)."""
        if self.problem or self.engine.intact():
            return
        for slot, request in enumerate(self.active):
            if request is not None:
                self._finish(slot, "error", error="the model's cache was lost to another request's failure")
        try:
            self.engine.allocate()
            log.warning("the cache was lost to a failed program and was made again")
        except Exception as e:
            self.problem = f"the model's cache could not be made again after a failure: {_reason(e)}"
            log.exception(self.problem)

    def _step(self) -> None:
        settings = self.engine.settings(self.engine.slots)
        running = [(slot, r) for slot, r in enumerate(self.active) if r is not None]
        for slot, request in running:
            settings[0][slot], settings[1][slot], settings[2][slot] = (request.temperature, request.top_k,
                                                                       request.top_p)
        steps = self._burst(running)
        picked = self.engine.advance(self.last, self.index, *settings, steps=steps, active=[s for s, _ in running],
                                     logprobs=any(r.logprobs is not None for _, r in running))
        for slot, request in running:
            for i in range(steps):
                if self.active[slot] is not request:  # ended within this burst
                    break
                self.index[slot] += 1
                self.last[slot] = picked.tokens[slot, i]
                self._took(slot, picked.tokens[slot, i], picked.logprobs[slot, i], picked.top_ids[slot, i],
                           picked.top_logprobs[slot, i])

    def _burst(self, running) -> int:
        """Several tokens per call while no request waits for a slot and every running one needs them all."""
        burst = self.engine.burst
        if burst == 1 or self.waiting:
            return 1
        for slot, request in running:
            left = min(request.max_tokens - len(request.tokens), self.engine.context - int(self.index[slot]))
            if left < burst:
                return 1
        return burst

    def _took(self, slot: int, token, logprob, top_ids, top_logprobs) -> None:
        """A slot's request gets `token`: its new text goes out, unless it ends the request."""
        request, token = self.active[slot], int(token)
        ends = token in self.ends
        piece = "" if ends else request.decoder.add(token)
        if request.logprobs is not None:  # an end token's too: an answer that ends at once still has its logprobs
            top = [(int(i), float(lp)) for i, lp in zip(top_ids[:request.logprobs], top_logprobs[:request.logprobs])]
            request.unsent.append(Token(token, piece, float(logprob), top))
        if ends:
            return self._finish(slot, "stop")
        request.tokens.append(token)
        text = request.held + piece
        hits = [i for i in (text.find(s) for s in request.stop) if i >= 0]
        if hits:  # sent text never ends in a stop string's beginning, so a stop lies wholly in `text`
            request.held = ""
            request.unsent = _before_cut(request.unsent, len(text) - min(hits))
            return self._finish(slot, "stop", text[:min(hits)])
        if len(request.tokens) >= request.max_tokens or self.index[slot] >= self.engine.context:
            request.held = ""
            return self._finish(slot, "length", text + request.decoder.flush())
        ready = len(text) - held_back(text, request.stop)
        request.held = text[ready:]
        if ready:
            request.emit(Piece(text[:ready], self._unsent(request, keep=len(request.held))))

    @staticmethod
    def _unsent(request: Request, keep: int = 0) -> list[Token]:
        """The tokens not yet sent whose text goes out now: all but those ending in the `keep` characters held
        back (their log-probabilities go with the chunk that carries their text)."""
        left = sum(len(t.text) for t in request.unsent)
        out = 0
        while out < len(request.unsent) and left - len(request.unsent[out].text) >= keep:
            left -= len(request.unsent[out].text)
            out += 1
        tokens, request.unsent = request.unsent[:out], request.unsent[out:]
        return tokens

    def _finish(self, slot: int, reason: str, text: str | None = None, error: str | None = None) -> None:
        request = self.active[slot]
        request.finish = reason
        if reason == "cancelled":
            self.cancelled += 1
        elif reason == "error":
            self.failed += 1
            request.emit(Piece("", [], reason, error))
        else:
            text = request.held + request.decoder.flush() if text is None else text
            request.emit(Piece(text, self._unsent(request), reason))
        self.active[slot], self.index[slot], self.last[slot] = None, 0, 0
        self.served += reason not in ("error", "cancelled")


def _before_cut(tokens: list[Token], cut: int) -> list[Token]:
    """`tokens` less those wholly within the last `cut` characters of their text (a stop string and what follows
    it): the log-probabilities reported are those of the tokens whose text is returned, whole or in part."""
    end = sum(len(t.text) for t in tokens) - cut
    kept, at = [], 0
    for token in tokens:
        if at >= end:
            break
        kept.append(token)
        at += len(token.text)
    return kept


def _reason(error: Exception) -> str:
    """An exception as one line for a client: its kind and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
