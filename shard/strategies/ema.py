"""An exponential moving average of the weights (`train.ema=DECAY`, e.g. 0.999): after every update
ema <- DECAY * ema + (1 - DECAY) * params, starting from the initial (or loaded) parameters. Eval, the
end-of-run sample, `shard.load_model`, generation and export use the averaged weights; training itself
steps the raw ones. The average is kept in float32 beside the model, sharded like the parameters (in host
memory where they are, under `train.offload=params`), and checkpointed with the optimizer state. A
checkpoint without it (an older run, `train.init_from`) starts the average from the weights it holds."""

import jax
import jax.numpy as jnp

from shard.core import state as state_lib
from shard.run import checkpoint as ckpt_lib
from shard.strategies.base import Strategy, mb, params_copy, with_params_copy

KEY = "ema"


def _without(extra: dict | None) -> dict | None:
    rest = {k: v for k, v in (extra or {}).items() if k != KEY}
    return rest or None  # no other strategy's state: the same tree as a job without any


class EMA(Strategy):
    name = "ema"
    keys = ("train.ema",)
    switches = {"ema": "`train.ema` > 0"}
    refuses = {("ema", "sync"): "the replicas' weights part between syncs, so there is no one model to average; "
                                "use train.ema=0 or train.sync=allreduce"}

    def __init__(self, decay: float):
        self.decay = decay
        self.device = None  # the average's shardings in device memory (for the update inside the step)

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        return cls(cfg.train.ema) if cfg.train.ema else None

    @property
    def label(self) -> str:
        return f"train.ema={self.decay}"

    def add_state(self, abstract, init, shardings, place):
        self.device = state_lib.device_memory(shardings.params)
        return params_copy(KEY, abstract, init, shardings)

    def fill(self, state):
        return with_params_copy(KEY, state)

    def lacks(self, state) -> bool:
        return (state.extra or {}).get(KEY) is None

    def wrap_train(self, train_fn):
        d = self.decay

        def step(state, batch):
            new, out = train_fn(state.replace(extra=_without(state.extra)), batch)  # the step never sees the average
            old = jax.device_put(state.extra[KEY], self.device)
            ema = jax.tree.map(lambda e, p: jnp.where(out["finite"], d * e + (1 - d) * p, e), old, new.params)
            return new.replace(extra={**(new.extra or {}), KEY: ema}), out

        return step

    def wrap_eval(self, eval_fn):
        return lambda state, batch: eval_fn(self.model_view(state), batch)

    def model_view(self, state):
        return state.replace(params=state.extra[KEY], extra=_without(state.extra))

    @classmethod
    def read_model(cls, cfg, folder, step: int, target):
        if not cfg.train.ema:
            return None
        got = ckpt_lib.read_parts(folder, step, {"model": {"rest": target.rest},
                                                 "optimizer": {"extra": {KEY: target.params}}})
        return target.replace(params=got["optimizer"]["extra"][KEY], rest=got["model"]["rest"]), dict(got["meta"])

    def plan(self, job, step_ops, n) -> dict:
        held = ckpt_lib.abstract_target(job.work.abstract.params, job.shardings.extra[KEY])
        return {"ema": {"decay": self.decay, "bytes_per_device": state_lib.shard_bytes(held)}}

    plan_keys = ("ema",)

    @staticmethod
    def report(plan: dict) -> list:
        if not (ema := plan.get("ema")):
            return []
        return [f"ema: weights averaged with decay {ema['decay']} (eval, load and export use the average); the "
                f"average holds {mb(ema['bytes_per_device'])} per device beside the parameters"]
