"""`python -m shard.export`: the code lives in shard/use/export.py."""

from shard.cli import command
from shard.use.export import main

command(__name__, main)
