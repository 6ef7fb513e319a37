"""`python -m shard.serve`: the code lives in shard/server/ (cli.py: the command line)."""

from shard.cli import command
from shard.server.cli import main

command(__name__, main)
