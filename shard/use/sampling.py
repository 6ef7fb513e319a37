"""The next token from a model's logits: the one sampler `shard.generate` and the server (shard/server) share,
and the log-probabilities the server reports.

A setting is either one number for every row (generation's command line: the cuts it does not ask for are not
computed) or a (rows,) array, each row its own (the server's slots, each a different request's)."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shard.errors import UserError


def pick(logits: jax.Array, key: jax.Array, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
    """(rows, vocab) float32 logits -> (rows,) int32 tokens. Temperature 0 is the argmax; else the logits over
    the temperature, cut to the top_k likeliest (0: all), of those to the smallest set holding top_p of the
    mass (1: all), and drawn."""
    rows, vocab = logits.shape
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if _fixed(temperature) and temperature == 0:
        return greedy
    temperature = _per_row(temperature, rows, jnp.float32)
    hot = temperature > 0
    scaled = logits / jnp.where(hot, temperature, 1.0)[:, None]
    if _fixed(top_k) and _fixed(top_p):
        if 0 < top_k < vocab:
            kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
            scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        if top_p < 1:
            scaled = _nucleus(scaled, jnp.sort(scaled, axis=-1)[:, ::-1], jnp.full(rows, top_p, jnp.float32))
    else:  # each row its own cuts; none computed while every row is greedy (a server's usual step)
        def drawn():
            ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
            k = _per_row(top_k, rows, jnp.int32)
            k = jnp.where((k > 0) & (k < vocab), k, vocab)
            ordered = jnp.where(jnp.arange(vocab)[None] < k[:, None], ordered, -jnp.inf)
            cut = jnp.where(scaled < jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1), -jnp.inf, scaled)
            cut = _nucleus(cut, ordered, _per_row(top_p, rows, jnp.float32))
            return jnp.where(hot, jax.random.categorical(key, cut).astype(jnp.int32), greedy)

        return jax.lax.cond(jnp.any(hot), drawn, lambda: greedy)
    return jnp.where(hot, jax.random.categorical(key, scaled).astype(jnp.int32), greedy)


def _nucleus(scaled, ordered, top_p):
    """`scaled` less the tokens outside the smallest set of the likeliest whose mass reaches top_p (`ordered`:
    the same logits sorted, likeliest first)."""
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
    cutoff = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


def _fixed(setting) -> bool:
    return isinstance(setting, (int, float))


def _per_row(setting, rows: int, dtype):
    return jnp.broadcast_to(jnp.asarray(setting, dtype), (rows,))


TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's chat limit)


def log_probs(logits: jax.Array, tokens: jax.Array, top: int = TOP_LOGPROBS):
    """The model's own log-probabilities (log-softmax of the raw logits: no temperature or cuts, as OpenAI's
    and vLLM's servers report them): of `tokens` (rows,), and the `top` likeliest ids with theirs."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    best, ids = jax.lax.top_k(logp, min(top, logp.shape[-1]))
    return chosen, ids.astype(jnp.int32), best


@dataclass(frozen=True)
class Sampling:
    """One setting for every row (shard.generate's command line)."""
    temperature: float = 0.8  # 0: greedy (the most likely token)
    top_k: int = 0            # keep the k most likely tokens (0: all)
    top_p: float = 1.0        # keep the most likely tokens whose probabilities sum to p (1: all)
    vocab: int | None = None  # choose among the first `vocab` tokens only (bytes: 256)

    def check(self) -> "Sampling":
        if self.temperature < 0:
            raise UserError(f"--temperature {self.temperature}: must be 0 (greedy) or more")
        if self.top_k < 0:
            raise UserError(f"--top-k {self.top_k}: must be 0 (all tokens) or more")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p}: must be in (0, 1]")
        return self

    def pick(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """(batch, vocab) float32 logits -> (batch,) int32 tokens."""
        if self.vocab is not None:
            logits = logits[:, :self.vocab]
        return pick(logits, key, float(self.temperature), int(self.top_k), float(self.top_p))
