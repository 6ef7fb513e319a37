"""Chat messages to prompt text, rendered as fine-tuning rendered them (shard/data/formats.py): with the run
tokenizer's own chat template where it has one (tokenizer_config.json's `chat_template`, in jinja2's sandbox:
a run folder is data, not code), else with the plain template a chat was trained on:

    system: You are terse.
    user: Hi
    assistant:
    <the answer follows here>
"""

from shard.data import formats, tokenizer as tokenizer_lib
from shard.errors import UserError


class Refused(ValueError):
    """The messages are not a conversation the template takes (its raise_exception refused them): the request's
    fault, as vLLM answers it (400)."""


class Broken(RuntimeError):
    """The template's own code failed on messages the server had checked (an undefined name, a TypeError): the
    server's fault (500), not the request's."""


def plain(messages: list[dict]) -> str:
    return formats.Formatter(("messages",), tokenizer_lib.Bytes()).prompt(messages)


class Template:
    """The run tokenizer's way from messages to the prompt's tokens."""

    def __init__(self, tokenizer):
        self.formatter = formats.Formatter(("messages",), tokenizer)

    def text(self, messages: list[dict]) -> str:
        return _rendered(self.formatter.prompt, messages)

    def __call__(self, messages: list[dict]) -> list[int]:
        return _rendered(self.formatter.prompt_ids, messages)


def _rendered(render, messages: list[dict]):
    """render(messages), its failures sorted: the template's own bug (500) or a refusal of these messages (400)."""
    try:
        return render(messages)
    except formats.TemplateBroken as e:
        raise Broken(str(e)) from None
    except UserError as e:
        raise Refused(str(e)) from None
