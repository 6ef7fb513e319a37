"""The optimizer: AdamW (or SGD) with linear warmup, cosine decay and global-norm clipping (Optax)."""

import jax
import optax
from flax import nnx

from shard.nn.partition import logical_names, plays_vector


def build(cfg, total_steps: int, updates_per_step: int = 1) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(the optimizer, the learning rate as a function of the run's step). `updates_per_step`: optimizer updates
    a step takes (GRPO's train.grpo.updates on one batch of rollouts): each of a step's updates uses the step's
    rate, so warmup and decay span the run's steps whatever that count."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))  # a warmup longer than the run is cut to fit
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)
    rate = schedule if updates_per_step == 1 else (lambda count: schedule(count // updates_per_step))
    if cfg.name == "sgd":
        inner = optax.chain(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
                            optax.sgd(rate, momentum=cfg.momentum or None))
    else:
        inner = optax.adamw(rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), inner) if cfg.clip_norm > 0 else inner
    return tx, schedule


def decays(var) -> bool:
    """Whether weight decay applies: to matrices, not to biases, norm scales or other vectors.

    Decided from the parameter's own dimensions. With logical names, those named other than `layers`
    count (stacking scanned layers adds a dimension, not a matrix), and an unnamed axis inside a
    named parameter (the k/v pair, an LSTM's four gates, a router's experts, learned positions) is a
    grouping, not a matrix's rows or columns. Without names, every dimension counts. A bias or norm weight
    whose model says so (`role` metadata: a per-head bias, a projection-wide q/k norm) is none, whatever its rank.
    """
    if isinstance(var, nnx.LoRAParam):  # a low-rank adapter is a matrix; its rank axis carries no name
        return True
    if plays_vector(var):
        return False
    names = logical_names(var)
    if names is None:
        return jax.tree.leaves(var)[0].ndim >= 2
    return sum(1 for n in names if n is not None and n != "layers") >= 2


def decay_mask(params):
    """The mask optax.adamw applies weight decay through: `decays` for every parameter."""
    is_var = lambda x: isinstance(x, nnx.Variable)
    return jax.tree.map(lambda v: v.replace(decays(v)) if is_var(v) else decays(v), params, is_leaf=is_var)
