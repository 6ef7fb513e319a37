"""The OpenAI request and response shapes the server speaks (the subset client libraries use): requests
checked field by field, so that a bad one gets a 400 naming its field; responses and stream chunks as dicts.
Fields that change no answer (user, seed, metadata, ...) are accepted and ignored; one that would change the
answer and that this server does not act on (penalties, logit_bias, echo, tools, ...) is refused by name, not
silently dropped."""

import json
import time
import uuid
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class BadRequest(Exception):
    """A request the server will not run: HTTP 400 (or `status`), its JSON error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


MAX_STOPS = 4  # OpenAI's limit on `stop`


# fields that change an answer, and the value this server gives them (any other is refused)
NOT_ACTED_ON = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
                "echo": False, "best_of": 1, "suffix": None, "tools": None, "functions": None,
                "response_format": None, "min_tokens": 0}


class Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # not OpenAI's, but vLLM's and TGI's: 0 keeps all tokens
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the token counts

    @model_validator(mode="before")
    @classmethod
    def _acted_on(cls, body):
        for key, default in NOT_ACTED_ON.items():
            value = body.get(key) if isinstance(body, dict) else None
            if value not in (None, default, {}, []) and not (key == "response_format" and value == {"type": "text"}):
                raise ValueError(f"{key}={value!r} is not supported by this server (it takes {default!r}); leave "
                                 "it out")
        return body

    def streamed_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)


class Completion(Sampled):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)  # the likeliest alternatives per token (OpenAI's limit: 5)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class Chat(Sampled):
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


def parse(raw: bytes, shape: type[BaseModel]):
    """The request body as `shape`, or BadRequest naming what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}", "body") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", "body")
    try:
        return shape.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        field = ".".join(str(part) for part in error["loc"]) or message.split("=")[0].split(" ")[0]
        raise BadRequest(f"{field}: {message}", field.split(".")[0]) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish: str | None, chunk: bool = False, logprobs=None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat(rid: str, model: str, text: str, finish: str | None, chunk: bool = False, first: bool = False,
         logprobs=None) -> dict:
    """A whole answer, or (chunk) one piece of a stream: its delta, the first carrying the role."""
    if chunk:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice]}


class Logprobs:
    """A request's answer tokens as `logprobs` shows them: the completions' lists (tokens, token_logprobs,
    top_logprobs, text_offset) or the chat's `content` entries. An alternative's text is decoded after the
    tokens before it (a SentencePiece token keeps its leading space)."""

    def __init__(self, tokenizer, prompt: list[int], is_chat: bool):
        self.tok, self.context, self.is_chat, self.offset = tokenizer, list(prompt[-4:]), is_chat, 0

    def _text(self, token: int) -> str:
        return self.tok.continuation(self.context, [token])

    def of(self, tokens) -> dict:
        entries = []
        for t in tokens:
            top = [(self._text(i), lp) for i, lp in t.top]
            entries.append((t.text, t.logprob, top))
            self.context = (self.context + [t.id])[-4:]
        if self.is_chat:
            entry = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return {"content": [{**entry(text, lp), "top_logprobs": [entry(*alt) for alt in top]}
                                for text, lp, top in entries], "refusal": None}
        offsets = []
        for text, _, _ in entries:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": [text for text, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [_first_of_each(top) for _, _, top in entries],
                "text_offset": offsets}


def _first_of_each(top: list[tuple[str, float]]) -> dict:
    """The alternatives by text, the likelier kept where two ids decode alike (the format's keys are texts)."""
    out = {}
    for text, lp in top:
        out.setdefault(text, lp)
    return out


def event(data) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
