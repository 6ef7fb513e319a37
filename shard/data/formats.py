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
  marks them (transformers' assistant mask); else from the whole conversation's rendering: an assistant's
  turn starts where the conversation before it, rendered with the generation prompt, ends, and runs to
  where the next message's turn starts (`_next_turn`). A template that writes the conversation before a
  turn otherwise than the whole conversation starts is then refused in one line. Without a template, the
  plain one below, with special tokens.

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


class TemplateBroken(UserError):
    """The chat template's own code failed (not its raise_exception): the tokenizer folder's fault, not the
    conversation's (a server answers it as its own fault)."""


class Formatter:
    """Row values (a tuple, one per column) -> a Row, for one tokenizer (its chat template, its special
    tokens' text)."""

    def __init__(self, names: tuple[str, ...], tokenizer):
        self.names, self.tok, self._closing_text = names, tokenizer, None
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
        text, spans = self.render(messages, False, where)
        if not self.template.marks_generation:
            spans = [self._turn(messages, i, text, where) for i, m in enumerate(messages) if m["role"] == "assistant"]
        return Row(text, spans, False) if text else None

    def _turn(self, messages: list[dict], i: int, text: str, where: str) -> tuple[int, int]:
        """Assistant message i's characters in `text`: from the end of the conversation before it, rendered
        with the generation prompt, to where the next message's turn starts."""
        prompt, _ = self.render(messages[:i], True, where)
        _check_prefix(prompt, text, where)
        return len(prompt), (len(text) if i + 1 == len(messages) else self._next_turn(messages, i, text, where))

    def _next_turn(self, messages: list[dict], i: int, text: str, where: str) -> int:
        """Where message i + 1's turn starts in `text` (the whole conversation, rendered). The conversation to
        message i is rendered with a probe message of message i + 1's role after it: the probe's header (what
        its turn writes before its content, as a one-message conversation shows it) ends where the probe
        begins. Unlike rendering the conversation one message longer at a time, this holds for templates
        that write earlier turns differently once later ones follow (Qwen3's drop their reasoning)."""
        role = messages[i + 1]["role"]
        probed, _ = self.render([*messages[:i + 1], {"role": role, "content": PROBE}], False, where)
        alone, _ = self.render([{"role": role, "content": PROBE}], False, where)
        if PROBE not in probed or PROBE not in alone:  # a template that drops the message
            _untold(where)
        at = probed.index(PROBE)
        header = alone[:alone.index(PROBE)]
        shared = next(n for n in range(min(len(header), at), -1, -1) if probed[at - n:at] == header[len(header) - n:])
        end = at - shared
        # The one-message render may open with a default system turn whose end looks like any turn's end
        # (Qwen2.5's, Llama 3's): the assistant's turn runs at least through what the template writes after
        # an assistant's content (its end-of-turn text).
        closing = self._closing(where)
        if closing and (after := probed.rfind(closing, 0, at)) >= 0:
            end = max(end, after + len(closing))
        _check_prefix(probed[:end], text, where)
        return end

    def _closing(self, where: str) -> str:
        """What the template writes after an assistant's content, up to the next message ("" where it cannot
        tell: a template that refuses the two-message conversation it is asked for)."""
        if self._closing_text is None:
            try:
                shown, _ = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": PROBE}],
                                       False, where)
            except UserError:
                shown = ""
            self._closing_text = shown[shown.index(PROBE) + 1:] if PROBE in shown else ""
        return self._closing_text

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
            kind = UserError if e.refused else TemplateBroken
            raise kind(f"{where}: the tokenizer's chat template failed on this conversation: {e}") from None


def end_of_turn_id(tokenizer) -> int | None:
    """The id of the chat template's end-of-turn text (what it writes after an assistant's content, blank
    around it aside) where that text is one added token (Qwen's <|im_end|>, Gemma's <end_of_turn>, Llama 3's
    <|eot_id|>): a model trained on the template's turns ends its answer there. None without a template."""
    if tokenizer.chat_template is None:
        return None
    closing = Formatter((), tokenizer)._closing("data.tokenizer's chat template").strip()
    return tokenizer.added_id(closing) if closing else None


def template_tokens(tokenizer) -> dict[str, str]:
    """The special tokens' text a chat template may name (bos_token, eos_token, ...): those the tokenizer's
    config names, as transformers passes them."""
    config = tokenizer.found.config if tokenizer.found else {}
    keys = [*tokenizer_files.SPECIAL_KEYS,
            *(k for k in config if k.endswith("_token") and k not in tokenizer_files.SPECIAL_KEYS)]
    named = {key: text for key in keys if (text := tokenizer.special(key))}
    extra = config.get("extra_special_tokens")
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


PROBE = "\U000F0002"  # a private-use character no conversation holds: where a probe message's content goes


def _check_prefix(start: str, whole: str, where: str) -> None:
    if not whole.startswith(start):
        _untold(where)


def _untold(where: str):
    raise UserError(f"{where}: the tokenizer's chat template writes the conversation before an assistant's turn "
                    "otherwise than the whole conversation starts, so the turn cannot be told apart (a template "
                    "that marks it with {% generation %} ... {% endgeneration %} can)")


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
        if any(mark in message["content"] for mark in (PROBE, *chat_template.MARKS)):
            raise UserError(f"{where}: a message holds one of the private-use characters U+F0000-U+F0002, which "
                            "mark places while a chat template renders; remove them")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def describe(names: tuple[str, ...], of: tuple[str, ...] | None = None) -> str:
    """How the config names these columns (some of `of`, the columns a row is read from): data.field=..., or
    data.prompt_field=... and data.completion_field=..."""
    of = of or names
    keys = ("data.prompt_field", "data.completion_field") if len(of) == 2 else ("data.field",)
    return " and ".join(f"{keys[of.index(n)]}={n!r}" for n in names)
