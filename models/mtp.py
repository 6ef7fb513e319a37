"""Multi-token prediction (DeepSeek-V3's report, section 2.2; GLM-4.5's): `depth` modules after the model's stack, the
k-th predicting the token k + 1 places past the next one, an extra training loss.

Module k takes h^{k-1} (h^0: the model's last hidden state after its final norm, as vLLM's, SGLang's and Megatron's MTP
read it) and the embedding of the token k places ahead, x = eh_proj([enorm(Emb(t_{i+k})), hnorm(h^{k-1}_i)]) (the
embedding first), runs one decoder layer of the model's own (its experts' kind) over the same positions, causal, and
its own norm then the model's output layer give its logits for t_{i+k+1}. The loss of depth k is the mean cross entropy
over the positions whose target lies in the same document and is trained on; the model records their mean as the
`mtp_loss` stat and weight / depth x their sum as an auxiliary loss, which the train step adds (shard/nn/recorded.py).
The next tokens come from the train step's loss (shard.nn.hooks.next_tokens): evaluation, generation, DPO and GRPO
run no module, at no cost."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shard.nn import deferred, hooks
from shard.nn.partition import constrain
from shard.nn.recorded import AuxLoss, Stat

from .layers import norm, param, stacked


class Predictor(nnx.Module):
    """One depth: the norms of the embedding (enorm) and of the hidden state (hnorm), their projection (eh_proj, the
    2 d_model inputs the embedding's first), a decoder layer, and its output norm (shared_head.norm)."""

    def __init__(self, d_model: int, norm_kind: str, eps: float, block: nnx.Module, rngs: nnx.Rngs):
        self.enorm, self.hnorm = norm(norm_kind, d_model, rngs, eps), norm(norm_kind, d_model, rngs, eps)
        self.proj = param(rngs, (2, d_model, d_model), (None, "embed", None), 0.02)
        self.block = block
        self.norm = norm(norm_kind, d_model, rngs, eps)

    def __call__(self, given):
        """(h^{k-1}, the embeddings k places ahead) -> (h^k, its normed copy for the output layer)."""
        h, embedded = given
        w = self.proj[...]
        x = self.enorm(embedded) @ w[0] + self.hnorm(h) @ w[1]  # = concat([e, h]) @ eh_proj
        h = self.block(constrain(x, ("batch", "length", "embed")))
        return h, self.norm(h)


class MultiToken(nnx.Module):
    """`depth` Predictors stacked on a `layers` axis (models/layers.py's stacked), run in turn by a scan."""

    def __init__(self, depth: int, weight: float, d_model: int, norm_kind: str, eps: float, make_block, rngs):
        self.depth, self.weight = depth, weight
        self.layers = stacked(depth, lambda rngs: Predictor(d_model, norm_kind, eps, make_block(rngs), rngs), rngs)
        self.mtp_loss = Stat(jnp.zeros(()))
        self.loss = AuxLoss(jnp.zeros(()))

    def __call__(self, h, embed, unembed) -> None:
        """Record the losses for the model's last hidden state h (after its final norm), `embed(tokens)` its token
        embeddings and `unembed(h)` its logits; zeros where the step gives no next tokens (nothing runs)."""
        given = hooks.upcoming()
        if given is None:
            self.mtp_loss.set_value(jnp.zeros(()))
            self.loss.set_value(jnp.zeros(()))
            return
        targets, weights, segments = given
        ahead = jnp.stack([shifted(targets, k) for k in range(self.depth + 1)])  # t_{i+k+1} at i, k = 0..depth
        masks = jnp.stack([valid(targets.shape, weights, segments, k) for k in range(1, self.depth + 1)])
        apply = hooks.layer(deferred.in_layers(checkpointed=True))
        # packed rows' weights are the global batch's (the step's token_weights): their mean over every slot keeps a
        # microbatch's share of it; else the mean over the valid positions (as many in every microbatch)
        count = (lambda mask: mask.size) if weights is not None else (lambda mask: jnp.maximum(jnp.sum(mask), 1.0))

        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0, 0), out_axes=(nnx.Carry, 0),
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(h, one, tokens, wanted, mask):
            h, out = apply(one, (h, embed(tokens)))
            losses = optax.softmax_cross_entropy_with_integer_labels(unembed(out).astype(jnp.float32), wanted)
            return h, jnp.sum(mask * losses) / count(mask)

        _, losses = run(h, self.layers, ahead[:-1], ahead[1:], masks)
        self.mtp_loss.set_value(jnp.mean(losses))
        self.loss.set_value(self.weight * jnp.mean(losses))


def shifted(tokens, k: int):
    """tokens moved k places left along the length (the last k places hold the first tokens: never valid)."""
    return tokens if k == 0 else jnp.roll(tokens, -k, axis=1)


def valid(shape: tuple, weights, segments, k: int):
    """Where depth k's target (the next token k places on) counts, as a weight: within the row, trained on (packed
    rows: its weight, the step's token weights, so a microbatch's mean stays the global batch's share), and in the same
    document as the position (segment ids equal, not padding); else 1 per position whose target is in the row."""
    inside = (jnp.arange(shape[1]) < shape[1] - k)[None, :]
    mask = jnp.broadcast_to(inside, shape).astype(jnp.float32)
    if weights is not None:
        mask = mask * shifted(weights, k)
    if segments is not None:
        mask = mask * ((shifted(segments, k) == segments) & (segments != 0))
    return jax.lax.stop_gradient(mask)
