"""Gradient accumulation (`train.grad_accum=K`): each batch runs as K microbatches one after another, their
gradients summed in `train.accum_dtype`, one update: the same update with 1/K of the activation memory. The
scan over microbatches lives in the gradient builder (shard/strategies/gradients.py); this module decides it."""

import jax.numpy as jnp

from shard.nn import partition
from shard.errors import UserError
from shard.strategies.base import Strategy


class Accumulation(Strategy):
    name = "accumulation"
    keys = ("train.grad_accum", "train.accum_dtype")
    switches = {"accumulation": "`train.grad_accum` > 1"}

    def __init__(self, k: int, dtype):
        self.k, self.dtype = k, dtype

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        k, shards = cfg.train.grad_accum, partition.batch_shards(rules, mesh_shape)
        if k == 1:
            return None
        if cfg.data.batch_size % k or (cfg.data.batch_size // k) % shards:
            raise UserError(f"train.grad_accum={k}: data.batch_size={cfg.data.batch_size} does not cut into {k} "
                            f"microbatches that the batch's {shards} shards divide; use a batch size that is a "
                            f"multiple of {k * shards}")
        return cls(k, jnp.dtype(cfg.train.accum_dtype))

    @property
    def label(self) -> str:
        return f"train.grad_accum={self.k}"

    def step_options(self, place) -> dict:
        return {"accum": self.k, "accum_dtype": self.dtype}

    def reduce_once(self) -> str:
        return f"each of the {self.k} microbatches' gradients is reduced on its own ({self.k}x the reduction bytes)"
