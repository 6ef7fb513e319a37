"""`python -m shard.plot` and `from shard.plot import ...`: the code lives in shard/observe/plot.py."""

import sys

from shard.observe.plot import *  # noqa: F401,F403  (its public names)
from shard.observe.plot import main

if __name__ == "__main__":
    from shard.errors import exit_from

    exit_from(main, sys.argv[1:])
