"""`python -m shard.goodput RUN`: where a run's wall time went; the code lives in shard/observe/goodput.py."""

import sys

from shard.observe.goodput import *  # noqa: F401,F403  (its public names)
from shard.observe.goodput import main

if __name__ == "__main__":
    from shard.errors import exit_from

    exit_from(main, sys.argv[1:])
