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
    """The template refused the messages (its raise_exception), or could not render them."""


def plain(messages: list[dict]) -> str:
    return formats.Formatter(("messages",), tokenizer_lib.Bytes()).prompt(messages)


class Template:
    """The run tokenizer's way from messages to the prompt's tokens."""

    def __init__(self, tokenizer):
        self.formatter = formats.Formatter(("messages",), tokenizer)

    def text(self, messages: list[dict]) -> str:
        try:
            return self.formatter.prompt(messages)
        except UserError as e:
            raise Refused(str(e)) from None

    def __call__(self, messages: list[dict]) -> list[int]:
        try:
            return self.formatter.prompt_ids(messages)
        except UserError as e:
            raise Refused(str(e)) from None
