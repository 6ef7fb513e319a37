"""A tokenizer's chat template, rendered as transformers renders it, in jinja2's sandbox.

Hub templates are written against transformers' environment, so ours offers the same: trim_blocks and
lstrip_blocks, loop controls (`{% break %}`, `{% continue %}`), `tojson` writing JSON as Python's json.dumps
does (not HTML-escaped, non-ASCII kept), `raise_exception(message)`, `strftime_now(format)`, and the
`{% generation %}...{% endgeneration %}` block that marks the characters an assistant wrote. The sandbox is
jinja2's immutable one: a template is data from a folder, and rendering it runs none of its Python.

`render` returns the text and, where the template marks them, the character spans of its generation blocks.
"""

import json
import re
from datetime import datetime
from functools import lru_cache

from shard.errors import UserError

# Private-use characters that bracket a generation block while rendering; removed before anyone sees the text.
OPEN, CLOSE = "\U000F0000", "\U000F0001"
MARKS = (OPEN, CLOSE)
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # a {% generation %} tag, as transformers finds it


class TemplateFailed(ValueError):
    """The template refused the conversation (its raise_exception: `refused`, the conversation's fault) or its own
    code failed on it (an undefined name, a TypeError: the template's fault)."""

    def __init__(self, message: str, refused: bool):
        super().__init__(message)
        self.refused = refused


class Refusal(Exception):
    """What the template's raise_exception(message) raises: it refuses the conversation on purpose."""


class Template:
    def __init__(self, source: str, special: dict[str, str], where: str):
        self.source, self.special = source, special
        self.program = _compiled(source, where)
        self.marks_generation = bool(GENERATION.search(source))

    def render(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """(text, spans of {% generation %} blocks in it) for `messages`."""
        try:
            raw = self.program.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                      tools=None, documents=None, **self.special)
        except Exception as e:  # jinja2's TemplateError and SecurityError, the template's own raise_exception
            raise TemplateFailed(str(e).splitlines()[0] if str(e) else type(e).__name__,
                                 isinstance(e, Refusal)) from None
        return _spans(raw)


def _spans(raw: str) -> tuple[str, list[tuple[int, int]]]:
    if OPEN not in raw:
        return raw, []
    text, spans, start = [], [], None
    at = 0
    for ch in raw:
        if ch == OPEN:
            start = at
        elif ch == CLOSE:
            if start is not None and at > start:
                spans.append((start, at))
            start = None
        else:
            text.append(ch)
            at += 1
    return "".join(text), spans


@lru_cache(maxsize=8)
def _compiled(source: str, where: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}body{% endgeneration %} renders body between the OPEN and CLOSE marks."""
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(line)

        def _mark(self, caller):
            return OPEN + caller() + CLOSE

    def raise_exception(message):
        raise Refusal(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"{where}: its chat template is not a valid template ({e})") from None
