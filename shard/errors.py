"""The one exception type for mistakes a user can fix (bad config, bad shapes, bad paths).

`train.py` turns it into a single line on stderr and exit status 2; everything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, worded as one line that says what is wrong and what is allowed."""


class NonFiniteLoss(Exception):
    """Training produced a NaN or infinite loss or gradient; no checkpoint of that state is written."""


def warn(message: str) -> None:
    """One line on stderr, from process 0 only."""
    import sys

    import jax

    if jax.process_index() == 0:
        print(f"warning: {message}", file=sys.stderr)
