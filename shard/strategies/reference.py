"""The frozen reference a preference objective compares the trained model with (`train.objective=dpo` with
`train.dpo.reference=init`): the starting weights, as `train.init_from` (or the fresh init) gave them.

It costs what it must. Under LoRA the weights themselves stay frozen, so the reference is the model without
its adapters, no second copy (a base stored quantized: dequantized as the step's model dequantizes it, a layer at
a time inside the stack). In full fine-tuning it is a copy of the starting weights kept
beside the trained ones in `extra["reference"]`, laid out by the same rules (so fsdp splits it as it splits
the weights, in host memory where they are), checkpointed with the optimizer state (a resume reads it back
bitwise) and set from the loaded weights after `train.init_from` (`fill`). The plan shows its bytes per
device. (`train.dpo.precompute=true` needs neither: the reference's log-likelihoods are computed once before
the first step, shard/objectives/precomputed.py, and ride in the batches.)
"""

from shard.core import state as state_lib
from shard.run import checkpoint as ckpt_lib
from shard.strategies import lora
from shard.strategies.base import Strategy, mb, params_copy, with_params_copy

KEY = "reference"


def _without(extra: dict | None) -> dict | None:
    rest = {k: v for k, v in (extra or {}).items() if k != KEY}
    return rest or None


class Reference(Strategy):
    name = "reference"
    keys = ("train.dpo.reference",)
    switches = {"reference": "`train.objective=dpo` with `train.dpo.reference=init`, or `grpo` with "
                             "`train.grpo.beta` > 0",
                "copy": "that reference without LoRA (a copy of the weights)"}
    refuses = {
        ("reference", "sync"): "the replicas' weights part between syncs, each would need its own reference; use "
                               "train.sync=allreduce",
        ("reference", "replicas"): "each replica would keep a reference of its own; use mesh.replica=1",
        ("copy", "offload"): "the reference's copy stays in device memory; use train.offload=none, LoRA "
                             "(train.lora.rank, no copy) or train.dpo.precompute=true (no copy)",
    }

    def __init__(self, copy: bool, label: str = "train.dpo.reference=init", adapters=None):
        self.copy = copy  # a copy beside the weights (full fine-tuning), else the weights under the adapters
        self._label = label  # the setting that asked for it, for refusals
        self.adapters = adapters  # LoRA's strategy, whose base the reference is (None: a copy)

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        goal = work.objective
        if goal.reference != "init":
            return None
        under = lora.LoRA.build(cfg, mesh_shape, rules, work)  # its own instance: `weights` reads only the state
        return cls(copy=under is None, label=goal.reference_label or "train.dpo.reference=init", adapters=under)

    @property
    def label(self) -> str:
        return self._label

    @property
    def tags(self) -> tuple:
        return ("reference", "copy") if self.copy else ("reference",)

    # ---- the state
    def add_state(self, abstract, init, shardings, place):
        return params_copy(KEY, abstract, init, shardings) if self.copy else (abstract, init, shardings)

    def fill(self, state):
        return with_params_copy(KEY, state) if self.copy else state

    def lacks(self, state) -> bool:
        return self.copy and (state.extra or {}).get(KEY) is None

    def frozen(self, state):
        """The reference's weights in the train step: the copy, or the weights the adapters sit on (a quantized
        base's built in the stack as the trained model's are, without the adapters)."""
        return state.extra[KEY] if self.copy else self.adapters.weights(state, None)

    def step_options(self, place) -> dict:
        return {"reference": self.frozen, "eval_reference": lambda state: state.extra[KEY]}

    def wrap_eval(self, eval_fn):
        if self.copy:
            return eval_fn
        # before LoRA's view merges the adapters into the weights: the weights alone, handed on
        return lambda state, batch: eval_fn(state.replace(extra={**(state.extra or {}), KEY: self.frozen(state)}),
                                            batch)

    def model_view(self, state):
        return state.replace(extra=_without(state.extra))

    # ---- the plan
    def plan(self, job, step_ops, n) -> dict:
        if not self.copy:
            return {"reference": {"kind": "the weights under the adapters", "bytes_per_device": 0, "for": self.label}}
        held = ckpt_lib.abstract_target(job.work.abstract.params, job.shardings.extra[KEY])
        return {"reference": {"kind": "a frozen copy of the weights", "bytes_per_device": state_lib.shard_bytes(held),
                              "for": self.label}}

    plan_keys = ("reference",)

    @staticmethod
    def report(plan: dict) -> list:
        if not (ref := plan.get("reference")):
            return []
        return [f"reference ({ref.get('for', 'train.dpo.reference=init')}): {ref['kind']}, "
                f"{mb(ref['bytes_per_device'])} per device beside the trained state"]
