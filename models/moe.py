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
chosen weights to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob), else they stay the probabilities. The other
routers of the 2026 families, chosen by `router` and the options beside it, are models/routers.py's; around the
routed experts a block may have shared experts (a dense MLP every token goes through, its output added, sigmoid-gated
or not), and the model's first `dense_layers` blocks may keep a dense MLP (DeepSeek-V3's first_k_dense_replace).

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

from shard.nn.hooks import dense, experts, grouped_matmul, layout
from shard.nn.partition import constrain
from shard.nn.recorded import AuxLoss, Stat

from . import mixed, routers
from .gpt import GPT
from .layers import MLPBlock, check_choice, param, zeros


class ExpertLoad(nnx.Variable):
    """Share of routing choices per expert in the last forward pass (not trained, not logged)."""


class RouterMean(nnx.Variable):
    """Mean router probability per expert in the last forward pass (not trained, not logged)."""


class ScoreCorrection(nnx.Variable):
    """Per expert, added to the router's scores for choosing experts only (DeepSeek-V3's e_score_correction_bias).
    Never trained: loaded, or moved once per optimizer step by the load the step tallied (`correction_rate`)."""


class ExpertTally(nnx.Variable):
    """The shares of routing choices per expert summed over the forward passes since the last optimizer update (its
    microbatches'), which `after_update` turns into the correction's step and clears."""


ROUTINGS = ("capacity", "dropless")
EXPERT_ARRAYS = ("w_in", "w_out", "w_gate", "b_in", "b_out", "b_gate")  # each with the experts first
BALANCING = ("per_layer", "pooled")


