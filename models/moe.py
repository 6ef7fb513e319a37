"""A mixture-of-experts transformer: the gpt decoder with each block's MLP replaced by n_experts
MLPs and a router that sends every token to its top_k experts (GShard/Switch style).

Two routings (`routing`):
- "capacity": dense dispatch and combine tensors, per example (each sequence is a group with its
  own expert capacity), so it is plain einsums that XLA can shard: with the expert weights split
  on `experts`, the einsum into expert order becomes an all-to-all to the experts' devices and the
  combine an all-to-all back. A token over its expert's capacity is dropped from that expert (its
  residual connection still carries it).
- "dropless": every token computed by each of its top_k experts, as Mixtral and Qwen3-MoE are
  (what a Hugging Face checkpoint needs to give its own numbers): the (token, choice) pairs sorted by
  expert and each expert's run multiplied by its weights in one grouped product (`jax.lax.ragged_dot`),
  through shard.nn.hooks.experts: under a mesh each device sorts its own tokens, and where the experts
  are split (`experts`) the tokens of a group of devices are gathered to each and its experts' results
  reduce-scattered back (shard/nn/dropless.py). XLA's CPU backend computes a ragged product as a dense
  one per expert (n_experts times its FLOPs).

The router's softmax is over all experts, then the top_k are taken; `norm_topk` renormalises the
chosen weights to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob), else they stay the probabilities.

The load-balancing loss (Switch Transformer): n_experts x sum_e f_e x p_e, where f_e is the share
of routing choices that picked expert e and p_e the mean router probability of e. It is 1 when
the load is uniform. Each layer records its f and p (means over the batch); the model turns them
into one `AuxLoss` (weighted by aux_loss_weight, added to the training loss by the framework)
after its stack has run: `balancing="per_layer"` sums each layer's term; "pooled" is transformers'
load_balancing_loss_func (Mixtral, Qwen3-MoE): f and p averaged over the layers first, each of the
top_k choices counted, n_experts x sum_e (top_k x mean f_e) x mean p_e (top_k when uniform).
Recording the means rather than the product keeps the loss that of the whole batch wherever the
batch is cut (a pipeline's microbatches average each layer's recorded variables). The model also
records `min_expert_share`: the least-loaded expert's share of
tokens relative to a fair share (1 = perfectly balanced), over all layers.
"""

import inspect
import math

import jax
import jax.numpy as jnp
from flax import nnx

from shard.nn.hooks import experts, grouped_matmul, layout
from shard.nn.partition import constrain
from shard.nn.recorded import AuxLoss, Stat

from .gpt import GPT
from .layers import check_choice, param


class ExpertLoad(nnx.Variable):
    """Share of routing choices per expert in the last forward pass (not trained, not logged)."""


class RouterMean(nnx.Variable):
    """Mean router probability per expert in the last forward pass (not trained, not logged)."""


ROUTINGS = ("capacity", "dropless")
BALANCING = ("per_layer", "pooled")


class MoELayer(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, capacity_factor: float,
                 aux_loss_weight: float, swiglu: bool, out_std: float, rngs: nnx.Rngs, routing: str = "capacity",
                 norm_topk: bool = True):
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_weight, self.routing, self.norm_topk = aux_loss_weight, routing, norm_topk
        # The router stays float32 under bfloat16 training (the step does not cast it), and its logits and
        # softmax are computed in float32: top-k must not choose from rounded scores (Switch Transformer).
        self.router = nnx.Param(0.02 * jax.random.normal(rngs.params(), (d_model, n_experts)),
                                out_sharding=("embed", None), full_precision=True)
        self.w_in = param(rngs, (n_experts, d_model, d_ff), ("experts", "embed", "mlp"), 0.02)
        self.w_gate = param(rngs, (n_experts, d_model, d_ff), ("experts", "embed", "mlp"), 0.02) if swiglu else None
        self.w_out = param(rngs, (n_experts, d_ff, d_model), ("experts", "mlp", "embed"), out_std)
        self.load = ExpertLoad(jnp.zeros((n_experts,)))
        self.router_mean = RouterMean(jnp.zeros((n_experts,)))

    def capacity(self, length: int) -> int:
        """Slots per expert per sequence: its fair share of the length x top_k choices, times the factor."""
        return max(1, math.ceil(self.capacity_factor * length * self.top_k / self.n_experts))

    def __call__(self, x):  # (batch, length, d_model)
        probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...]), axis=-1)
        top_p, top_e = jax.lax.top_k(probs, self.top_k)           # (b, t, k)
        if self.norm_topk:
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)  # the chosen experts' weights sum to 1
        chosen = jax.nn.one_hot(top_e, self.n_experts, dtype=jnp.float32)  # (b, t, k, n)
        y = self.dropless(x, top_p, top_e) if self.routing == "dropless" else self.by_capacity(x, top_p, chosen)

        share = jnp.mean(chosen, axis=(0, 1, 2))  # f_e: share of all routing choices
        self.load.set_value(share)
        self.router_mean.set_value(jnp.mean(probs, axis=(0, 1)))
        return constrain(y, ("batch", "length", "embed"))

    def dropless(self, x, top_p, top_e, weigh_inputs: bool = False):
        """Each (token, choice) pair through its expert (shard.nn.hooks.experts: each device sorts its own tokens by
        expert; under expert parallelism they travel to the experts' devices in buckets of capacity_factor times a
        fair share), one grouped product per matrix over the experts' runs. weigh_inputs: each pair's token times
        its weight goes in, the outputs are summed unweighted (Llama 4)."""
        def mlp(xs, sizes, weights):
            h = grouped_matmul(xs, weights[0], sizes)
            h = jax.nn.silu(grouped_matmul(xs, weights[2], sizes)) * h if len(weights) == 3 else jax.nn.gelu(h)
            return grouped_matmul(h, weights[1], sizes)

        weights = (self.w_in[...], self.w_out[...]) + ((self.w_gate[...],) if self.w_gate is not None else ())
        return experts(mlp, x, top_e, top_p, weights, slack=self.capacity_factor, weigh_inputs=weigh_inputs)

    def by_capacity(self, x, top_p, chosen):
        b, t, _ = x.shape
        n, k, cap = self.n_experts, self.top_k, self.capacity(t)
        # Queue position of each choice at its expert: first choices of all tokens before second choices, tokens
        # in row order (the framework may hold them in another: shard.nn.hooks.layout).
        in_order = jnp.argsort(layout(t))  # the tokens as they stand in the row
        by_rank = chosen[:, in_order].transpose(0, 2, 1, 3).reshape(b, k * t, n)
        position = (jnp.cumsum(by_rank, axis=1) - 1).reshape(b, k, t, n).transpose(0, 2, 1, 3)[:, jnp.argsort(in_order)]
        kept = chosen * (position < cap)
        slot = jax.nn.one_hot(jnp.sum(position * kept, axis=-1).astype(jnp.int32), cap, dtype=jnp.float32)
        dispatch = jnp.einsum("btkn,btkc->btnc", kept, slot)                        # 0/1: token -> (expert, slot)
        combine = jnp.einsum("btkn,btkc,btk->btnc", kept, slot, top_p).astype(x.dtype)

        xe = constrain(jnp.einsum("btnc,btd->nbcd", dispatch.astype(x.dtype), x), ("experts", "batch", None, "embed"))
        h = jnp.einsum("nbcd,ndf->nbcf", xe, self.w_in[...])
        if self.w_gate is not None:
            h = jax.nn.silu(jnp.einsum("nbcd,ndf->nbcf", xe, self.w_gate[...])) * h
        else:
            h = jax.nn.gelu(h)
        h = constrain(h, ("experts", "batch", None, "mlp"))
        ye = constrain(jnp.einsum("nbcf,nfd->nbcd", h, self.w_out[...]), ("experts", "batch", None, "embed"))
        return jnp.einsum("nbcd,btnc->btd", ye, combine)


