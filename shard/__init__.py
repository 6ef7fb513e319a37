"""shard: a JAX SPMD training framework. Models are written once in Flax NNX with logical axis
names; a mesh config alone decides data, tensor, fully sharded or hybrid parallelism."""

from shard.errors import UserError

__all__ = ["UserError", "load_model"]


def load_model(path, *, mesh=None, step=None, trust_code=False):
    """A trained run's Flax NNX module (see shard/load.py). Imported on first use: `import shard` stays
    light for the command lines that only parse a config."""
    from shard.use.load import load_model as load

    return load(path, mesh=mesh, step=step, trust_code=trust_code)
