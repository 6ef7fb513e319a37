"""The server's model side: one KV cache of a fixed number of slots, each slot a sequence at its own place.

Three compiled programs, all compiled at warm-up:
- `prefill`: one request's prompt, right-padded to a bucket length (powers of two up to the context), into a
  one-row cache, and its first token;
- `insert`: that row into the big cache at a free slot;
- `step`: every slot one token further (a slot without a request computes too, and its token is ignored).
Each slot keeps its own write slot and first real slot (shard/use/decoding.py), so sequences that began at
different times share a step. The cache carries logical names and is split like generation's (heads over
`tensor`, the slots over the batch axes where they divide them). A trace after warm-up is a recompile: the log
says so and `recompiles` counts it.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shard import partition
from shard.use.generate import Generator

log = logging.getLogger("shard.serve")
SMALLEST_BUCKET = 8


def buckets(capacity: int) -> list[int]:
    """Prompt lengths the prefill is compiled for: powers of two from 8, and the whole context."""
    sizes, size = [], SMALLEST_BUCKET
    while size < capacity:
        sizes.append(size)
        size *= 2
    return sizes + [capacity]


def pick_rows(logits, key, temperature, top_k, top_p):
    """(rows, vocab) float32 logits -> (rows,) tokens, each row under its own settings: temperature 0 is the
    argmax; else the top_k likeliest (0: all), of those the smallest set holding top_p of the mass, drawn."""
    vocab = logits.shape[-1]
    hot = temperature > 0
    scaled = logits / jnp.where(hot, temperature, 1.0)[:, None]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    ordered = jnp.where(jnp.arange(vocab)[None] < k[:, None], ordered, -jnp.inf)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
    cutoff = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
    kept = jnp.where((scaled >= kth) & (scaled >= cutoff), scaled, -jnp.inf)
    drawn = jax.random.categorical(key, kept)
    return jnp.where(hot, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


class Engine:
    def __init__(self, generator: Generator, slots: int, capacity: int, vocab: int, seed: int = 0):
        self.g, self.slots, self.capacity, self.vocab = generator, slots, capacity, vocab
        self.buckets = buckets(capacity)
        self.key = jax.random.key(seed)
        self.warm, self.recompiles, self.steps = False, 0, 0
        self.one_rules, self.rules = generator.batch_rules(1), generator.batch_rules(slots)
        with partition.activate(generator.mesh, self.rules):  # the slots' cache, laid out as the step lays it
            self.cache = jax.jit(self._empty)(generator.state)
        layout = jax.tree.map(lambda a: a.sharding, self.cache)
        one = jax.eval_shape(self._prefill, generator.state, np.zeros((1, SMALLEST_BUCKET), np.int32),
                             np.ones(1, np.int32), np.int32(0), *self.settings(1))[1]
        # each leaf's slot axis: where the one-row cache's shape differs from the slots' (all of it for 1 slot)
        self.axes = jax.tree.map(lambda big, row: next((i for i, (a, b) in enumerate(zip(big.shape, row.shape))
                                                        if a != b), 0), self.cache, one)
        self.prefill = jax.jit(self._prefill)
        self.insert = jax.jit(self._insert, donate_argnums=0, out_shardings=layout)
        self.step = jax.jit(self._step, donate_argnums=1, out_shardings=(self._replicated(), layout))

    def _replicated(self):
        return None if self.g.mesh is None else NamedSharding(self.g.mesh, PartitionSpec())

    @staticmethod
    def settings(rows: int):
        """Greedy sampling settings for `rows` rows: temperature, top_k, top_p."""
        return np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32)

    def _traced(self, what: str, shape) -> None:
        """Runs while a program is traced, that is before it is compiled: after warm-up, a recompile."""
        if self.warm:
            self.recompiles += 1
            log.warning("recompile after warm-up: %s %s (%d so far)", what, shape, self.recompiles)

    def _empty(self, state):
        tokens = jnp.zeros((self.slots, 1), jnp.int32)
        zeros = jnp.zeros(self.slots, jnp.int32)
        return self.g.forward(state, tokens, zeros, zeros, None, self.capacity)[1]  # what it holds is never seen

    def _prefill(self, state, tokens, length, count, temperature, top_k, top_p):
        """One prompt right-padded to its bucket: its first token and its one-row cache."""
        self._traced("prefill", tokens.shape)
        key = jax.random.fold_in(self.key, count)
        zero = jnp.zeros(1, jnp.int32)
        logits, cache = self.g.forward(state, tokens, zero, zero, None, self.capacity, end=length, last=length - 1)
        return pick_rows(logits[:, :self.vocab], key, temperature, top_k, top_p), cache

    def _insert(self, cache, row, slot):
        self._traced("insert", slot.shape)
        return jax.tree.map(lambda c, r, axis: jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), slot, axis),
                            cache, row, self.axes)

    def _step(self, state, cache, tokens, index, start, count, temperature, top_k, top_p):
        self._traced("step", tokens.shape)
        key = jax.random.fold_in(self.key, count)
        logits, cache = self.g.forward(state, tokens[:, None], index, start, cache, self.capacity)
        return pick_rows(logits[:, :self.vocab], key, temperature, top_k, top_p), cache

    def _count(self):
        """A fresh number for each program run: the sampling key is the seed's folded with it."""
        self.steps += 1
        return np.int32(self.steps)

    def bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def start(self, slot: int, prompt: list[int], temperature: float, top_k: int, top_p: float) -> int:
        """Prefill `prompt` into `slot`: its first new token (the slot's next write is at len(prompt))."""
        tokens = np.zeros((1, self.bucket(len(prompt))), np.int32)
        tokens[0, :len(prompt)] = prompt
        settings = (np.array([temperature], np.float32), np.array([top_k], np.int32), np.array([top_p], np.float32))
        with partition.activate(self.g.mesh, self.one_rules):
            token, row = self.prefill(self.g.state, tokens, np.array([len(prompt)], np.int32), self._count(),
                                      *settings)
        with partition.activate(self.g.mesh, self.rules):
            self.cache = self.insert(self.cache, row, np.int32(slot))
        return int(np.asarray(token)[0])

    def advance(self, tokens, index, temperature, top_k, top_p) -> np.ndarray:
        """Every slot one token on: `tokens` (slots,) the last ones, written at `index` (each slot's)."""
        with partition.activate(self.g.mesh, self.rules):
            out, self.cache = self.step(self.g.state, self.cache, tokens, index, np.zeros(self.slots, np.int32),
                                        self._count(), temperature, top_k, top_p)
        return np.asarray(out)

    def warm_up(self) -> None:
        """Compile every program a request can need (each bucket's prefill, insert, step); after this, a trace
        is a recompile."""
        for size in self.buckets:
            self.start(0, [0] * size, 0.0, 0, 1.0)
        self.advance(np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32), *self.settings(self.slots))
        self.warm = True
