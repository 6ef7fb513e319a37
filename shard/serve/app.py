"""The HTTP side: FastAPI routes in OpenAI's shapes over the scheduler. Handlers only check, tokenize, queue
and relay; the engine thread does the model's work (shard/serve/scheduler.py)."""

import asyncio
import contextlib

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shard.serve import chat, protocol
from shard.serve.protocol import BadRequest
from shard.serve.scheduler import QueueFull, Request, Scheduler

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat: up to the context
RETRY_AFTER_S = 1


def build(scheduler: Scheduler, tokenizer, template, name: str, capacity: int) -> FastAPI:
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
        return {"status": "ok", "model": name, **scheduler.counts()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "shard",
                                            "max_model_len": capacity}]}

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = protocol.parse(await http.body(), protocol.Completion)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest(f"prompt: {len(prompt)} prompts; this server takes one per request", "prompt")
            prompt = prompt[0]
        tokens = tokenizer.prompt(prompt) if isinstance(prompt, str) else list(prompt)
        return await answer(http, body, tokens, "prompt", body.max_tokens or COMPLETION_DEFAULT_TOKENS,
                            protocol.completion, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body = protocol.parse(await http.body(), protocol.Chat)
        try:
            tokens = template([m.model_dump() for m in body.messages])
        except chat.Refused as e:
            raise BadRequest(f"messages: the chat template refused them: {e}", "messages") from None
        return await answer(http, body, tokens, "messages", body.max_tokens or body.max_completion_tokens,
                            protocol.chat, "chatcmpl")

    async def answer(http, body, tokens: list[int], field: str, max_tokens: int | None, shape, prefix: str):
        if body.model is not None and body.model != name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {name!r}", "model")
        if not tokens:
            raise BadRequest(f"{field}: empty; give at least one token", field)
        if any(not 0 <= t < tokenizer.vocab_size for t in tokens):
            raise BadRequest(f"{field}: token ids must be in [0, {tokenizer.vocab_size})", field)
        room = capacity - len(tokens)
        if room < 1:
            raise BadRequest(f"{field}: {len(tokens)} tokens; the model's context is {capacity}", field)
        max_tokens = room if max_tokens is None else max_tokens
        if max_tokens > room:
            raise BadRequest(f"max_tokens {max_tokens}: with the prompt's {len(tokens)} tokens it passes the model's "
                             f"context of {capacity}; at most {room}", "max_tokens")
        request = Request(tokens, max_tokens, body.temperature, body.top_k, body.top_p, body.stops(),
                          loop=asyncio.get_running_loop())
        try:
            scheduler.submit(request)
        except QueueFull as full:
            raise BadRequest(f"the server is busy: {full}; retry after {RETRY_AFTER_S} s", None, 503) from None
        rid = protocol.new_id(prefix)
        if body.stream:
            return StreamingResponse(streamed(request, rid, shape, body.streamed_usage()),
                                     media_type="text/event-stream")
        text, finish = await answered(request, http)
        if finish is None:  # the client went away: no one to answer (nginx's 499)
            return Response(status_code=499)
        if finish == "error":
            raise BadRequest("the model failed on this request (the server log says why)", None, 500)
        return {**shape(rid, name, text, finish), "usage": protocol.usage(len(tokens), len(request.tokens))}

    async def answered(request: Request, http: HttpRequest) -> tuple[str, str | None]:
        """The whole answer and why it ended; (so far, None) if the client leaves first, its slot then freed."""
        left = asyncio.ensure_future(gone(http))
        text = ""
        try:
            while True:
                piece = asyncio.ensure_future(request.events.get())
                await asyncio.wait((piece, left), return_when=asyncio.FIRST_COMPLETED)
                if not piece.done():
                    piece.cancel()
                    return text, None
                delta, finish = piece.result()
                text += delta
                if finish:
                    return text, finish
        finally:
            left.cancel()
            release(request)

    async def streamed(request: Request, rid: str, shape, with_usage: bool):
        try:
            first = True
            while True:
                delta, finish = await request.events.get()
                if delta or finish:
                    chunk = {"first": first} if shape is protocol.chat else {}
                    yield protocol.event(shape(rid, name, delta, finish, chunk=True, **chunk))
                    first = False
                if finish:
                    break
            if with_usage:  # OpenAI's shape: no choices, the counts
                last = {**shape(rid, name, "", None, chunk=True), "choices": []}
                yield protocol.event({**last, "usage": protocol.usage(len(request.prompt), len(request.tokens))})
            yield protocol.event("[DONE]")
        finally:  # also when the client went away: its slot is freed at the next step
            release(request)

    def release(request: Request) -> None:
        if request.finish is None:
            request.cancelled = True
            scheduler.wake.set()

    return app


async def gone(http: HttpRequest) -> None:
    """Returns once the client has disconnected (the body is read: all the server can hear is that)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
