"""`python -m shard.generate` and `from shard.generate import ...`: the code lives in shard/use/generate.py."""

import sys

from shard.use.generate import *  # noqa: F401,F403  (its public names)
from shard.use.generate import main

if __name__ == "__main__":
    from shard.errors import exit_from

    exit_from(main, sys.argv[1:])
