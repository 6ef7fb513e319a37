"""How a mixture of experts' router turns its logits into each token's chosen experts and their weights, for the
routers of the 2026 families (models/moe.py's `router` option and those beside it):

- "softmax_topk": a softmax over all experts, the top_k of the probabilities taken (Mixtral, Qwen3-MoE, OLMoE,
  Qwen3.5, Gemma 4); norm_topk renormalises the chosen ones to sum to 1.
- "topk_softmax": the top_k logits taken, a softmax over those alone (GPT-OSS): the weights sum to 1 already.
- "sigmoid": each expert's own sigmoid score, the top_k taken (DeepSeek-V3, GLM-4.5); norm_topk divides the chosen
  scores by their sum (plus 1e-20, as those families do).
- "topk_sigmoid": the top_k logits taken, each weight the sigmoid of its logit (Llama 4, whose experts are scaled on
  their input by it: models/moe.py's weigh_inputs).

Beside the kind: a correction (per expert) added to the scores the experts are chosen by and not to the weights
(DeepSeek-V3's e_score_correction_bias; the "topk_*" kinds choose by logits, so it adds to those); group-limited
choice (n_group groups of experts, each scored by the sum of its two best, only the best topk_group groups' experts
eligible: DeepSeek-V3); a learned factor per expert on its weight (Gemma 4's per_expert_scale) and one constant
factor on all of them (routed_scaling_factor), both after the renormalisation.

`route` also returns each token's distribution over all experts that the load-balancing loss averages: the softmax
of the logits, or for "sigmoid" the scores divided by their sum (DeepSeek-V3's sequence-wise balance loss).
"""

import jax
import jax.numpy as jnp

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid", "topk_sigmoid")


def check(router: str, n_experts: int, top_k: int, n_group: int, topk_group: int, routed_scaling: float,
          score_correction: bool, correction_rate: float) -> None:
    """One ValueError line for router options that cannot route (models/layers.py's check_choice for the kind)."""
    if router not in ROUTERS:
        raise ValueError(f"router={router!r}; choose one of {', '.join(ROUTERS)}")
    if n_group < 1 or n_experts % n_group:
        raise ValueError(f"n_group={n_group} must be a positive divisor of n_experts={n_experts}")
    if n_group > 1 and n_experts // n_group < 2:
        raise ValueError(f"n_group={n_group}: each group of the {n_experts} experts needs at least 2 (a group is "
                         "scored by its two best)")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={n_group}")
    if top_k > topk_group * (n_experts // n_group):
        raise ValueError(f"top_k={top_k} is more than the {topk_group * (n_experts // n_group)} experts of the "
                         f"topk_group={topk_group} groups a token may choose from")
    if not routed_scaling > 0:
        raise ValueError(f"routed_scaling={routed_scaling} must be positive")
    if correction_rate < 0 or correction_rate and not score_correction:
        raise ValueError(f"correction_rate={correction_rate} must be >= 0, and > 0 only with score_correction=true "
                         "(the rate updates its bias)")


def route(logits, router: str, top_k: int, norm_topk: bool, correction=None, n_group: int = 1, topk_group: int = 1,
          scale=None, scaling: float = 1.0):
    """logits (..., n_experts), float32 -> (top_p, top_e, probs): the chosen experts' weights and indices (..., top_k),
    and the distribution the balancing loss averages (..., n_experts). correction: (n_experts,) added to the scores
    for the choice only, or None; scale: (n_experts,) a factor on each chosen expert's weight, or None."""
    if router == "softmax_topk":
        probs = by = jax.nn.softmax(logits, axis=-1)
    elif router == "sigmoid":
        by = jax.nn.sigmoid(logits)
        probs = by / jnp.sum(by, axis=-1, keepdims=True)
    else:  # the "topk_*" kinds choose by the logits themselves
        by, probs = logits, jax.nn.softmax(logits, axis=-1)
    if correction is None and n_group == 1:
        top, top_e = jax.lax.top_k(by, top_k)
    else:
        choice = by if correction is None else by + correction
        if n_group > 1:
            choice = limit_groups(choice, n_group, topk_group)
        top_e = jax.lax.top_k(choice, top_k)[1]
        top = jnp.take_along_axis(by, top_e, axis=-1)  # the weights from the uncorrected scores
    if router == "topk_softmax":
        top_p = jax.nn.softmax(top, axis=-1)
    else:
        top_p = jax.nn.sigmoid(top) if router == "topk_sigmoid" else top
        if norm_topk:  # the chosen experts' weights sum to 1
            total = jnp.sum(top_p, axis=-1, keepdims=True)
            top_p = top_p / (total + 1e-20 if router == "sigmoid" else total)
    if scale is not None:
        top_p = top_p * scale[top_e]
    if scaling != 1.0:
        top_p = top_p * scaling
    return top_p, top_e, probs


def limit_groups(choice, n_group: int, topk_group: int):
    """The choice scores with every expert outside its token's topk_group best groups at -inf; a group's score is the
    sum of its two best experts' (DeepSeek-V3's group-limited routing)."""
    grouped = choice.reshape(*choice.shape[:-1], n_group, -1)
    best = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), topk_group)[1]  # (..., topk_group)
    kept = jnp.any(jax.nn.one_hot(best, n_group, dtype=jnp.bool_), axis=-2)     # (..., n_group)
    return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)


def input_norm(x, scale, eps: float):
    """Gemma 4's router input: x RMS-normalised in float32 without a weight, times a learned scale per channel and
    1/sqrt(width)."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return h * scale * x.shape[-1] ** -0.5


def corrected(correction, tally, rate: float):
    """The auxiliary-loss-free update of a correction from the load a step tallied (DeepSeek-V3): an expert chosen
    more than the mean loses `rate`, one chosen less gains it; (..., n_experts) arrays, any leading (stacked layers)."""
    return correction + rate * jnp.sign(jnp.mean(tally, axis=-1, keepdims=True) - tally)
