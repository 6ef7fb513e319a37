"""What the train step optimises, `train.objective`: `lm` (the default: the data's own targets under `train.loss`,
shard/objectives/lm.py: next-token prediction on text, and the classification or regression task of other data),
`dpo` (preference pairs, shard/objectives/dpo.py) or `grpo` (rewarded rollouts, shard/objectives/grpo.py).

Every objective is an `Objective`: it says what its rows need, builds its batches, and computes its loss from the
model being trained and, where it asks for one, a frozen reference model; the step (shard/core/step.py) calls it
and has no loss of its own. The strategies (shardings, microbatches, the per-shard reduction) and the loop stay
the same: an objective's batch is a dict of arrays whose first dimension is the global batch's rows (split over
the batch axes like any batch, cut into microbatches by rows), and its loss is a mean over those rows, so
accumulation and the per-device reduction keep the whole batch's mean. Its metrics (name -> scalar, e.g.
`dpo/margin`) land in metrics.jsonl beside `loss`. The step adds what the trained model records in its last
forward pass (a router's load-balancing loss, logged as `aux_loss`: shard/nn/recorded.py), so `loss` runs the
trained model once over all the rows it trains on.

    objective = objectives.build(cfg)        # every objective, lm included
    objective.check(cfg, mesh_shape)         # what is not a pair of settings (e.g. GRPO's rows against grad_accum)
    data = objective.data(cfg, seed, cache)  # shard.data.Data whose batches the loss reads
    objective.check_outputs(outputs, batch)  # the model's abstract outputs on one batch, read by the loss
    objective.start(job, state, run_dir, main)   # the run's starting state, before its first step
    loss, metrics = objective.loss(model, batch, reference)   # inside the step, traced
    objective.eval_metrics(totals)           # eval_* from the eval step's sums (`eval_sums`)

What an objective does not combine with is data, as for the strategies: its `tags` (its name), `switches` (the
setting that gives each) and `refuses` ({(its tag, a strategy's tag): why}), checked with the strategies' own
pairs by shard/strategies/registry.py and shown in docs/meshes.md's table.

`model` and `reference` are nnx modules in the compute dtype (`reference` None unless `objective.reference`
is "init": then it is the starting weights, frozen: under LoRA the model without its adapters, else a copy
kept beside the trained weights by shard/strategies/reference.py). `eval_sums(model, batch, reference)` is
the eval step's: sums over the batch's real rows (`batch["mask"]`), with `count` and `loss`; by default other
keys are reported as `eval_<key>` divided by `count`.
"""

import importlib
from typing import ClassVar

from shard.core import losses
from shard.errors import UserError

# name -> the module with build(cfg) and OBJECTIVE, its class
MODULES = {"lm": "shard.objectives.lm", "dpo": "shard.objectives.dpo", "grpo": "shard.objectives.grpo"}


class Objective:
    """Defaults for an objective; `loss`, `eval_sums` and `data` are its own."""

    name: ClassVar[str] = ""
    # What it cannot run with, in one line each (as a strategy's: shard/strategies/base.py):
    refuses: ClassVar[dict[tuple[str, str], str]] = {}  # (one of my tags, a strategy's tag) -> why
    switches: ClassVar[dict[str, str]] = {}  # each of its tags -> the setting that gives it (the docs' table)
    reference: str | None = None  # "init": the step is handed the frozen starting weights as `reference`
    reference_label: str = ""     # the settings that ask for that reference, as refusals name them
    updates_per_step: int = 1     # optimizer updates a train step takes (the learning rate follows the steps)

    @property
    def tags(self) -> tuple[str, ...]:
        """What `refuses` pairs match, here and in the strategies' (shard/strategies/registry.py)."""
        return (self.name,)

    @property
    def label(self) -> str:
        """The setting that chose it, as a user writes it (refusals name it)."""
        return f"train.objective={self.name}"

    def check(self, cfg, mesh_shape: dict) -> None:
        """Refuse in one line what this objective does not combine with beyond a pair of tags (`refuses`)."""

    def columns(self, data_cfg) -> tuple[str, ...]:
        """The data columns each row is read from."""
        raise NotImplementedError

    def data(self, cfg, seed: int, cache_dir):
        """The run's data (shard.data.Data) in this objective's batches."""
        raise NotImplementedError

    def check_outputs(self, outputs, batch: dict) -> None:
        """Refuse in one line a model whose outputs (abstract, on one batch) the loss cannot read."""

    def loss(self, model, batch: dict, reference):
        """(the batch's mean loss, {metric name: scalar}) for `model` on `batch`."""
        raise NotImplementedError

    def eval_sums(self, model, batch: dict, reference) -> dict:
        """Sums over the batch's real rows (batch["mask"]): count, loss and any metric."""
        raise NotImplementedError

    def eval_metrics(self, totals: dict) -> dict:
        """The eval metrics from `eval_sums`' totals over the eval split: each a mean over its rows."""
        count = totals["count"]
        return {"eval_loss": totals["loss"] / count,
                **{f"eval_{k}": v / count for k, v in totals.items() if k not in ("count", "loss")}}

    def start(self, job, state, run_dir, main: bool) -> None:
        """Before the first step of a run (fresh or resumed), with its starting state: e.g. DPO's reference
        log-likelihoods computed once (train.dpo.precompute). `main`: this is process 0."""

    def around(self, train_fn, graphdef, dtype, trainable=None):
        """The train step on this objective's batches, around `train_fn` (one optimiser step on the rows `loss`
        reads): as it is, unless the objective makes or weighs those rows in the step (GRPO's rollouts, lm's
        packed rows). `trainable`: LoRA's, whose `weights(state, get(state))` are the model the step trains."""
        return train_fn


def build(cfg) -> Objective:
    """The objective cfg names (train.objective)."""
    name = cfg.train.objective
    losses.resolve(cfg.train.loss, "lm")  # a misspelt train.loss is refused whatever the objective reads
    return _module(name).build(cfg)


def kinds() -> tuple[type, ...]:
    """Every objective's class, for the docs' table of refusals."""
    return tuple(_module(name).OBJECTIVE for name in MODULES)


def _module(name: str):
    try:
        return importlib.import_module(MODULES[name])
    except ModuleNotFoundError as e:
        if e.name != MODULES[name]:
            raise
        raise UserError(f"train.objective={name} is not available in this version; objectives: "
                        f"{', '.join(n for n in MODULES if n != name)}") from None
