"""The OpenAI request and response shapes the server speaks (the subset client libraries use): requests
checked field by field, so that a bad one gets a 400 naming its field; responses and stream chunks as dicts.
Fields this server does not act on (logprobs, presence_penalty, user, ...) are accepted and ignored."""

import json
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class BadRequest(Exception):
    """A request the server will not run: HTTP 400 (or `status`), its JSON error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


class Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # not OpenAI's, but vLLM's and TGI's: 0 keeps all tokens
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the token counts

    def streamed_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)


class Completion(Sampled):
    prompt: str | list[str] | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class Chat(Sampled):
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    messages: list[Message] = Field(min_length=1)


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
        field = ".".join(str(part) for part in error["loc"]) or "body"
        raise BadRequest(f"{field}: {error['msg']}", field.split(".")[0]) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish: str | None, chunk: bool = False) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat(rid: str, model: str, text: str, finish: str | None, chunk: bool = False, first: bool = False) -> dict:
    """A whole answer, or (chunk) one piece of a stream: its delta, the first carrying the role."""
    if chunk:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice]}


def event(data) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
