"""What one row of a documents corpus becomes before tokenizing: pieces of text, each trained on or not.

- A document (`data.field` holds text): one piece, trained.
- A prompt/completion pair (`data.prompt_field` and `data.completion_field`): the prompt, not trained, then
  the completion, trained; the EOS after it is trained too (the model learns where an answer ends).
- A chat (`data.field` holds a list of {role, content} messages, as `messages` does in most chat sets):
  rendered with the tokenizer's chat template (`chat_template` in its tokenizer_config.json) where it has
  one, else with the plain template below; only the assistant's turns are trained.

A chat template renders a whole conversation as one string; which characters belong to an assistant turn is
learnt by rendering the conversation one message longer at a time: the characters that message i adds (after
the generation prompt, for an assistant turn) are its own. A template that does not render a conversation as
a prefix of the conversation one message longer is refused in one line.

The plain template, for tokenizers without one (the byte-level vocabulary among them):

    <role>: <content>\\n          for each system or user message
    assistant: <content>\\n       the content and its newline trained, "assistant: " not
"""

import json
from functools import lru_cache

from shard.errors import UserError

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's, which chat sets use


def columns(cfg) -> tuple[str, ...]:
    """The columns a row is read from: (prompt, completion), or the one `data.field`."""
    if bool(cfg.prompt_field) != bool(cfg.completion_field):
        given = "data.prompt_field" if cfg.prompt_field else "data.completion_field"
        raise UserError(f"{given} is set alone: prompt/completion rows need both data.prompt_field and "
                        "data.completion_field (or neither, for documents and chats in data.field)")
    return (cfg.prompt_field, cfg.completion_field) if cfg.prompt_field else (cfg.field,)


class Formatter:
    """Row values (a tuple, one per column) -> [(text, trained)], for one tokenizer (its chat template,
    its BOS text)."""

    def __init__(self, names: tuple[str, ...], tokenizer_spec: str | None):
        self.names = names
        self.template = chat_template(tokenizer_spec)
        self.tokens = special_tokens(tokenizer_spec)

    def pieces(self, values: tuple, where: str) -> list[tuple[str, bool]]:
        if len(values) == 2:
            prompt, completion = (text_value(v, describe((n,), self.names), where) for v, n in zip(values, self.names))
            return [(prompt, False), (completion, True)] if completion else []
        value = values[0]
        if isinstance(value, (list, tuple)):
            return self.chat(_messages(value, self.names[0], where), where)
        return [(text_value(value, describe(self.names), where), True)]

    def chat(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        if self.template is None:
            return [piece for m in messages for piece in plain(m)]
        pieces, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = self.render(messages[:i], True, where)
                _check_prefix(done, prompt, where)
                pieces.append((prompt[len(done):], False))
                done = prompt
            whole = self.render(messages[:i + 1], False, where)
            _check_prefix(done, whole, where)
            pieces.append((whole[len(done):], message["role"] == "assistant"))
            done = whole
        return [(text, trained) for text, trained in pieces if text]

    def prompt(self, messages: list[dict]) -> str:
        """The conversation so far, ready for the assistant's next turn (as a server or generate feeds it)."""
        checked = _messages(messages, "messages", "messages")
        if self.template is None:
            return "".join(text for m in checked for text, _ in plain(m)) + "assistant: "
        return self.render(checked, True, "messages")

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.tokens)
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception
            raise UserError(f"{where}: the tokenizer's chat template failed on this conversation: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def plain(message: dict) -> list[tuple[str, bool]]:
    if message["role"] == "assistant":
        return [("assistant: ", False), (message["content"] + "\n", True)]
    return [(f"{message['role']}: {message['content']}\n", False)]


def _check_prefix(done: str, longer: str, where: str) -> None:
    if not longer.startswith(done):
        raise UserError(f"{where}: the tokenizer's chat template does not render a conversation as the start of the "
                        "same conversation one message longer, so the assistant's turns cannot be told apart")


def text_value(value, name: str, where: str) -> str:
    """A column's value as text (a missing value is empty); anything else is one line."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: {name} is a {type(value).__name__}, not text")
    return value


def _messages(value, field: str, where: str) -> list[dict]:
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise UserError(f"{where}: {field!r} holds a list, so it is read as a chat, but an item is not a "
                            "{\"role\": ..., \"content\": ...} message with text in both")
        if message["role"] not in ROLES:
            raise UserError(f"{where}: message role {message['role']!r}; the roles are {', '.join(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _config(spec: str | None) -> dict:
    from shard.data import tokenizer as tokenizer_lib

    if spec in (None, "bytes"):
        return {}
    path = tokenizer_lib.tokenizer_file(spec).parent / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def chat_template(spec: str | None):
    """The tokenizer's chat template (a jinja2 template in a sandbox: rendering it runs no Python of the
    file's), or None where it has none."""
    source = _config(spec).get("chat_template")
    if isinstance(source, list):  # several named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    return _compiled(source, spec) if isinstance(source, str) else None


@lru_cache(maxsize=8)
def _compiled(source: str, spec: str | None):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise UserError(f"data.tokenizer={spec!r}: its chat_template is not a valid template ({e})") from None


def special_tokens(spec: str | None) -> dict:
    """bos_token and eos_token as a chat template names them (text, or '' where the tokenizer has none)."""
    from shard.data import tokenizer as tokenizer_lib

    named = {} if spec in (None, "bytes") else \
        tokenizer_lib.config_tokens(tokenizer_lib.tokenizer_file(spec).parent / "tokenizer_config.json")
    return {key: named.get(key, "") for key in ("bos_token", "eos_token")}


def render_prompt(messages: list[dict], tokenizer_spec: str | None) -> str:
    """A conversation ready for the assistant's next turn: what a server or generate feeds the model."""
    return Formatter(("messages",), tokenizer_spec).prompt(messages)


def describe(names: tuple[str, ...], of: tuple[str, ...] | None = None) -> str:
    """How the config names these columns (some of `of`, the columns a row is read from): data.field=..., or
    data.prompt_field=... and data.completion_field=..."""
    of = of or names
    keys = ("data.prompt_field", "data.completion_field") if len(of) == 2 else ("data.field",)
    return " and ".join(f"{keys[of.index(n)]}={n!r}" for n in names)
