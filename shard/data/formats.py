"""What one row of a documents corpus becomes before tokenizing: one text, the character spans of it that
are trained on, and whether the tokenizer's special tokens (BOS) go around it. A row is tokenized whole, as
transformers tokenizes it, so a prompt's last token may merge with its completion's first; a token is trained
where its characters overlap a trained span (one that straddles the boundary counts as the completion's).

- A document (`data.field` holds text): the text, all trained, with the tokenizer's special tokens.
- A prompt/completion pair (`data.prompt_field` and `data.completion_field`): prompt + completion, as
  `tokenizer(prompt + completion)` tokenizes it, the completion trained; the EOS after it is trained too
  (the model learns where an answer ends).
- A chat (`data.field` holds a list of {role, content} messages, as `messages` does in most chat sets):
  rendered with the tokenizer's chat template (shard/data/chat_template.py) where it has one, tokenized
  without special tokens (the template writes them), as `apply_chat_template(tokenize=True)` does; the
  assistant's turns trained. Which characters those are: the template's `{% generation %}` blocks where it
  marks them (transformers' assistant mask); else learnt by rendering the conversation one message longer
  at a time: the characters that message i adds (after the generation prompt, for an assistant turn) are
  its own. A template that does not render a conversation as a prefix of the conversation one message
  longer is then refused in one line. Without a template, the plain one below, with special tokens.

The plain template, for tokenizers without one (the byte-level vocabulary among them):

    <role>: <content>\\n          for each system or user message
    assistant:\\n<content>\\n     the content and its newline trained, "assistant:\\n" not

The answer starts on a line of its own so that its first token is the same whether the conversation is
tokenized whole (training) or up to "assistant:\\n" (a prompt): a space there would merge with the answer's
first word in most vocabularies, and a prompt ending in it would not be the start of any training row.
"""

from typing import NamedTuple

from shard.data import chat_template, tokenizer_files
from shard.errors import UserError

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's, which chat sets use


class Row(NamedTuple):
    text: str
    trained: list[tuple[int, int]]  # character spans of `text`, in order
    special: bool                   # the tokenizer's special tokens go around it (not for a rendered template)


def columns(cfg) -> tuple[str, ...]:
    """The columns a row is read from: (prompt, completion), or the one `data.field`."""
    if bool(cfg.prompt_field) != bool(cfg.completion_field):
        given = "data.prompt_field" if cfg.prompt_field else "data.completion_field"
        raise UserError(f"{given} is set alone: prompt/completion rows need both data.prompt_field and "
                        "data.completion_field (or neither, for documents and chats in data.field)")
    return (cfg.prompt_field, cfg.completion_field) if cfg.prompt_field else (cfg.field,)


class Formatter:
    """Row values (a tuple, one per column) -> a Row, for one tokenizer (its chat template, its special
    tokens' text)."""

    def __init__(self, names: tuple[str, ...], tokenizer):
        self.names, self.tok = names, tokenizer
        source = tokenizer.chat_template
        self.template = None if source is None else chat_template.Template(
            source, template_tokens(tokenizer), f"data.tokenizer={str(tokenizer.found.main.parent)!r}")

    def row(self, values: tuple, where: str) -> Row | None:
        """The row's text and trained spans; None for a row with nothing to train on (an empty text or
        completion)."""
        if len(values) == 2:
            prompt, completion = (text_value(v, describe((n,), self.names), where) for v, n in zip(values, self.names))
            if not completion:
                return None
            return Row(prompt + completion, [(len(prompt), len(prompt) + len(completion))], True)
        value = values[0]
        if isinstance(value, (list, tuple)):
            return self.chat(_messages(value, self.names[0], where), where)
        text = text_value(value, describe(self.names), where)
        return Row(text, [(0, len(text))], True) if text else None

    def chat(self, messages: list[dict], where: str) -> Row | None:
        if self.template is None:
            pieces = [piece for m in messages for piece in plain(m)]
            return _joined(pieces, True)
        if self.template.marks_generation:
            text, spans = self.render(messages, False, where)
            return Row(text, spans, False) if text else None
        pieces, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt, _ = self.render(messages[:i], True, where)
                _check_prefix(done, prompt, where)
                pieces.append((prompt[len(done):], False))
                done = prompt
            whole, _ = self.render(messages[:i + 1], False, where)
            _check_prefix(done, whole, where)
            pieces.append((whole[len(done):], message["role"] == "assistant"))
            done = whole
        return _joined(pieces, False)

    def prompt(self, messages: list[dict]) -> str:
        """The conversation so far, ready for the assistant's next turn (as a server or generate feeds it)."""
        checked = _messages(messages, "messages", "messages")
        if self.template is None:
            return "".join(text for m in checked for text, _ in plain(m)) + "assistant:\n"
        return self.render(checked, True, "messages")[0]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The prompt's tokens, as a chat row of the same conversation starts: a rendered template's text alone
        (it writes its own special tokens), the plain template's with what the tokenizer puts before a text."""
        text = self.prompt(messages)
        return self.tok.encode(text, special=False) if self.template is not None else self.tok.prompt(text)

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str):
        try:
            return self.template.render(messages, add_generation_prompt)
        except chat_template.TemplateFailed as e:
            raise UserError(f"{where}: the tokenizer's chat template failed on this conversation: {e}") from None


def template_tokens(tokenizer) -> dict[str, str]:
    """The special tokens' text a chat template may name (bos_token, eos_token, ...): those the tokenizer's
    config names, as transformers passes them."""
    named = {key: text for key in tokenizer_files.SPECIAL_KEYS if (text := tokenizer.special(key))}
    extra = tokenizer.found.config.get("extra_special_tokens") if tokenizer.found else None
    if isinstance(extra, dict):
        named.update({k: v for k, v in extra.items() if isinstance(v, str)})
    return named


def _joined(pieces: list[tuple[str, bool]], special: bool) -> Row | None:
    text, spans, at = "", [], 0
    for piece, trained in pieces:
        if trained and piece:
            spans.append((at, at + len(piece)))
        text += piece
        at += len(piece)
    return Row(text, spans, special) if text else None


def plain(message: dict) -> list[tuple[str, bool]]:
    if message["role"] == "assistant":
        return [("assistant:\n", False), (message["content"] + "\n", True)]
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


def describe(names: tuple[str, ...], of: tuple[str, ...] | None = None) -> str:
    """How the config names these columns (some of `of`, the columns a row is read from): data.field=..., or
    data.prompt_field=... and data.completion_field=..."""
    of = of or names
    keys = ("data.prompt_field", "data.completion_field") if len(of) == 2 else ("data.field",)
    return " and ".join(f"{keys[of.index(n)]}={n!r}" for n in names)
