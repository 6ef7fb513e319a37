"""`python -m shard.launch` (also installed as `shard-launch`): the code lives in shard/run/launch.py."""

from shard.cli import command
from shard.run.launch import main

command(__name__, main)
