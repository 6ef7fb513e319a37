"""The command lines' preamble: the parser whose mistakes are one line, and the entry every `python -m shard.X`
module is (shard/generate.py and its neighbours: a docstring naming where the code lives, then `command`).

At the bottom of the house with errors.py and paths.py: it imports only shard.errors, so any command's module
may use it (shard/nn/, what model files import, does not).
"""

import argparse
import sys

from shard.errors import UserError, exit_from


class Parser(argparse.ArgumentParser):
    """argparse's parser, except that a mistake raises `mistake` (a UserError, which exit_from prints as one
    line with exit status 2) holding the problem and the usage argparse builds from the arguments, joined into
    one line: argparse itself would print its usage block and then exit in the middle of the caller. A
    subcommand's parser (add_subparsers) is of the same class, so it answers the same way."""

    mistake = UserError

    def error(self, message):
        raise self.mistake(f"{message}; {' '.join(self.format_usage().split())}")


def command(name: str, main) -> None:
    """A `python -m` module's last line, `command(__name__, main)`: run as the program, main(sys.argv[1:])'s
    status is the process's (exit_from: a UserError is one line and status 2); imported, nothing happens."""
    if name == "__main__":
        exit_from(main, sys.argv[1:])
