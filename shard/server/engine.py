"""The server's model side: one KV cache of a fixed number of slots, each slot a sequence at its own place.

The cache holds `context` positions per slot: what the server was asked to hold (python -m shard.serve
--context), not the model's maximum. Its programs, all compiled at warm-up (a trace after it is a recompile:
logged and counted):
- `first`: a prompt's first chunk (all of a short prompt), right-padded to a bucket (powers of two up to
  `chunk`), run from a fresh row and written into its slot; it samples the token after the prompt;
- `more`: a long prompt's next `chunk` tokens, continuing its slot's row. The first chunk takes the remainder,
  so every later chunk is whole and none writes past the context; a chunk bounds the prefill's memory
  whatever the context;
- `step`: the running slots one token further, or up to `burst` tokens in one call while no request waits;
  compiled for 1, 4, 16, ... rows (up to a quarter of the slots) and all of them (a lone request does not
  pay for idle slots).
Each attends over a view, the first `128 * 2^k` slots (or the context) holding every position written, so
a short request on a long-context server does not pay for the whole context. A layer with a sliding window
shorter than the context keeps a ring of its window per slot instead (position s at s mod window; a stack that
mixes such layers with global ones keeps one cache per kind: shard/nn/decoding.py's Kinds): it has no position
axis to view, and is taken whole. Each slot keeps its own write
slot (shard/nn/decoding.py), so sequences that began at different times share a step. The cache carries
logical names and is split like generation's (heads over `tensor`, the slots over the batch axes where they
divide them).
"""

import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shard.nn import partition
from shard.core import state as state_lib
from shard.use import sampling, score
from shard.nn import decoding
from shard.use.generate import Generator

log = logging.getLogger("shard.serve")
SMALLEST_BUCKET = 8
CHUNK = 512   # prompt tokens per prefill call
BURST = 8     # tokens per step call while no request waits


SMALLEST_VIEW = 128


