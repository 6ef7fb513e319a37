"""The data-parallel reduction: how the train step's gradients meet across the devices that split the batch
(shard/strategies/gradients.py does it). By default XLA reduces each gradient inside the backward pass. Where
another strategy wants each device's gradient reduced once a step (accumulation, ZeRO, a pipeline) or
`train.grad_dtype` lowers the reduction's precision, each device keeps its own gradient over the pure data
axes and one sum reduces it. Models whose examples meet in the forward pass, and steps that cannot run per
data shard, keep XLA's reduction: the log and the plan say so, with what it costs."""

import jax.numpy as jnp

from shard.nn import partition
from shard.errors import UserError
from shard.strategies import gradients
from shard.strategies.base import Strategy


class Reduction(Strategy):
    """Always active: every job reduces its gradients somehow; this decides how."""
    name = "reduction"
    keys = ("train.grad_dtype",)
    switches = {"bf16 reduction": "`train.grad_dtype=bfloat16`"}

    def __init__(self, wire, model_name: str, interacts: str):
        self.wire, self.model_name, self.interacts = wire, model_name, interacts
        self.fallback = ""

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        return cls(jnp.dtype(cfg.train.grad_dtype), cfg.model.name, gradients.interaction(work.model_cls,
                                                                                           work.abstract.rest))

    @property
    def tags(self) -> tuple:
        return ("reduction", "bf16 reduction") if self.wire != jnp.float32 else ("reduction",)

    @property
    def label(self) -> str:
        return f"train.grad_dtype={self.wire.name}"

    def step_options(self, place) -> dict:
        mesh_shape = dict(place.mesh.shape)
        param_axes = {a for r in place.split for entry in r["spec"] for a in partition.axes_of(entry)}
        local = gradients.local_axes(place.rules, mesh_shape, param_axes)
        lowered = self.wire != jnp.float32
        wanted = [why for s in place.strategies if (why := s.reduce_once())]
        blocked = [why for s in place.strategies if (why := s.per_shard())]
        fallback = ""
        if local and blocked:
            local, fallback = (), blocked[0]
        if local and self.interacts:
            if lowered:
                raise UserError(f"train.grad_dtype={self.wire.name} sums each device's own gradient, and model "
                                f"{self.model_name!r} has none: its examples meet in the forward pass "
                                f"({self.interacts}); use train.grad_dtype=float32")
            local, fallback = (), (f"model {self.model_name!r} has examples that meet in the forward pass "
                                   f"({self.interacts})")
        if fallback and wanted:
            self.fallback = (f"gradients are reduced by XLA inside the backward pass, not once a step per device: "
                             f"{fallback}; " + "; ".join(wanted))
        if lowered and not local:
            shown = " x ".join(f"{a}={n}" for a, n in mesh_shape.items() if n > 1) or "one device"
            raise UserError(f"train.grad_dtype={self.wire.name} lowers the data axis's gradient reduction, and "
                            f"mesh {shown} splits the batch over no axis that leaves the parameters whole (fsdp and "
                            "expert reduce inside the backward pass); add mesh.data > 1 or use "
                            "train.grad_dtype=float32")
        return {"wire_dtype": self.wire, "local_axes": local if (wanted or lowered) else (),
                "param_shardings": place.device_shardings.params, "fallback": self.fallback}

    def notes(self) -> list:
        return [self.fallback] if self.fallback else []

    def plan(self, job, step_ops, n) -> dict:
        return {"gradient_fallback": self.fallback}

    plan_keys = ()  # gradient_fallback is always there: "" when the reduction is as wanted

    @staticmethod
    def report(plan: dict) -> list:
        return [f"note: {plan['gradient_fallback']}"] if plan.get("gradient_fallback") else []