class MoELayer(nnx.Module):
    """The experts of one block and their router; the keyword options are the MoE's of the same names (its
    docstring), shared_d_ff the shared MLP's whole width (0: none) and norm_eps the router input norm's epsilon."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, capacity_factor: float,
                 aux_loss_weight: float, swiglu: bool, out_std: float, rngs: nnx.Rngs, routing: str = "capacity",
                 norm_topk: bool = True, *, router: str = "softmax_topk", router_bias: bool = False,
                 router_norm: bool = False, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
                 score_correction: bool = False, correction_rate: float = 0.0, expert_scale: bool = False,
                 weigh_inputs: bool = False, shared_d_ff: int = 0, shared_gate: bool = False, norm_eps: float = 1e-6,
                 expert_bias: bool = False, swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702):
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_weight, self.routing, self.norm_topk = aux_loss_weight, routing, norm_topk
        self.router_kind, self.routed_scaling = router, routed_scaling
        self.n_group, self.topk_group = n_group, topk_group
        self.correction_rate, self.weigh_inputs, self.norm_eps = correction_rate, weigh_inputs, norm_eps
        # The router stays float32 under bfloat16 training (the step does not cast it), and its logits and
        # softmax are computed in float32: top-k must not choose from rounded scores (Switch Transformer). So do the
        # parameters that shape its choice or weights.
        self.router = nnx.Param(0.02 * jax.random.normal(rngs.params(), (d_model, n_experts)),
                                out_sharding=("embed", None), full_precision=True)
        self.router_bias = nnx.Param(jnp.zeros((n_experts,)), out_sharding=(None,), full_precision=True,
                                     role="bias") if router_bias else None
        self.router_scale = nnx.Param(jnp.ones((d_model,)), out_sharding=("embed",), full_precision=True,
                                      role="norm") if router_norm else None
        self.expert_scale = nnx.Param(jnp.ones((n_experts,)), out_sharding=(None,),
                                      full_precision=True) if expert_scale else None
        self.correction = ScoreCorrection(jnp.zeros((n_experts,))) if score_correction else None
        self.tally = ExpertTally(jnp.zeros((n_experts,))) if correction_rate else None
        self.w_in = param(rngs, (n_experts, d_model, d_ff), ("experts", "embed", "mlp"), 0.02)
        self.w_gate = param(rngs, (n_experts, d_model, d_ff), ("experts", "embed", "mlp"), 0.02) if swiglu else None
        self.w_out = param(rngs, (n_experts, d_ff, d_model), ("experts", "mlp", "embed"), out_std)
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.gate_act = jax.nn.gelu if swiglu == "geglu" else jax.nn.silu  # (swiglu: True, False or "geglu")
        # GPT-OSS's experts have biases: per expert, on each matrix's output
        self.b_in = zeros((n_experts, d_ff), ("experts", "mlp")) if expert_bias else None
        self.b_gate = zeros((n_experts, d_ff), ("experts", "mlp")) if expert_bias and swiglu else None
        self.b_out = zeros((n_experts, d_model), ("experts", "embed")) if expert_bias else None
        self.shared = MLPBlock(d_model, shared_d_ff, swiglu, out_std, rngs) if shared_d_ff else None
        self.shared_gate = param(rngs, (d_model, 1), ("embed", None), 0.02) if shared_gate else None
        self.load = ExpertLoad(jnp.zeros((n_experts,)))
        self.router_mean = RouterMean(jnp.zeros((n_experts,)))

    def capacity(self, length: int) -> int:
        """Slots per expert per sequence: its fair share of the length x top_k choices, times the factor."""
        return max(1, math.ceil(self.capacity_factor * length * self.top_k / self.n_experts))

    def __call__(self, x, route_from=None):  # (batch, length, d_model)
        """The experts' output for x, routed by x or by `route_from` (Gemma 4 routes the residual stream and sends
        its normed copy to the experts)."""
        top_p, top_e, probs = self.route(x if route_from is None else route_from)  # (b, t, k) twice, (b, t, n)
        chosen = jax.nn.one_hot(top_e, self.n_experts, dtype=jnp.float32)  # (b, t, k, n)
        if self.routing == "dropless":
            y = self.dropless(x, top_p, top_e, weigh_inputs=self.weigh_inputs)
        else:
            y = self.by_capacity(x, top_p, chosen)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:  # Qwen3-Next and 3.5: a sigmoid gate per token
                shared = jax.nn.sigmoid(dense(x, self.shared_gate[...])) * shared
            y = y + shared

        share = jnp.mean(chosen, axis=(0, 1, 2))  # f_e: share of all routing choices
        self.load.set_value(share)
        self.router_mean.set_value(jnp.mean(probs, axis=(0, 1)))
        if self.tally is not None:  # summed over a step's microbatches (a pipeline's: averaged, the same signs)
            self.tally.set_value(self.tally.get_value() + share)
        return constrain(y, ("batch", "length", "embed"))

    def route(self, x):
        """(top_p, top_e, probs): each token's chosen experts' weights and indices, its distribution over all experts
        for the balancing loss (models/routers.py), from float32 logits."""
        h = x.astype(jnp.float32)
        if self.router_scale is not None:
            h = routers.input_norm(h, self.router_scale[...], self.norm_eps)
        logits = jnp.einsum("btd,de->bte", h, self.router[...])
        if self.router_bias is not None:
            logits = logits + self.router_bias[...]
        vector = lambda v: None if v is None else v[...]  # noqa: E731
        return routers.route(logits, self.router_kind, self.top_k, self.norm_topk, vector(self.correction),
                             self.n_group, self.topk_group, vector(self.expert_scale), self.routed_scaling)

    def after_update(self):
        """Once per optimizer step (shard/nn/recorded.py's after_update): the correction moved by the step's load,
        the tally cleared; never by gradient, nor by evaluation or generation, which run no update."""
        if self.tally is not None:
            tally = self.tally.get_value()
            self.correction.set_value(routers.corrected(self.correction.get_value(), tally, self.correction_rate))
            self.tally.set_value(jnp.zeros_like(tally))

    def dropless(self, x, top_p, top_e, weigh_inputs: bool = False):
        """Each (token, choice) pair through its expert (shard.nn.hooks.experts: each device sorts its own tokens by
        expert; under expert parallelism they travel to the experts' devices in buckets of capacity_factor times a
        fair share), one grouped product per matrix over the experts' runs. weigh_inputs: each pair's token times
        its weight goes in, the outputs are summed unweighted (Llama 4)."""
        names = [n for n in EXPERT_ARRAYS if getattr(self, n) is not None]

        def mlp(xs, sizes, weights):
            w = dict(zip(names, weights))
            if "b_in" in w:  # each row's expert's bias; rows past the runs stay zero, as the products write them
                expert = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=xs.shape[0])
                real = (jnp.arange(xs.shape[0]) < jnp.sum(sizes))[:, None]
            add = lambda h, b: h if b not in w else h + jnp.where(real, w[b][expert], 0).astype(h.dtype)  # noqa: E731
            h = add(grouped_matmul(xs, w["w_in"], sizes), "b_in")
            gate = add(grouped_matmul(xs, w["w_gate"], sizes), "b_gate") if "w_gate" in w else None
            return add(grouped_matmul(self.activation(h, gate), w["w_out"], sizes), "b_out")

        weights = tuple(getattr(self, n)[...] for n in names)
        return experts(mlp, x, top_e, top_p, weights, slack=self.capacity_factor, weigh_inputs=weigh_inputs)

    def activation(self, h, gate):
        """The experts' hidden activation of the up projection h and the gate (None: GELU of h). With swiglu_limit,
        GPT-OSS's clamped SwiGLU: the gate clamped above and h on both sides at the limit, (h + 1) times
        gate x sigmoid(swiglu_alpha x gate); else silu(gate) x h (GeGLU's experts: the tanh GELU of the gate)."""
        if gate is None:
            return jax.nn.gelu(h)
        if not self.swiglu_limit:
            return self.gate_act(gate) * h
        gate, h = jnp.minimum(gate, self.swiglu_limit), jnp.clip(h, -self.swiglu_limit, self.swiglu_limit)
        return (h + 1) * gate * jax.nn.sigmoid(self.swiglu_alpha * gate)

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
        if self.weigh_inputs:  # Llama 4: the weight scales what goes into the expert, its output added as it is
            dispatch, combine = combine, dispatch.astype(x.dtype)

        xe = constrain(jnp.einsum("btnc,btd->nbcd", dispatch.astype(x.dtype), x), ("experts", "batch", None, "embed"))
        per_expert = lambda b: 0 if b is None else b[...][:, None, None]  # noqa: E731  (n, 1, 1, width)
        h = jnp.einsum("nbcd,ndf->nbcf", xe, self.w_in[...]) + per_expert(self.b_in)
        gate = None if self.w_gate is None else \
            jnp.einsum("nbcd,ndf->nbcf", xe, self.w_gate[...]) + per_expert(self.b_gate)
        h = self.activation(h, gate)
        h = constrain(h, ("experts", "batch", None, "mlp"))
        ye = jnp.einsum("nbcf,nfd->nbcd", h, self.w_out[...]) + per_expert(self.b_out)
        ye = constrain(ye, ("experts", "batch", None, "embed"))
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

    The router (models/routers.py): router picks how logits become choices and weights ("softmax_topk", the default;
    "topk_softmax": GPT-OSS; "sigmoid": DeepSeek-V3, GLM-4.5; "topk_sigmoid": Llama 4); router_bias: a learned bias on
    its logits (GPT-OSS); router_norm: its input RMS-normalised (norm_eps), times a learned scale and 1/sqrt(d_model)
    (Gemma 4); n_group, topk_group: group-limited choice, only the experts of a token's topk_group best of n_group
    groups eligible (1, 1: none); routed_scaling: a factor on every chosen weight (DeepSeek-V3's routed_scaling_factor);
    score_correction: a per-expert bias on the scores that choose, not on the weights (DeepSeek-V3), not trained: it
    stays as loaded, or with correction_rate > 0 moves that much per optimizer step against the step's load
    (auxiliary-loss-free balancing); expert_scale: a learned factor per expert on its weight (Gemma 4);
    weigh_inputs: the weight multiplies the expert's input, its output added unweighted (Llama 4).
    shared_experts: that many experts of width shared_d_ff (0 = d_ff) every token goes through, one dense MLP whose
    output is added (DeepSeek-V3, Llama 4); shared_gate: that output times sigmoid(x . w) per token (Qwen3-Next, 3.5).
    dense_layers: the first that many layers keep a dense MLP of width dense_d_ff (0 = d_ff), stacked apart
    (`dense_blocks`) before the experts' layers (DeepSeek-V3's first_k_dense_replace).
    beside_d_ff: every layer's experts work beside a dense MLP of this width (mlp's kind), each with a norm before
    and after, their outputs summed (Gemma 4's MoE block; 0: none): models/mixed.py's Beside.
    expert_bias: each expert's matrices have biases (GPT-OSS); swiglu_limit: the experts' SwiGLU clamped at it and
    offset as GPT-OSS's, (clip(up) + 1) x gate x sigmoid(swiglu_alpha x gate) with the gate clamped above (0: plain).
    """

    def __init__(self, n_experts: int = 8, top_k: int = 2, capacity_factor: float = 1.25,
                 aux_loss_weight: float = 0.01, routing: str = "capacity", norm_topk: bool = True,
                 balancing: str = "per_layer", router: str = "softmax_topk", router_bias: bool = False,
                 router_norm: bool = False, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
                 score_correction: bool = False, correction_rate: float = 0.0, expert_scale: bool = False,
                 weigh_inputs: bool = False, shared_experts: int = 0, shared_d_ff: int = 0, shared_gate: bool = False,
                 dense_layers: int = 0, dense_d_ff: int = 0, expert_bias: bool = False, swiglu_limit: float = 0.0,
                 swiglu_alpha: float = 1.702, beside_d_ff: int = 0, *, rngs: nnx.Rngs, **gpt):
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be positive")
        check_choice("routing", routing, ROUTINGS)
        check_choice("balancing", balancing, BALANCING)
        routers.check(router, n_experts, top_k, n_group, topk_group, routed_scaling, score_correction, correction_rate)
        for name, value in (("shared_experts", shared_experts), ("shared_d_ff", shared_d_ff),
                            ("dense_layers", dense_layers), ("dense_d_ff", dense_d_ff), ("beside_d_ff", beside_d_ff)):
            if value < 0:
                raise ValueError(f"{name}={value} must be >= 0")
        if swiglu_limit < 0 or swiglu_limit and gpt.get("mlp") != "swiglu":
            raise ValueError(f"swiglu_limit={swiglu_limit} clamps a SwiGLU's experts: give a limit > 0 with "
                             "mlp=swiglu, or 0 for none")
        if shared_gate and not shared_experts:
            raise ValueError("shared_gate=true gates the shared experts: set shared_experts >= 1")
        self.n_experts, self.top_k, self.routing, self.norm_topk = n_experts, top_k, routing, norm_topk
        self.capacity_factor, self.aux_loss_weight, self.balancing = capacity_factor, aux_loss_weight, balancing
        self.dense_layers, self.dense_d_ff = dense_layers, dense_d_ff
        self.shared_experts, self.shared_d_ff, self.beside_d_ff = shared_experts, shared_d_ff, beside_d_ff
        self.layer_options = dict(router=router, router_bias=router_bias, router_norm=router_norm, n_group=n_group,
                                  topk_group=topk_group, routed_scaling=routed_scaling,
                                  score_correction=score_correction, correction_rate=correction_rate,
                                  expert_scale=expert_scale, weigh_inputs=weigh_inputs, shared_gate=shared_gate,
                                  expert_bias=expert_bias, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
        super().__init__(**gpt, rngs=rngs)
        self.min_expert_share = Stat(jnp.zeros(()))
        self.aux_loss = AuxLoss(jnp.zeros(()))

    def feed_forward(self, d_model, d_ff, mlp, out_std, rngs, bias=False):
        if bias or self.mlp_bias:
            raise ValueError("the experts take no biases of the GPT's (bias, mlp_bias); expert_bias gives them theirs")
        gated = {"swiglu": True, "geglu": "geglu"}.get(mlp, False)
        experts = MoELayer(d_model, d_ff, self.n_experts, self.top_k, self.capacity_factor, self.aux_loss_weight,
                           gated, out_std, rngs, self.routing, self.norm_topk, **self.layer_options,
                           shared_d_ff=self.shared_experts * (self.shared_d_ff or d_ff), norm_eps=self.norm_eps)
        if not self.beside_d_ff:
            return experts
        return mixed.Beside(MLPBlock(d_model, self.beside_d_ff, mlp, out_std, rngs), experts, d_model, self.norm_kind,
                            self.norm_eps, rngs)

    def dense_first(self, n_layers: int, d_ff: int) -> tuple[int, int]:
        if not self.dense_layers < n_layers:
            raise ValueError(f"dense_layers={self.dense_layers} must leave at least one of the n_layers={n_layers} "
                             "layers to the experts")
        return self.dense_layers, self.dense_d_ff or d_ff

    def __call__(self, tokens):
        logits = super().__call__(tokens)
        if self.layers is not None:  # unlike layers, one by one: each one's experts
            found = [one.block.ffn.experts for one in self.layers if isinstance(one.block.ffn, mixed.Beside)]
            found += [one.block.ffn for one in self.layers if isinstance(one.block.ffn, MoELayer)]
            load = jnp.stack([e.load.get_value() for e in found])
            mean = jnp.stack([e.router_mean.get_value() for e in found])
        else:  # (layers, experts), written back by the stack of blocks; a scanned period's, place by place
            period = isinstance(self.blocks, mixed.Period)  # (its layers Blocks, or Gemma 4's Layers of one)
            ffns = [getattr(one, "block", one).ffn for one in self.blocks.layers] if period else [self.blocks.ffn]
            ffns = [f.experts if isinstance(f, mixed.Beside) else f for f in ffns]
            load = jnp.concatenate([f.load.get_value() for f in ffns])
            mean = jnp.concatenate([f.router_mean.get_value() for f in ffns])
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
