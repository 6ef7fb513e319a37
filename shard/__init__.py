"""shard: a JAX SPMD training framework. Models are written once in Flax NNX with logical axis
names; a mesh config alone decides data, tensor, fully sharded or hybrid parallelism."""

from shard.errors import UserError

__all__ = ["UserError"]
