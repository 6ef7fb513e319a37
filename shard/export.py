"""`python -m shard.export` and `from shard.export import ...`: the code lives in shard/use/export.py."""

import sys

from shard.use.export import *  # noqa: F401,F403  (its public names)
from shard.use.export import main

if __name__ == "__main__":
    from shard.errors import exit_from

    exit_from(main, sys.argv[1:])
