"""The OpenAI request and response shapes the server speaks (the subset client libraries use): requests
checked field by field, so that a bad one gets a 400 naming its field; responses and stream chunks as dicts.
Fields that change no answer (user, seed, metadata, ...) are accepted and ignored; one that would change the
answer and that this server does not act on (penalties, logit_bias, best_of, tools, ...) is refused by name, not
silently dropped.

Completions take what evaluation clients send (lm-evaluation-harness's `local-completions`): `prompt` as a string,
a list of strings, a list of token ids or a list of token-id lists, each prompt answered as one choice (index
order); `echo: true` puts the prompt before the answer, its tokens' log-probabilities (the first null) before the
answer's under `logprobs`, and `max_tokens: 0` then answers with the prompt alone. As OpenAI's completions do,
`top_logprobs` always holds the chosen token (up to logprobs + 1 entries); special tokens are keyed by their text."""

import json
import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


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
                "best_of": 1, "suffix": None, "tools": None, "functions": None,
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


PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


class Completion(Sampled):
    prompt: Any  # PROMPT_SHAPES, checked by `_prompts` (a union's own errors name a shape, not what is wrong)
    max_tokens: int | None = Field(None, ge=0)  # 0: the prompt alone, with echo
    logprobs: int | None = Field(None, ge=0, le=5)  # the likeliest alternatives per token (OpenAI's limit: 5)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt):
        """The prompts: a list of strings or of token-id lists, one per choice."""
        ids = lambda p: isinstance(p, list) and all(type(t) is int for t in p)  # noqa: E731  (bool is no id)
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return prompt
            if ids(prompt):
                return [prompt]
            if all(ids(p) for p in prompt):
                return prompt
        what = "an empty list" if prompt == [] else f"a JSON {type(prompt).__name__}"
        if isinstance(prompt, list) and prompt:
            what = "a list mixing shapes or holding other values"
        raise ValueError(f"give {PROMPT_SHAPES} (got {what})")

    @model_validator(mode="after")
    def _nothing_asked(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 answers nothing without echo: true; ask for at least 1 token")
        return self


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


def completion(rid: str, model: str, text: str, finish: str | None, chunk: bool = False, logprobs=None,
               index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat(rid: str, model: str, text: str, finish: str | None, chunk: bool = False, first: bool = False,
         logprobs=None, index: int = 0) -> dict:
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
    tokens before it (a SentencePiece token keeps its leading space); a special token's is its own text (an end
    token's too, which the answer's text leaves out). A completion's alternatives hold the chosen token."""

    def __init__(self, tokenizer, prompt: list[int], is_chat: bool):
        self.tok, self.context, self.is_chat, self.offset = tokenizer, list(prompt[-4:]), is_chat, 0
        self.special = getattr(tokenizer, "special_text", lambda token: None)

    def _text(self, token: int) -> str:
        return self.special(token) or self.tok.continuation(self.context, [token])

    def echoed(self, prompt: list[int], scored, alternatives: int) -> dict:
        """The prompt's own tokens as a completion's `logprobs` lists (the first token's log-probability and
        alternatives null: nothing comes before it), `scored` its shard/use/score.py Scored; the answer's offsets
        then follow the prompt's text."""
        self.context, out = [], {"tokens": [], "token_logprobs": [None], "top_logprobs": [None], "text_offset": []}
        for i, token in enumerate(prompt):
            plain = self.tok.continuation(self.context, [token])
            out["tokens"].append(self.special(token) or plain)
            out["text_offset"].append(self.offset)
            self.offset += len(plain)
            if i:
                lp = float(scored.logprobs[i - 1])
                top = [(int(t), float(v)) for t, v in zip(scored.top_ids[i - 1][:alternatives],
                                                          scored.top_logprobs[i - 1][:alternatives])]
                out["token_logprobs"].append(lp)
                out["top_logprobs"].append(self._top(token, lp, top))
            self.context = (self.context + [token])[-4:]
        return out

    def _top(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        """A completion token's alternatives by text, the chosen token among them (OpenAI's logprobs + 1)."""
        if all(i != token for i, _ in top):
            top = [*top, (token, logprob)]
        return _first_of_each([(self._text(i), lp) for i, lp in top])

    def of(self, tokens) -> dict:
        if self.is_chat:
            entries = []
            for t in tokens:
                entries.append((self.special(t.id) or t.text, t.logprob, [(self._text(i), lp) for i, lp in t.top]))
                self.context = (self.context + [t.id])[-4:]
            entry = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return {"content": [{**entry(text, lp), "top_logprobs": [entry(*alt) for alt in top]}
                                for text, lp, top in entries], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            out["tokens"].append(self.special(t.id) or t.text)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append(self._top(t.id, t.logprob, t.top))
            out["text_offset"].append(self.offset)
            self.offset += len(t.text)
            self.context = (self.context + [t.id])[-4:]
        return out


def _first_of_each(top: list[tuple[str, float]]) -> dict:
    """The alternatives by text, the likelier kept where two ids decode alike (the format's keys are texts)."""
    out = {}
    for text, lp in top:
        out.setdefault(text, lp)
    return out


def event(data) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
