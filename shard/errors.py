"""The one exception type for mistakes a user can fix (bad config, bad shapes, bad paths).

`train.py` turns it into a single line on stderr and exit status 2; everything else is a bug
and keeps its traceback.
"""

import sys


class UserError(Exception):
    """A problem with the user's input, worded as one line that says what is wrong and what is allowed."""


class NonFiniteLoss(Exception):
    """Training produced a NaN or infinite loss or gradient; no checkpoint of that state is written."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message cut to its first line (at most `limit` characters), for one-line errors
    that quote what a library said; its type name when it says nothing."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


def exit_from(main, argv: list[str], codes: dict | None = None):
    """A command line's end: main(argv)'s exit status, or for an exception in `codes` (by default a
    UserError, status 2) its message as one line on stderr and that status; Ctrl-C exits 130."""
    codes = codes or {UserError: 2}
    try:
        status = main(argv)
    except tuple(codes) as e:
        print(f"error: {e}", file=sys.stderr)
        status = next(code for kind, code in codes.items() if isinstance(e, kind))
    except KeyboardInterrupt:
        status = 130
    sys.exit(status)


def warn(message: str) -> None:
    """One line on stderr, from process 0 only."""
    import jax

    if jax.process_index() == 0:
        print(f"warning: {message}", file=sys.stderr)
