"""The HTTP side: FastAPI routes in OpenAI's shapes over the scheduler. Handlers only check, tokenize, queue
and relay; the engine thread does the model's work (shard/server/scheduler.py). A body is read up to a limit
(413 past it), and parsing and tokenizing run off the event loop, so one large request cannot stall the
others' streams."""

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shard.data import tokenizer as tokenizer_lib
from shard.server import chat, protocol
from shard.server.protocol import BadRequest
from shard.server.scheduler import Piece, QueueFull, Request, Scheduler, Unhealthy

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat: up to the context
RETRY_AFTER_S = 1
MAX_BODY = 8 * 2**20  # bytes of a request body, by default

log = logging.getLogger("shard.serve")


def build(scheduler: Scheduler, tokenizer, template, name: str, capacity: int, max_body: int = MAX_BODY,
          embedded: int | None = None) -> FastAPI:
    """The app. `embedded`: the tokens the model embeds where its tokenizer holds more (gemma-3's image
    tokens): a prompt holding one is refused, where JAX's gather would read another token's row."""
    embedded = tokenizer.vocab_size if embedded is None else embedded

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()  # uvicorn has stopped taking requests and waited for the running ones

    app = FastAPI(title="shard.serve", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def refused(_, error: BadRequest):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.get("/health")
    async def health():
        problem = scheduler.unhealthy()
        body = {"status": "unhealthy" if problem else "ok", "model": name, **scheduler.counts(),
                **({"reason": problem} if problem else {})}
        return JSONResponse(body, status_code=503 if problem else 200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "shard",
                                            "max_model_len": capacity}]}

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body, prompts = await asyncio.to_thread(completion_tokens, await read(http))
        return await answer(http, body, prompts, "prompt",
                            COMPLETION_DEFAULT_TOKENS if body.max_tokens is None else body.max_tokens,
                            protocol.completion, "cmpl", body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body, tokens = await asyncio.to_thread(chat_tokens, await read(http))
        alternatives = (body.top_logprobs or 0) if body.logprobs else None
        return await answer(http, body, [(None, tokens)], "messages", body.max_tokens or body.max_completion_tokens,
                            protocol.chat, "chatcmpl", alternatives)

    async def read(http: HttpRequest) -> bytes:
        """The body, refused (413) as soon as it passes `max_body` bytes: before it is read whole."""
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body:
            raise BadRequest(f"the body is {int(declared)} bytes; this server takes at most {max_body} "
                             "(python -m shard.serve --max-body)", "body", 413)
        parts, size = [], 0
        async for part in http.stream():
            size += len(part)
            if size > max_body:
                raise BadRequest(f"the body passes {max_body} bytes, the most this server takes (python -m "
                                 "shard.serve --max-body)", "body", 413)
            parts.append(part)
        return b"".join(parts)

    def completion_tokens(raw: bytes):
        """The body and its prompts, each (its text where given as one, its tokens)."""
        body = protocol.parse(raw, protocol.Completion)
        if len(body.prompt) > scheduler.max_queue:
            raise BadRequest(f"prompt: {len(body.prompt)} prompts; this server queues at most "
                             f"{scheduler.max_queue} (python -m shard.serve --max-queue)", "prompt")
        prompts = []
        for i, prompt in enumerate(body.prompt):
            field = "prompt" if len(body.prompt) == 1 else f"prompt[{i}]"
            tokens = tokenizer.prompt(prompt) if isinstance(prompt, str) else list(prompt)
            if any(not 0 <= t < tokenizer.vocab_size for t in tokens):  # here, off the event loop: ids can be many
                raise BadRequest(f"{field}: token ids must be in [0, {tokenizer.vocab_size})", "prompt")
            prompts.append((prompt if isinstance(prompt, str) else None, embeddable(tokens, field, "prompt")))
        return body, prompts

    def embeddable(tokens: list[int], field: str, param: str | None = None) -> list[int]:
        if wrong := tokenizer_lib.unembedded(tokenizer, tokens, embedded):
            raise BadRequest(f"{field}: {wrong}", param or field)
        return tokens

    def chat_tokens(raw: bytes):
        body = protocol.parse(raw, protocol.Chat)
        try:
            tokens = template([m.model_dump() for m in body.messages])
        except chat.Refused as e:
            raise BadRequest(f"messages: the chat template refused them: {e}", "messages") from None
        except chat.Broken as e:  # the template's own bug: the operator's to fix, so it is logged
            log.error("the chat template failed: %s", e)
            raise BadRequest(f"the server's chat template failed on these messages: {e}", None, 500) from None
        return body, embeddable(tokens, "messages")

    async def answer(http, body, prompts: list[tuple[str | None, list[int]]], field: str, max_tokens: int | None,
                     shape, prefix: str, alternatives: int | None):
        """Each prompt (its text where given as one, its tokens) answered as one choice, in their order."""
        if body.model is not None and body.model != name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {name!r}", "model")
        echo = getattr(body, "echo", False)
        requests = []
        for i, (_, tokens) in enumerate(prompts):
            where = field if len(prompts) == 1 else f"{field}[{i}]"
            if not tokens:
                raise BadRequest(f"{where}: empty; give at least one token", field)
            room = capacity - len(tokens)
            if room < (0 if echo else 1):
                raise BadRequest(f"{where}: {len(tokens)} tokens; this server's context is {capacity} tokens "
                                 "(prompt and answer)", field)
            asked = room if max_tokens is None else max_tokens
            if asked > room:
                raise BadRequest(f"max_tokens {asked}: with the {where}'s {len(tokens)} tokens it passes this "
                                 f"server's context of {capacity}; at most {room}", "max_tokens")
            requests.append(Request(tokens, asked, body.temperature, body.top_k, body.top_p, body.stops(),
                                    alternatives, loop=asyncio.get_running_loop(),
                                    score_prompt=echo and alternatives is not None))
        try:
            scheduler.submit(*requests)
        except QueueFull as full:
            raise BadRequest(f"the server is busy: {full}; retry after {RETRY_AFTER_S} s", None, 503) from None
        except Unhealthy as sick:
            raise BadRequest(f"the server cannot run requests: {sick}", None, 503) from None
        rid = protocol.new_id(prefix)
        choices = [Choice(request, i, text, tokenizer, shape is protocol.chat, echo, alternatives)
                   for i, (request, (text, _)) in enumerate(zip(requests, prompts))]
        if body.stream:
            return StreamingResponse(streamed(choices, rid, shape, body.streamed_usage()),
                                     media_type="text/event-stream")
        try:
            answers = []
            for choice in choices:
                pieces = await answered(choice.request, http)
                if pieces is None:  # the client went away: no one to answer (nginx's 499)
                    return Response(status_code=499)
                if pieces[-1].finish == "error":
                    raise BadRequest(f"the model failed on this request: {pieces[-1].error}", None, 500)
                text, finish, given = choice.whole(pieces)
                answers.append(shape(rid, name, text, finish, logprobs=given, index=choice.index)["choices"][0])
        finally:
            for request in requests:
                release(request)
        return {**shape(rid, name, "", None), "choices": answers,
                "usage": protocol.usage(sum(len(r.prompt) for r in requests), sum(len(r.tokens) for r in requests))}

    async def answered(request: Request, http: HttpRequest) -> list[Piece] | None:
        """The answer's pieces, the last with its finish reason; None if the client leaves first (its slot
        then freed)."""
        left = asyncio.ensure_future(gone(http))
        pieces = []
        try:
            while True:
                piece = asyncio.ensure_future(request.events.get())
                await asyncio.wait((piece, left), return_when=asyncio.FIRST_COMPLETED)
                if not piece.done():
                    piece.cancel()
                    return None
                pieces.append(piece.result())
                if pieces[-1].finish:
                    return pieces
        finally:
            left.cancel()

    async def streamed(choices: list, rid: str, shape, with_usage: bool):
        """Each choice's chunks in turn (all run at once: those after the first wait in their queues)."""
        try:
            for choice in choices:
                first, request = True, choice.request
                while True:
                    piece = await request.events.get()
                    if piece.finish == "error":  # OpenAI's error object, in the stream
                        yield protocol.event(BadRequest(f"the model failed on this request: {piece.error}", None,
                                                        500).body())
                        return
                    text, given = choice.part(piece)
                    if text or piece.finish or given:
                        chunk = {"first": first} if shape is protocol.chat else {}
                        yield protocol.event(shape(rid, name, text, piece.finish, chunk=True, logprobs=given,
                                                   index=choice.index, **chunk))
                        first = False
                    if piece.finish:
                        break
            if with_usage:  # OpenAI's shape: no choices, the counts
                last = {**shape(rid, name, "", None, chunk=True), "choices": []}
                yield protocol.event({**last, "usage": protocol.usage(sum(len(c.request.prompt) for c in choices),
                                                                      sum(len(c.request.tokens) for c in choices))})
            yield protocol.event("[DONE]")
        finally:  # also when the client went away: its slot is freed at the next step
            for choice in choices:
                release(choice.request)

    def release(request: Request) -> None:
        if request.finish is None:
            request.cancelled = True
            scheduler.wake.set()

    return app


class Choice:
    """One prompt's answer as its choice shows it: with echo, the prompt's text first (as given, or its tokens
    decoded) and, with logprobs, its tokens' before the answer's."""

    def __init__(self, request: Request, index: int, text: str | None, tokenizer, is_chat: bool, echo: bool,
                 alternatives: int | None):
        self.request, self.index, self.echo, self.alternatives = request, index, echo, alternatives
        self.prompt_text = (text if text is not None else tokenizer.decode(request.prompt)) if echo else ""
        self.logprobs = protocol.Logprobs(tokenizer, request.prompt, is_chat) if alternatives is not None else None

    def part(self, piece: Piece) -> tuple[str, dict | None]:
        """A piece's text and logprobs; the prompt's come with the first (a scored prompt's piece)."""
        text, given = piece.text, None
        if self.echo and self.prompt_text is not None:
            text, self.prompt_text = self.prompt_text + text, None
        if piece.prompt is not None:
            given = self.logprobs.echoed(self.request.prompt, piece.prompt, self.alternatives)
        if self.logprobs is not None and piece.tokens:
            more = self.logprobs.of(piece.tokens)
            given = more if given is None else {k: given[k] + more[k] for k in given}
        return text, given

    def whole(self, pieces: list[Piece]) -> tuple[str, str, dict | None]:
        """The whole answer: its text, its finish reason and its logprobs."""
        text, given = (self.prompt_text or "") + "".join(p.text for p in pieces), None
        if self.logprobs is not None:
            scored = next((p.prompt for p in pieces if p.prompt is not None), None)
            echoed = None if scored is None else self.logprobs.echoed(self.request.prompt, scored, self.alternatives)
            given = self.logprobs.of([t for p in pieces for t in p.tokens])
            if echoed is not None:  # echo: a completion's lists, the prompt's first
                given = {k: echoed[k] + given[k] for k in given}
        return text, pieces[-1].finish, given


async def gone(http: HttpRequest) -> None:
    """Returns once the client has disconnected (the body is read: all the server can hear is that)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
