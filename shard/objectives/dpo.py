"""Direct preference optimisation (`train.objective=dpo`; Rafailov et al. 2023), on preference rows
(shard/data/preferences.py).

For each pair, the log-likelihood of each answer (the sum over its trained tokens of log p(token | before)),
under the model trained (pi) and the frozen reference (ref, `train.dpo.reference=init`: the starting weights,
shard/strategies/reference.py). The implicit rewards are r = beta * (log pi - log ref) of each answer;
the margin is r_chosen - r_rejected, and the loss (`train.dpo.loss`):

    sigmoid  -log sigmoid(margin)                               (DPO)
    ipo      (h - 1 / (2 beta))^2, h = the margin / beta, each answer's log-likelihoods averaged over its
             tokens (IPO, Azar et al. 2023, as TRL computes it)

`train.dpo.precompute=true` computes the reference's log-likelihoods once, before the first step, instead
(shard/objectives/precomputed.py). `train.dpo.reference=none` needs no reference: each answer's log-likelihood is
averaged over its tokens and r = beta * that average, the loss -log sigmoid(margin - gamma) with gamma =
`train.dpo.margin` (SimPO, Meng et al. 2024; beta there is larger, about 2). Logged: `dpo/margin`,
`dpo/chosen_reward`, `dpo/rejected_reward`, `dpo/accuracy` (the share of pairs whose margin is positive) and each
answer's mean log-likelihood under the model, `dpo/chosen_logp` and `dpo/rejected_logp`. The model trained runs
once over both answers of the pairs: what it records (a mixture of experts' load-balancing loss, logged as
`aux_loss`) the step adds to the loss, as TRL adds router_aux_loss_coef x aux_loss; the reference's are not added.
"""

import jax
import jax.numpy as jnp

from shard import data as data_lib
from shard.data import preferences
from shard.errors import UserError
from shard.objectives import Objective, precomputed


def build(cfg):
    dpo = cfg.train.dpo
    if dpo.precompute and dpo.reference != "init":
        raise UserError("train.dpo.precompute=true computes the reference's log-likelihoods; with "
                        "train.dpo.reference=none there is no reference")
    if dpo.precompute and cfg.train.lora.rank:
        raise UserError("train.dpo.precompute=true with train.lora.rank: under LoRA the reference is the weights "
                        "under the adapters and costs no memory; leave train.dpo.precompute=false")
    if dpo.reference == "init" and dpo.margin:
        raise UserError(f"train.dpo.margin={dpo.margin:g} is SimPO's, read with train.dpo.reference=none")
    return DPO(dpo.beta, dpo.loss, dpo.reference, dpo.margin, dpo.precompute)


def log_likelihoods(model, inputs, targets, mask):
    """Per row: the sum of log p(target) over the masked targets, and their number."""
    logits = model(inputs).astype(jnp.float32)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
    return jnp.sum(picked * mask, axis=-1), jnp.sum(mask, axis=-1)


def pair_log_likelihoods(model, batch: dict):
    """Per pair, of the chosen and the rejected answer: (log-likelihood sums, target counts). The model runs once
    on both answers' rows, as TRL's concatenated forward, so what it records (a router's load-balancing loss, which
    the step adds: shard/nn/recorded.py) is over every row the loss reads. Interleaved (each pair's answers side by
    side), so the rows a device holds stay its own."""
    both = lambda chosen, rejected: jnp.stack([batch[chosen], batch[rejected]], axis=1).reshape(
        -1, *batch[chosen].shape[1:])
    sums, counts = log_likelihoods(model, both("inputs", "rejected_inputs"), both("targets", "rejected_targets"),
                                   both("chosen_mask", "rejected_mask"))
    return tuple(sums.reshape(-1, 2).T), tuple(counts.reshape(-1, 2).T)


