"""What the train step optimises, `train.objective`: `lm` (the default: `train.loss` on the data's targets, the
step's own path in shard/core/step.py, unchanged), `dpo` (preference pairs, shard/objectives/dpo.py) or `grpo`
(rewarded rollouts, shard/objectives/grpo.py).

An objective other than `lm` is an `Objective`: it says what its rows need, builds its batches, and computes
its loss from the model being trained and, where it asks for one, a frozen reference model. The step, the
strategies (shardings, microbatches, the per-shard reduction) and the loop stay the same: an objective's batch
is a dict of arrays whose first dimension is the global batch's rows (split over the batch axes like any
batch, cut into microbatches by rows), and its loss is a mean over those rows, so accumulation and the
per-device reduction keep the whole batch's mean. Its metrics (name -> scalar, e.g. `dpo/margin`) land in
metrics.jsonl beside `loss`. The step adds what the trained model records in its last forward pass (a router's
load-balancing loss, logged as `aux_loss`: shard/nn/recorded.py), as for lm, so `loss` runs the trained model once
over all the rows it trains on.

    objective = objectives.build(cfg)        # None for lm
    objective.check(cfg, mesh_shape)         # what it does not combine with: one line (UserError)
    data = objective.data(cfg, seed, cache)  # shard.data.Data whose batches the loss reads
    objective.start(job, state, run_dir, main)   # the run's starting state, before its first step
    loss, metrics = objective.loss(model, batch, reference)   # inside the step, traced

`model` and `reference` are nnx modules in the compute dtype (`reference` None unless `objective.reference`
is "init": then it is the starting weights, frozen: under LoRA the model without its adapters, else a copy
kept beside the trained weights by shard/strategies/reference.py). `eval_sums(model, batch, reference)` is
the eval step's: sums over the batch's real rows (`batch["mask"]`), with `count` and `loss`; other keys are
reported as `eval_<key>` divided by `count`.
"""

import importlib

from shard.errors import UserError

MODULES = {"dpo": "shard.objectives.dpo", "grpo": "shard.objectives.grpo"}  # name -> module with build(cfg)


class Objective:
    """Defaults for an objective; `loss` and `data` are its own."""

    name: str = ""
    reference: str | None = None  # "init": the step is handed the frozen starting weights as `reference`
    reference_label: str = ""     # the settings that ask for that reference, as refusals name them
    updates_per_step: int = 1     # optimizer updates a train step takes (the learning rate follows the steps)

    def check(self, cfg, mesh_shape: dict) -> None:
        """Refuse in one line what this objective does not combine with (a mesh axis, a strategy)."""

    def columns(self, data_cfg) -> tuple[str, ...]:
        """The data columns each row is read from."""
        raise NotImplementedError

    def data(self, cfg, seed: int, cache_dir):
        """The run's data (shard.data.Data) in this objective's batches."""
        raise NotImplementedError

    def loss(self, model, batch: dict, reference):
        """(the batch's mean loss, {metric name: scalar}) for `model` on `batch`."""
        raise NotImplementedError

    def eval_sums(self, model, batch: dict, reference) -> dict:
        """Sums over the batch's real rows (batch["mask"]): count, loss and any metric."""
        raise NotImplementedError

    def start(self, job, state, run_dir, main: bool) -> None:
        """Before the first step of a run (fresh or resumed), with its starting state: e.g. DPO's reference
        log-likelihoods computed once (train.dpo.precompute). `main`: this is process 0."""

    def around(self, train_fn, graphdef, dtype, trainable=None):
        """The train step on this objective's batches, around `train_fn` (one optimiser step on the rows `loss`
        reads): as it is, unless the objective makes those rows in the step (GRPO's rollouts). `trainable`: LoRA's,
        whose `weights(state, get(state))` are the model the step trains."""
        return train_fn


def build(cfg) -> Objective | None:
    """The objective cfg names (train.objective), or None for `lm` (the step's own loss)."""
    name = cfg.train.objective
    if name == "lm":
        return None
    try:
        module = importlib.import_module(MODULES[name])
    except ModuleNotFoundError as e:
        if e.name != MODULES[name]:
            raise
        raise UserError(f"train.objective={name} is not available in this version; objectives: lm, "
                        f"{', '.join(n for n in MODULES if n != name)}") from None
    return module.build(cfg)