def balancing_loss(load, router_mean, weight: float):
    """weight x n_experts x sum_e f_e p_e, summed over the layers of (layers, experts) arrays (or one layer's)."""
    return weight * load.shape[-1] * jnp.sum(load * router_mean)


class MoE(GPT):
    """The gpt decoder (all its options, as keyword arguments) with mixture-of-experts feed-forward blocks.

    n_experts experts per block, each token routed to top_k of them; routing: "capacity" (capacity_factor
    scales each expert's slots per sequence, tokens over it dropped) or "dropless" (every choice computed);
    norm_topk: the chosen experts' weights renormalised to sum to 1; aux_loss_weight weights the
    load-balancing loss, balancing says how layers combine in it ("per_layer" or transformers' "pooled").
    d_ff is each expert's hidden width (0 = 4 x d_model, 8/3 x d_model for SwiGLU).
    """

    def __init__(self, n_experts: int = 8, top_k: int = 2, capacity_factor: float = 1.25,
                 aux_loss_weight: float = 0.01, routing: str = "capacity", norm_topk: bool = True,
                 balancing: str = "per_layer", *, rngs: nnx.Rngs, **gpt):
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be positive")
        check_choice("routing", routing, ROUTINGS)
        check_choice("balancing", balancing, BALANCING)
        self.n_experts, self.top_k, self.routing, self.norm_topk = n_experts, top_k, routing, norm_topk
        self.capacity_factor, self.aux_loss_weight, self.balancing = capacity_factor, aux_loss_weight, balancing
        super().__init__(**gpt, rngs=rngs)
        self.min_expert_share = Stat(jnp.zeros(()))
        self.aux_loss = AuxLoss(jnp.zeros(()))

    def feed_forward(self, d_model, d_ff, mlp, out_std, rngs, bias=False):
        if mlp == "geglu" or bias or self.mlp_bias:
            raise ValueError("the experts take mlp=gelu or swiglu, without biases")
        return MoELayer(d_model, d_ff, self.n_experts, self.top_k, self.capacity_factor, self.aux_loss_weight,
                        mlp == "swiglu", out_std, rngs, self.routing, self.norm_topk)

    def __call__(self, tokens):
        logits = super().__call__(tokens)
        load = self.blocks.ffn.load.get_value()  # (layers, experts), written back by the stack of blocks
        mean = self.blocks.ffn.router_mean.get_value()
        self.min_expert_share.set_value(jnp.min(load) * self.n_experts)
        if self.balancing == "pooled":
            load, mean = self.top_k * jnp.mean(load, axis=0), jnp.mean(mean, axis=0)
        self.aux_loss.set_value(balancing_loss(load, mean, self.aux_loss_weight))
        return logits


def _signature() -> inspect.Signature:
    """MoE's own arguments and every GPT argument, as one signature: what the model registry checks model.*
    keys against, so that each option the GPT gains is the MoE's too without a second list of them."""
    gpt = [p for p in inspect.signature(GPT.__init__).parameters.values() if p.name not in ("self", "rngs")]
    own = [p.replace(kind=p.KEYWORD_ONLY) for p in inspect.signature(MoE.__init__).parameters.values()
           if p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "self"]
    rngs = inspect.signature(MoE.__init__).parameters["rngs"]
    self = inspect.signature(MoE.__init__).parameters["self"]
    return inspect.Signature([self, *(p.replace(kind=p.KEYWORD_ONLY) for p in gpt), *own, rngs])


MoE.__init__.__signature__ = _signature()
