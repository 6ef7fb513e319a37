"""Chat messages to prompt text: the run tokenizer's own chat template where it has one (tokenizer_config.json's
`chat_template`, a Jinja template, rendered in a sandbox: a run folder is data, not code), else a plain one:

    system: You are terse.
    user: Hi
    assistant:

one `role: content` line per message, then `assistant:` for the answer to follow (after a space the model
writes). A model trained on plain text has no roles; this keeps the prompt readable and its own."""

import json
from pathlib import Path


def plain(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class Refused(ValueError):
    """The template refused the messages (its raise_exception), or could not render them."""


def refuse(message: str):
    raise Refused(message)


class Template:
    def __init__(self, tokenizer_folder: Path | None):
        self.source = None
        config = tokenizer_folder / "tokenizer_config.json" if tokenizer_folder is not None else None
        if config is not None and config.is_file():
            saved = json.loads(config.read_text())
            template = saved.get("chat_template")
            if isinstance(template, list):  # several named templates: the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                self.source = template
                sandbox = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                sandbox.globals["raise_exception"] = refuse  # what Hugging Face's templates call on bad messages
                self.template = sandbox.from_string(template)
                self.tokens = {k: v if isinstance(v, str) else (v or {}).get("content", "")
                               for k, v in saved.items() if k in ("bos_token", "eos_token")}

    def __call__(self, messages: list[dict]) -> str:
        if self.source is None:
            return plain(messages)
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.tokens)
        except TemplateError as e:
            raise Refused(str(e)) from None