def doubling(first: int, last: int) -> list[int]:
    """`first` doubled while it is below `last`, and `last`."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= 2
    return sizes + [last]


def buckets(chunk: int) -> list[int]:
    """First-chunk lengths the prefill is compiled for: powers of two from 8, and the whole chunk."""
    return doubling(SMALLEST_BUCKET, chunk)


def views(context: int) -> list[int]:
    """The attended prefixes: 128 slots doubled until they hold the context, and the context (each view a set
    of programs to compile; a step attends over at most twice the slots it needs)."""
    return doubling(SMALLEST_VIEW, context)


class Picked(NamedTuple):
    """Tokens drawn, with the model's log-probabilities: of each token, and the likeliest ids and theirs."""
    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class Engine:
    def __init__(self, generator: Generator, slots: int, context: int, vocab: int, seed: int = 0,
                 chunk: int = CHUNK, burst: int = BURST):
        self.g, self.slots, self.context, self.vocab = generator, slots, context, vocab
        self.chunk, self.burst = min(chunk, context), max(1, burst)
        self.buckets, self.views = buckets(self.chunk), views(context)
        self.key = jax.random.key(seed)
        self.warm, self.recompiles, self.runs = False, 0, 0
        self.one_rules, self.rules = generator.batch_rules(1), generator.batch_rules(slots)
        shapes = jax.eval_shape(self._empty, generator.state)
        self.layout = self._layout(shapes)
        # each leaf's slot axis and position axis (None for a recurrence's carry): where its shape moves with them
        moved = lambda other: jax.tree.map(lambda a, b: next((i for i, (x, y) in enumerate(zip(a.shape, b.shape))
                                                              if x != y), None), shapes, other)
        self.axes = moved(jax.eval_shape(lambda s: self._cache_of(s, slots + 1, context), generator.state))
        self.position_axes = moved(jax.eval_shape(lambda s: self._cache_of(s, slots, context + 1, context),
                                                  generator.state))
        # each a program per view; at most a quarter of the slots below all of them, as their copy takes memory
        self.row_buckets = [r for r in (1, 4, 16, 64) if r <= slots // 4] + [slots]
        self.first = jax.jit(self._first, donate_argnums=1, out_shardings=(self._replicated(), self.layout))
        self.more = jax.jit(self._more, donate_argnums=1, static_argnames="view",
                            out_shardings=(self._replicated(), self.layout))
        self.step = jax.jit(self._step, donate_argnums=1, static_argnames="view",
                            out_shardings=(self._replicated(), self.layout))
        self.cache = None
        self.scorer = score.Scorer(generator, vocab)  # a prompt's own log-probabilities (echo): no cache, no slot

    # ------------------------------------------------------------------ memory, before anything is allocated

    def _layout(self, shapes):
        """Each cache leaf's sharding: the logical names attention gives it, on its last four dimensions."""
        if self.g.mesh is None:
            return None
        spec = partition.logical_to_spec(decoding.CACHE_NAMES, self.rules, self.g.mesh.shape)

        def placed(leaf):
            if leaf.ndim < 4:  # a recurrence's carry: small, on every device
                return NamedSharding(self.g.mesh, PartitionSpec())
            parts = [None] * (leaf.ndim - 4) + [
                axes if axes and leaf.shape[leaf.ndim - 4 + i] % math.prod(
                    self.g.mesh.shape[a] for a in partition.axes_of(axes)) == 0 else None
                for i, axes in enumerate(spec)]
            return NamedSharding(self.g.mesh, PartitionSpec(*parts))

        return jax.tree.map(placed, shapes)

    def cache_bytes(self, context: int | None = None) -> int:
        """Bytes of the slots' cache on one device for `context` positions (default: this engine's), from its
        shapes and shardings (nothing allocated)."""
        shapes = jax.eval_shape(lambda s: self._cache_of(s, self.slots, context or self.context), self.g.state)
        if self.g.mesh is not None:
            shapes = jax.tree.map(lambda s, lay: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=lay), shapes,
                                  self._layout(shapes))
        return state_lib.shard_bytes(shapes)

    def working_share(self) -> float:
        """The cache's share the programs copy beside it: a step over a few rows carries their slots (in and
        out), a long prompt's chunk one slot's."""
        return 2 * max((r for r in self.row_buckets if r < self.slots), default=0) / self.slots + 1 / self.slots

    def allocate(self) -> int:
        """The slots' cache, empty; its bytes on one device (as allocated)."""
        with partition.activate(self.g.mesh, self.rules):
            self.cache = jax.jit(self._empty, out_shardings=self.layout)(self.g.state)
        return state_lib.shard_bytes(self.cache)

    def intact(self) -> bool:
        """Whether the cache still exists and holds values: a program that failed after its inputs were donated
        leaves it gone, one that failed on the device leaves it holding the error."""
        if self.cache is None or any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
            return False
        try:
            jax.block_until_ready(self.cache)
        except Exception:
            return False
        return True

    # ------------------------------------------------------------------ the traced programs

    def _replicated(self):
        return None if self.g.mesh is None else NamedSharding(self.g.mesh, PartitionSpec())

    def _traced(self, what: str, shape) -> None:
        """Runs while a program is traced, that is before it is compiled: after warm-up, a recompile."""
        if self.warm:
            self.recompiles += 1
            log.warning("recompile after warm-up: %s %s (%d so far)", what, shape, self.recompiles)

    def _cache_of(self, state, rows: int, positions: int, reach: int | None = None):
        """The cache of `rows` slots holding `positions` each, its local layers' rings those of slots that span
        `reach` (default: positions)."""
        tokens, zeros = jnp.zeros((rows, 1), jnp.int32), jnp.zeros(rows, jnp.int32)
        return self.g.forward(state, tokens, zeros, zeros, None, positions, seen=1, reach=reach)[1]  # never seen

    def _empty(self, state):
        return self._cache_of(state, self.slots, self.context)

    def _fresh_row(self, state, tokens, length):
        """A prompt's first chunk from nothing: the token after it, and a row holding the chunk's positions only
        (written over the start of its slot; what lies past it there is never attended)."""
        zero = jnp.zeros(1, jnp.int32)
        with partition.activate(self.g.mesh, self.one_rules):
            return self.g.forward(state, tokens, zero, zero, None, tokens.shape[1], end=length, last=length - 1,
                                  reach=self.context)

    def _pick(self, logits, count, temperature, top_k, top_p, logprobs) -> Picked:
        """Each row's token, and its log-probabilities where `logprobs` (a flag: some request asks for them)."""
        logits = logits[:, :self.vocab]
        tokens = sampling.pick(logits, jax.random.fold_in(self.key, count), temperature, top_k, top_p)
        top = min(sampling.TOP_LOGPROBS, self.vocab)
        none = lambda: (jnp.zeros(len(tokens)), jnp.zeros((len(tokens), top), jnp.int32), jnp.zeros((len(tokens), top)))
        return Picked(tokens, *jax.lax.cond(logprobs, lambda: sampling.log_probs(logits, tokens, top), none))

    def _write(self, cache, row, slot):
        """`row` into `slot` of the cache, from its first position (the row may hold fewer)."""
        def put(c, r, axis):
            start = [0] * c.ndim
            if axis is not None:
                start[axis] = slot
            return jax.lax.dynamic_update_slice(c, r.astype(c.dtype), start)

        return jax.tree.map(put, cache, row, self.axes)

    def _first(self, state, cache, slot, tokens, length, count, temperature, top_k, top_p):
        """A prompt's first chunk into `slot`, right-padded to its bucket: the token after it, and the cache."""
        self._traced("prefill", tokens.shape)
        logits, row = self._fresh_row(state, tokens, length)
        return self._pick(logits, count * self.burst, temperature, top_k, top_p, True), self._write(cache, row, slot)

    def _more(self, state, cache, slot, tokens, index, length, count, temperature, top_k, top_p, view: int):
        """The next whole chunk of `slot`'s prompt, written from `index` (the prompt ends at `length`)."""
        self._traced("prefill", (tokens.shape, view))
        row = jax.tree.map(lambda c, axis, pos: _take(c, axis, slot[None], pos, view), cache, self.axes,
                           self.position_axes)  # the slot's first `view` positions: all its chunks so far
        last = jnp.clip(length - index - 1, 0, tokens.shape[1] - 1)
        with partition.activate(self.g.mesh, self.one_rules):
            logits, row = self.g.forward(state, tokens, index, jnp.zeros(1, jnp.int32), row, view,
                                         end=length, last=last, seen=view, reach=self.context)
        return self._pick(logits, count * self.burst, temperature, top_k, top_p, True), self._write(cache, row, slot)

    def _step(self, state, cache, rows, tokens, index, count, temperature, top_k, top_p, steps, logprobs, view: int):
        """`steps` tokens (at most `burst`: one program for any number) for the slots `rows` (all of them, or a
        few: only theirs computed), each row's `tokens` (its newest) written at its `index`."""
        self._traced("step", (tokens.shape, view))
        whole = len(tokens) == self.slots
        # a few rows: their first `view` slots taken out, decoded, and put back (in place: the cache is donated)
        part = cache if whole else jax.tree.map(lambda c, axis, pos: _take(c, axis, rows, pos, view),
                                                cache, self.axes, self.position_axes)
        start = jnp.zeros(len(tokens), jnp.int32)
        top = min(sampling.TOP_LOGPROBS, self.vocab)
        out = Picked(jnp.zeros((self.burst, len(tokens)), jnp.int32), jnp.zeros((self.burst, len(tokens))),
                     jnp.zeros((self.burst, len(tokens), top), jnp.int32), jnp.zeros((self.burst, len(tokens), top)))

        def one(i, carry):
            part, token, out = carry
            logits, part = self.g.forward(state, token[:, None], index + i, start, part,
                                          self.context if whole else view, seen=view, reach=self.context)
            picked = self._pick(logits, count * self.burst + i, temperature, top_k, top_p, logprobs)
            out = Picked(*(jax.lax.dynamic_update_index_in_dim(o, p.astype(o.dtype), i, 0)
                           for o, p in zip(out, picked)))
            return part, picked.tokens, out

        part, _, out = jax.lax.fori_loop(0, steps, one, (part, tokens, out))
        if not whole:
            cache = jax.tree.map(lambda c, p, axis, pos: _put(c, p, axis, rows, pos, view), cache, part, self.axes,
                                 self.position_axes)
        return Picked(*(jnp.moveaxis(a, 0, 1) for a in out)), part if whole else cache  # (rows, burst, ...)

    # ------------------------------------------------------------------ called by the scheduler's thread

    def _count(self):
        """A fresh number for each program run: the sampling key is the seed's folded with it."""
        self.runs += 1
        return np.int32(self.runs)

    def bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def view(self, end: int) -> int:
        """The smallest view holding slots up to `end` (exclusive)."""
        return next(v for v in self.views if v >= end)

    def start(self, slot: int, prompt: list[int], temperature: float, top_k: int, top_p: float) -> Picked:
        """Prefill `prompt` into `slot`, chunk by chunk: its first new token (the slot's next write is at
        len(prompt))."""
        settings = (np.array([temperature], np.float32), np.array([top_k], np.int32), np.array([top_p], np.float32))
        head = len(prompt) - self.chunk * ((len(prompt) - 1) // self.chunk)  # 1..chunk tokens
        tokens = np.zeros((1, self.bucket(head)), np.int32)
        tokens[0, :head] = prompt[:head]
        length = np.array([len(prompt)], np.int32)
        with partition.activate(self.g.mesh, self.rules):
            picked, self.cache = self.first(self.g.state, self.cache, np.int32(slot), tokens,
                                            np.array([head], np.int32), self._count(), *settings)
            for index in range(head, len(prompt), self.chunk):
                picked = self._next_chunk(slot, prompt[index:index + self.chunk], index, length, settings)
        return Picked(*(np.asarray(a)[0] for a in picked))

    def _next_chunk(self, slot: int, tokens, index: int, length, settings) -> Picked:
        picked, self.cache = self.more(self.g.state, self.cache, np.int32(slot), np.array([tokens], np.int32),
                                       np.array([index], np.int32), length, self._count(), *settings,
                                       view=self.view(index + self.chunk))
        return picked

    def score(self, prompt: list[int]) -> score.Scored:
        """The prompt's own tokens' log-probabilities and likeliest alternatives, one pass over it (compiled per
        length bucket on first use, apart from the slots' programs: not a recompile)."""
        return self.scorer([prompt])[0]

    def rows(self, active: int) -> int:
        """How many rows a step computes for `active` running slots: a power of four up to a quarter of the
        slots, or all of them."""
        return next((r for r in self.row_buckets if r >= active), self.slots)

    def advance(self, tokens, index, temperature, top_k, top_p, steps: int = 1, active=None,
                logprobs: bool = True) -> Picked:
        """The `active` slots (default: all) `steps` tokens on (at most `burst`): per slot, `tokens` its
        newest, written at `index` (index + steps within the context), and its sampling settings; the
        log-probabilities where `logprobs`. Arrays (slots, steps, ...); a slot not computed gets zeros."""
        active = list(range(self.slots)) if active is None else list(active)
        rows = self.rows(len(active))
        picks = np.array(range(self.slots) if rows == self.slots else  # all of them: in the cache's order
                         active + [s for s in range(self.slots) if s not in active][:rows - len(active)], np.int32)
        index = np.where(np.isin(picks, active), np.asarray(index)[picks], 0).astype(np.int32)  # fillers at 0
        view = self.view(int(np.max(index)) + steps)
        with partition.activate(self.g.mesh, self.rules if rows == self.slots else self.g.batch_rules(rows)):
            picked, self.cache = self.step(self.g.state, self.cache, picks, np.asarray(tokens)[picks], index,
                                           self._count(), *(np.asarray(a)[picks] for a in (temperature, top_k, top_p)),
                                           np.int32(steps), np.bool_(logprobs), view=view)
        out = [np.zeros((self.slots, steps, *np.shape(a)[2:]), np.asarray(a).dtype) for a in picked]
        for full, part in zip(out, picked):
            full[picks] = np.asarray(part)[:, :steps]
        return Picked(*out)

    @staticmethod
    def settings(rows: int):
        """Greedy sampling settings for `rows` rows: temperature, top_k, top_p."""
        return np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32)

    def programs(self) -> int:
        return len(self.buckets) + sum(v > self.chunk for v in self.views) + len(self.views) * len(self.row_buckets)

    def warm_up(self) -> None:
        """Compile every program a request can need; after this, a trace is a recompile."""
        for size in self.buckets:
            self.start(0, [0] * size, 0.0, 0, 1.0)
        for view in self.views:
            if view > self.chunk:  # the last chunk of a prompt that ends at `view` (not the whole prompt: its time)
                with partition.activate(self.g.mesh, self.rules):
                    self._next_chunk(0, [0] * self.chunk, view - self.chunk, np.array([view], np.int32),
                                     self.settings(1))
            for rows in self.row_buckets:  # one step at the view's last slot: the program takes any count of steps
                self.advance(np.zeros(self.slots, np.int32), np.full(self.slots, view - 1, np.int32),
                             *self.settings(self.slots), steps=1, active=range(rows))
        self.warm = True


def _take(leaf, axis: int, rows, positions: int | None, view: int):
    """`rows` of a cache leaf along its slot axis, and of those the first `view` positions."""
    part = leaf if positions is None else jax.lax.slice_in_dim(leaf, 0, view, axis=positions)
    return jnp.take(part, rows, axis=axis)


def _put(leaf, part, axis: int, rows, positions: int | None, view: int):
    """`part` back into its `rows` (and first `view` positions) of a cache leaf."""
    where = [slice(None)] * leaf.ndim
    where[axis] = rows
    if positions is not None:
        where[positions] = slice(0, view)
    return leaf.at[tuple(where)].set(part.astype(leaf.dtype))
