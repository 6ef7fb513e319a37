"""`python -m shard.plot`: the code lives in shard/observe/plot.py."""

from shard.cli import command
from shard.observe.plot import main

command(__name__, main)
