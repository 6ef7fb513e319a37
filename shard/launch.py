"""`python -m shard.launch` (also installed as `shard-launch`): the code lives in shard/run/launch.py."""

from shard.run.launch import cli

if __name__ == "__main__":
    cli()
