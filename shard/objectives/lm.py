"""The data's own targets under `train.loss` (`train.objective=lm`, the default): next-token prediction on text and
documents, and the classification, binary or regression task of other data (digits, tabular, arrays, synthetic).

The model runs on the batch's inputs (a packed row's segment ids and positions reach its attention and position
embeddings through the hooks, shard/nn/hooks.py), its outputs in float32 go to `train.loss` (shard/core/losses.py;
`auto`: the task's default) with the targets. Packed rows (`loss_mask`, shard/data/packing.py) weigh each real
target alike over the whole global batch (`around`, before the step cuts it up), so microbatches and data shards
keep the batch's token mean. Eval sums the loss (per row, or per real target of packed rows), the accuracy of
classes and tokens, R^2's sums for regression, and the nats and UTF-8 bytes for bits per byte.
"""

import math
from contextlib import nullcontext
from functools import partial

import jax
import jax.numpy as jnp

from shard import data as data_lib
from shard.core import blame, losses
from shard.core.losses import accuracy
from shard.core.precision import cast_floats
from shard.data import formats
from shard.errors import UserError
from shard.nn import hooks
from shard.objectives import Objective


def build(cfg) -> "LM":
    return LM(cfg)


def run_model(model, batch: dict, dtype):
    """The model on a batch's inputs; a packed batch's segment ids and positions reach its attention and
    position embeddings through the hooks (shard/nn/hooks.py), so the model itself does not change."""
    with hooks.packed(batch.get("segment_ids"), batch.get("positions")):
        return model(cast_floats(batch["inputs"], dtype))


class LM(Objective):
    name = "lm"
    switches = {"lm": "`train.objective=lm`"}

    def __init__(self, cfg):
        self.loss_name = cfg.train.loss
        self.dtype = jnp.dtype(cfg.train.dtype)  # the compute dtype float inputs are cast to
        self.task, self.loss_fn = None, None  # the data's, once `data` has read it

    def columns(self, data_cfg) -> tuple[str, ...]:
        # documents are read by column; the other sources read whole rows of their own format
        return formats.columns(data_cfg) if data_cfg.name == "documents" else ()

    def data(self, cfg, seed: int, cache_dir):
        data = data_lib.build(cfg.data, seed, cache_dir=cache_dir)
        self.task, self.loss_fn = data.task, losses.resolve(self.loss_name, data.task)
        return data

    def check_outputs(self, outputs, batch: dict) -> None:
        try:  # the loss alone on the model's outputs: blamed only for what fails there
            losses.trace(self.loss_fn, outputs, batch)
        except Exception as e:
            targets = batch["targets"]
            raise UserError(f"train.loss={self.loss_fn.__name__} does not fit outputs {tuple(outputs.shape)} and "
                            f"targets {tuple(targets.shape)} {targets.dtype} (task {self.task}): "
                            f"{blame.describe(e)}") from None

    def around(self, train_fn, graphdef, dtype, trainable=None):
        def step(state, batch: dict):
            if "loss_mask" not in batch:
                return train_fn(state, batch)
            # packed rows: normalised over the whole global batch, before the step cuts it up
            weights, count = losses.token_weights(batch["loss_mask"])
            packed = {"target_tokens": count}  # the targets trained on (a fine-tuning row's completion only)
            if "segment_ids" in batch:  # the share of target slots that hold a real token
                packed["packing_efficiency"] = jnp.mean(batch["segment_ids"] > 0)
            state, out = train_fn(state, {**batch, "loss_mask": weights})
            return state, {**out, **packed}

        return step

    def loss(self, model, batch: dict, reference):
        # the next tokens, for a model that trains on tokens further ahead too (multi-token prediction)
        ahead = hooks.next_tokens(batch["targets"], batch.get("loss_mask")) if self.task == "lm" else nullcontext()
        with ahead:
            outputs = run_model(model, batch, self.dtype).astype(jnp.float32)
        if "loss_mask" in batch:  # packed rows: the real targets' mean (weights from `around`)
            return losses.weighted(self.loss_fn, outputs, batch["targets"], batch["loss_mask"]), {}
        return self.loss_fn(outputs, batch["targets"]), {}

    def eval_sums(self, model, batch: dict, reference) -> dict:
        outputs = run_model(model, batch, self.dtype).astype(jnp.float32)
        targets, mask, task = batch["targets"], batch["mask"], self.task
        per_example = lambda fn: jax.vmap(lambda o, t: fn(o[None], t[None]))(outputs, targets)
        if "loss_mask" in batch:  # packed rows: every real target counts once, padding not at all
            mask, per_example = mask[:, None] * batch["loss_mask"], partial(losses.per_token, outputs=outputs,
                                                                           targets=targets)
        token_losses = per_example(self.loss_fn)  # per row (mean), or per target of packed rows
        sums = {"count": jnp.sum(mask), "loss": jnp.sum(mask * token_losses)}
        if "bytes" in batch:  # the text the targets stand for: bits per byte whatever the tokenizer
            # nats: packed rows' target losses summed, else each row's mean loss x the tokens it is the mean of
            sums["nats"] = sums["loss"] if "loss_mask" in batch else jnp.sum(mask * token_losses * targets.shape[1])
            sums["bytes"] = jnp.sum(batch["mask"] * batch["bytes"].astype(jnp.float32))
        if task in ("classification", "binary", "lm"):
            sums["accuracy"] = jnp.sum(mask * per_example(lambda o, t: accuracy(o, t, task)))
        if task == "regression":  # for R^2 = 1 - SSE / total sum of squares
            weight = mask.reshape((-1,) + (1,) * (targets.ndim - 1)) * jnp.ones_like(targets)
            sums |= {"sse": jnp.sum(weight * (outputs.reshape(targets.shape) - targets) ** 2),
                     "y": jnp.sum(weight * targets), "y2": jnp.sum(weight * targets ** 2), "values": jnp.sum(weight)}
        return sums

    def eval_metrics(self, totals: dict) -> dict:
        count = totals["count"]
        metrics = {"eval_loss": totals["loss"] / count}
        if "accuracy" in totals:
            metrics["eval_accuracy"] = totals["accuracy"] / count
        if "sse" in totals:
            variance = totals["y2"] - totals["y"] ** 2 / totals["values"]
            metrics["eval_r2"] = 1.0 - totals["sse"] / max(variance, 1e-12)
        if "bytes" in totals:  # tokens of any tokenizer: the loss over the UTF-8 bytes they stand for
            metrics["eval_bits_per_byte"] = totals["nats"] / math.log(2) / max(totals["bytes"], 1.0)
        elif self.task == "lm":  # byte-level tokens, one byte each
            metrics["eval_bits_per_byte"] = metrics["eval_loss"] / math.log(2)
        return metrics


OBJECTIVE = LM
