"""ZeRO-1 and ZeRO-2 over the data axis (`mesh.zero=1|2`): the optimizer state is split over `data`, the
gradients are reduced into that split and each device updates its slice (stage 2 also keeps the sum of
microbatches split). Parameters stay whole: splitting them too is fsdp (ZeRO-3), a rule, not a strategy."""

import jax
from flax import nnx
from jax.sharding import NamedSharding

from shard.core import state as state_lib
from shard.strategies.base import Strategy


class Zero(Strategy):
    name = "zero"
    keys = ("mesh.zero",)
    switches = {"zero": "`mesh.zero=1` or `2`"}

    def __init__(self, stage: int, data: int):
        self.stage, self.data = stage, data

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        return cls(cfg.mesh.zero, mesh_shape["data"]) if cfg.mesh.zero else None

    @property
    def label(self) -> str:
        return f"mesh.zero={self.stage}"

    def shardings(self, shardings, place):
        """The optimizer moments split over `data` as well (each keeps its parameter's split besides)."""
        mesh_shape, is_var = dict(place.mesh.shape), lambda x: isinstance(x, nnx.Variable)

        def split(s, a):
            if not is_var(s):  # step counters: replicated
                return s
            spec = state_lib.over_data(jax.tree.leaves(s)[0].spec, jax.tree.leaves(a)[0].shape, mesh_shape)
            return s.replace(NamedSharding(place.mesh, spec))

        opt = jax.tree.map(split, shardings.opt_state, place.work.abstract.opt_state, is_leaf=is_var)
        return shardings.replace(opt_state=opt)

    def step_options(self, place) -> dict:
        split = None if self.data == 1 else state_lib.update_shardings(  # data=1: nothing to split over
            place.work.abstract.params, place.mesh, place.rules, place.auto_min)
        return {"update_shardings": split, "split_sum": self.stage == 2}

    def gradient_shardings(self, job):
        """ZeRO-2 with microbatches (train.grad_accum > 1) sums them into the optimizer state's split (ZeRO-1 sums
        them whole). With one microbatch there is nothing to keep: the backward pass makes each gradient whole
        before its reduce-scatter under ZeRO-2 as under ZeRO-1 (XLA compiles the same program,
        tests/test_zero.py), so the split saves nothing and is not counted."""
        red = job.reduction
        return red.update_shardings if red.split_sum and red.update_shardings and red.accum > 1 else None

    def reduce_once(self) -> str:
        return "ZeRO's reduction into each device's slice is placed by XLA's partitioner" if self.data > 1 else ""
