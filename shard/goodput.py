"""`python -m shard.goodput RUN`, where a run's wall time went: the code lives in shard/observe/goodput.py."""

from shard.cli import command
from shard.observe.goodput import main

command(__name__, main)