class DPO(Objective):
    name = "dpo"
    switches = {"dpo": "`train.objective=dpo`"}
    refuses = {("dpo", "pipeline"): "the pipeline's schedule runs one sequence per row, and a preference row holds "
                                    "two; use mesh.stage=1",
               ("dpo", "context"): "the sequence split orders one sequence per row, and a preference row holds two; "
                                   "use mesh.context=1"}

    def __init__(self, beta: float, loss: str, reference: str, margin: float = 0.0, precompute: bool = False):
        self.beta, self.kind, self.margin, self.precompute = beta, loss, margin, precompute
        # the step's frozen reference (shard/strategies/reference.py), unless its values ride in the batches
        self.reference = "init" if reference == "init" and not precompute else None
        self.averaged = loss == "ipo" or reference == "none"  # log-likelihoods per token, not per answer
        self.reference_label = "train.objective=dpo with train.dpo.reference=init"
        self.splits = {}  # precompute: the pairs whose reference columns `start` fills

    def columns(self, data_cfg) -> tuple[str, ...]:
        return preferences.columns(data_cfg)

    def data(self, cfg, seed: int, cache_dir):
        train, held = preferences.splits(cfg.data)
        if self.precompute:
            for pairs in (train, held):
                pairs.arrays.update(precomputed.columns(len(pairs)))
            self.splits = {"train": train, "eval": held}
        data = data_lib.of_sources(cfg.data, seed, train, held, "lm", lambda b: b, 2 * cfg.data.seq_len,
                                   data_lib.vocab_size(cfg.data))
        data.largest_token = max(int(pairs.arrays[k].max(initial=0)) for pairs in (train, held)
                                 for k in ("inputs", "rejected_inputs"))  # the job checks it against the embedding
        return data

    def start(self, job, state, run_dir, main: bool) -> None:
        if self.precompute:
            precomputed.fill(self.splits, job, state, run_dir, main, log_likelihoods)

    def rewards(self, model, batch: dict, reference):
        """Per pair: (chosen reward, rejected reward, chosen log-likelihood, rejected log-likelihood)."""
        logps, counts = pair_log_likelihoods(model, batch)
        if self.precompute:
            ref = [batch["chosen_ref"], batch["rejected_ref"]]
        elif reference is not None:  # each answer on its own, as train.dpo.precompute computes it
            sides = ((batch["inputs"], batch["targets"], batch["chosen_mask"]),
                     (batch["rejected_inputs"], batch["rejected_targets"], batch["rejected_mask"]))
            ref = [jax.lax.stop_gradient(log_likelihoods(reference, *side)[0]) for side in sides]
        else:
            ref = [jnp.zeros_like(logps[0])] * 2
        if self.averaged:
            logps = [lp / jnp.maximum(n, 1.0) for lp, n in zip(logps, counts)]
            ref = [r / jnp.maximum(n, 1.0) for r, n in zip(ref, counts)]
        chosen, rejected = (self.beta * (lp - r) for lp, r in zip(logps, ref))
        return chosen, rejected, *logps

    def per_pair(self, model, batch: dict, reference) -> dict:
        chosen, rejected, chosen_logp, rejected_logp = self.rewards(model, batch, reference)
        margin = chosen - rejected
        if self.kind == "ipo":
            losses = (margin / self.beta - 1.0 / (2.0 * self.beta)) ** 2
        else:
            losses = -jax.nn.log_sigmoid(margin - self.margin)
        return {"loss": losses, "dpo/margin": margin, "dpo/chosen_reward": chosen, "dpo/rejected_reward": rejected,
                "dpo/accuracy": (margin > 0).astype(jnp.float32), "dpo/chosen_logp": chosen_logp,
                "dpo/rejected_logp": rejected_logp}

    def loss(self, model, batch: dict, reference):
        means = {k: jnp.mean(v) for k, v in self.per_pair(model, batch, reference).items()}
        return means.pop("loss"), means

    def eval_sums(self, model, batch: dict, reference) -> dict:
        mask = batch["mask"]
        sums = {k: jnp.sum(mask * v) for k, v in self.per_pair(model, batch, reference).items()}
        return {"count": jnp.sum(mask), **sums}


OBJECTIVE = DPO
