"""Log-likelihoods of given token sequences: what evaluation asks of a language model (lm-evaluation-harness's
loglikelihood, the server's `echo` with `logprobs`), not what it would generate.

`Scorer(generator)(rows)` runs the model once over each sequence (no cache: a causal model's outputs at a position
do not depend on what follows it, so the rows are right-padded to a bucket of lengths, powers of two, and stacked
into a bucket of rows, so that few programs serve every batch) and gives, for every position after the first, the
log-probability of the token there given those before it (log-softmax of the raw logits, as OpenAI's and vLLM's
servers report them), and the likeliest tokens there with theirs. The batch is laid over the generator's mesh as
generation lays it (the batch over the batch axes where they divide it), so a model too large for one device is
scored sharded.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shard.errors import UserError
from shard.nn import partition
from shard.use.sampling import TOP_LOGPROBS

SMALLEST = 8  # the shortest padded length


class Scored(NamedTuple):
    """One sequence's scores, one entry per token after the first: the token's log-probability given those before
    it, whether it is the likeliest there (the argmax), and the `top` likeliest ids and their log-probabilities."""
    logprobs: np.ndarray   # (n - 1,) float32
    greedy: np.ndarray     # (n - 1,) bool
    top_ids: np.ndarray    # (n - 1, top) int32
    top_logprobs: np.ndarray  # (n - 1, top) float32


def bucket(n: int, largest: int | None = None) -> int:
    """`n` rounded up to a power of two from SMALLEST, at most `largest`."""
    size = SMALLEST
    while size < n:
        size *= 2
    return size if largest is None else min(size, max(largest, n))


class Scorer:
    """Scores token sequences with a Generator's model (its dtype, mesh and rules). `vocab`: the tokens a
    log-softmax runs over (the model's logits may be wider: padding rows past the tokenizer's)."""

    def __init__(self, generator, vocab: int, top: int = TOP_LOGPROBS):
        self.g, self.vocab, self.top = generator, vocab, min(top, vocab)
        self.context = generator.context  # a fixed context (learned positions, max_len), else None
        self._run = jax.jit(self._score)

    def _score(self, state, tokens):
        """`tokens` (rows, width + 1): the model reads the first `width`, each predicting the one after it."""
        logits = self.g._model(state)(tokens[:, :-1])[..., :self.vocab].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        best, ids = jax.lax.top_k(logp, self.top)
        return chosen, ids[..., 0] == tokens[:, 1:], ids.astype(jnp.int32), best

    def longest(self) -> int | None:
        """The longest sequence one pass scores (the model's context, and the token after it), None where
        unbounded."""
        return None if self.context is None else self.context + 1

    def __call__(self, rows: list[list[int]], batch: int | None = None) -> list[Scored]:
        """Scores of each row (at least one token each), `batch` rows a pass (default: all of them)."""
        if not rows:
            return []
        longest = max(len(r) for r in rows)
        if min(len(r) for r in rows) < 1:
            raise UserError("a sequence to score is empty; give at least one token")
        if self.context is not None and longest > self.context + 1:
            raise UserError(f"a sequence of {longest} tokens is past the model's context of {self.context} "
                            "(max_len) and the token after it; shorten it")
        batch = batch or len(rows)
        out: list[Scored] = []
        for at in range(0, len(rows), batch):
            out += self._pass(rows[at:at + batch])
        return out

    def _pass(self, rows: list[list[int]]) -> list[Scored]:
        width = bucket(max(len(r) for r in rows) - 1, self.context)  # what the model reads: all but the last
        count = bucket(len(rows)) if len(rows) > 1 else 1
        tokens = np.zeros((count, width + 1), np.int32)
        for row, r in zip(tokens, rows):
            row[:len(r)] = r
        rules = self.g.batch_rules(count)
        with partition.activate(self.g.mesh, rules):
            got = self._run(self.g.state, self.g.place(tokens, rules))
        chosen, greedy, ids, best = (np.asarray(a) for a in got)
        return [Scored(chosen[i, :len(r) - 1], greedy[i, :len(r) - 1], ids[i, :len(r) - 1], best[i, :len(r) - 1])
                for i, r in enumerate(rows)]
