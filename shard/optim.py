"""The optimizer: AdamW with linear warmup, cosine decay and global-norm clipping (Optax)."""

import jax
import optax


def build(cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))  # a warmup longer than the run is cut to fit
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)
    # Decay matrices only: biases, norm scales and other vectors keep their values.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw) if cfg.clip_norm > 0 else adamw
    return tx, schedule
