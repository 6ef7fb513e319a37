"""Standard losses by name (`train.loss`), and the default one for each task.

Every loss takes the model's raw outputs (logits or values; never probabilities) and the targets,
and returns the mean over all examples (and positions, for sequences).
"""

from functools import partial

import jax
import jax.numpy as jnp
import optax

from shard.errors import UserError


def mse(outputs, targets):
    """Mean squared error (regression)."""
    return jnp.mean((outputs.reshape(targets.shape) - targets) ** 2)


def binary_crossentropy(logits, targets):
    """Sigmoid cross-entropy against 0/1 targets, computed from logits for stability."""
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits.reshape(targets.shape), targets.astype(logits.dtype)))


def categorical_crossentropy(logits, targets):
    """Softmax cross-entropy against one-hot or multi-label (probability) targets over the last axis."""
    return jnp.mean(-jnp.sum(targets * jax.nn.log_softmax(logits, axis=-1), axis=-1))


def sparse_categorical_crossentropy(logits, labels):
    """Softmax cross-entropy against integer class labels (also next-token prediction)."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def categorical_hinge(outputs, targets):
    """max(0, 1 + best wrong-class score - true-class score), with one-hot targets."""
    positive = jnp.sum(targets * outputs, axis=-1)
    negative = jnp.max((1.0 - targets) * outputs, axis=-1)
    return jnp.mean(jnp.maximum(0.0, negative - positive + 1.0))


def squared_hinge(outputs, targets):
    """mean(max(0, 1 - y*t)^2) with targets in {-1, 1} (0/1 targets are mapped to -1/1)."""
    targets = targets.astype(outputs.dtype)
    signs = jnp.where(targets == 0, -1.0, targets)
    return jnp.mean(jnp.maximum(0.0, 1.0 - outputs.reshape(targets.shape) * signs) ** 2)


LOSSES = {f.__name__: f for f in (mse, binary_crossentropy, categorical_crossentropy,
                                  sparse_categorical_crossentropy, categorical_hinge, squared_hinge)}

DEFAULT_FOR_TASK = {
    "lm": "sparse_categorical_crossentropy",
    "classification": "sparse_categorical_crossentropy",
    "binary": "binary_crossentropy",
    "regression": "mse",
}


def resolve(name: str, task: str):
    if name == "auto":
        name = DEFAULT_FOR_TASK[task]
    if name not in LOSSES:
        raise UserError(f"unknown train.loss {name!r}; losses are: auto, {', '.join(LOSSES)}")
    return LOSSES[name]


def per_token(fn, outputs, targets):
    """`fn`'s value at each (row, position) of a sequence batch: (batch, length) losses, each the loss of
    that one target (the mean over a single element)."""
    one = lambda o, t: fn(o[None, None], t[None, None])
    return jax.vmap(jax.vmap(one))(outputs, targets)


def token_weights(loss_mask):
    """A packed batch's loss mask (1 where a target counts) scaled so that the plain mean over all of the
    global batch's slots of weight x token loss is the sum over real targets / their number. Every
    microbatch and data shard holds as many slots, so the equal-weight means over them that accumulation
    and the per-device reduction take stay the global token mean, whatever each row's real count.
    Returns (weights, number of real targets)."""
    count = jnp.sum(loss_mask)
    return loss_mask * (loss_mask.size / jnp.maximum(count, 1.0)), count


def weighted(fn, outputs, targets, weights):
    """The mean over every slot of weights x `fn`'s per-token loss (token_weights makes it a token mean)."""
    return jnp.mean(weights * per_token(fn, outputs, targets))


def trace(fn, outputs, batch: dict):
    """The loss alone, as the train step computes it, traced on the model's abstract outputs (cast to float32,
    as the step casts them) and the batch's targets: what fails here is the loss, not the model."""
    outputs = jax.ShapeDtypeStruct(outputs.shape, jnp.float32)
    if "loss_mask" in batch:
        return jax.eval_shape(partial(weighted, fn), outputs, batch["targets"], batch["loss_mask"])
    return jax.eval_shape(fn, outputs, batch["targets"])


def accuracy(outputs, targets, task: str):
    """Share of correct predictions: argmax for classes and tokens, sign of the logit for binary."""
    if task == "binary":
        return jnp.mean((outputs.reshape(targets.shape) > 0) == (targets > 0.5))
    return jnp.mean(jnp.argmax(outputs, axis=-1) == targets)
