"""`python -m shard.generate`: the code lives in shard/use/generate.py. `Generator` (and the `Sampling` it is
called with) stay importable from here: docs/trained-model.md names `shard.generate.Generator`."""

from shard.cli import command
from shard.use.generate import Generator, Sampling, main  # noqa: F401

command(__name__, main)
