"""What a model keeps between its calls while it generates: attention's keys and values, a recurrence's carry.

Generating (shard/generate.py) runs the model once over the prompt (the prefill), then on one token at a
time. The model itself does not change for it: its attention, positions, layer stack and recurrences go
through `shard.nn.hooks`, which under `hooks.use(decode=Calls(...))` keep their state here:

- attention writes the new tokens' keys and values into its cache at the current position and attends
  over every position written so far (`attend`), or within its sliding window (a layer whose window is shorter
  than the cache keeps only the window: a ring of `window` slots; a stack mixing such layers with global ones
  keeps one stacked cache per kind of layer, `Kinds`);
- positions count on from the current position;
- a recurrence (the LSTM's scan over time) starts from the carry its previous call ended with;
- the stack of layers scans over its layers' caches with its layers (one slice each).

The state is a list with one entry per call, in the order the model makes its calls (a stack's entry is
the list of its layer's entries, stacked on a leading `layers` axis). Each call takes the entry its
predecessor left at its place and puts its new one; the prefill takes nothing and starts each entry.
The caches carry logical names, so the rules shard them like the activations they hold: heads over
`tensor`, the batch over the batch axes.

Each row of the batch keeps its own place in its cache: `index`, the slot its next token is written to, and
`start`, the slot of its first real token (its position 0). Slots before `start` are padding (a shorter
prompt left-padded to the batch's length): never attended, and a recurrence's carry passes over them
unchanged; a call may also end a row's real tokens early (`end`: a prompt right-padded to a compiled
length, written at slots that later tokens overwrite). Rows need not move together, so one cache can hold
sequences that began at different times (a server's slots, shard/server).
"""

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from shard.nn import attention as attn
from shard.nn import masks, softmax
from shard.nn.partition import constrain

CACHE_NAMES = ("batch", None, "kv_heads", "head_dim")  # (batch, position, key/value heads, head size)


@dataclass
class Calls:
    """The entries of one forward pass (or of one layer, inside a stack)."""
    index: jax.Array        # (batch,) int: each row's cache slot for this call's first token
    start: jax.Array        # (batch,) int: each row's first real slot (its position 0); before it, padding
    capacity: int           # slots each attention cache holds
    given: list | None      # the previous pass's entries; None for the prefill
    made: list = field(default_factory=list)
    end: jax.Array | None = None  # (batch,) int: from this slot on, this call's tokens are padding (None: none)
    seen: int | None = None  # attend over the first `seen` slots only (None: all): no written slot lies past them
    layer: jax.Array | None = None  # inside a stack, this layer's index: `given` then holds every layer's entries
    reach: int | None = None  # the positions a row's cache spans (None: capacity); a shorter window keeps a ring
    kept: dict = field(default_factory=dict)  # name -> attention over a layer's cache, for the layers reusing it

    @property
    def spans(self) -> int:
        return self.reach or self.capacity

    def slots(self, length: int) -> jax.Array:
        """(batch, length): the cache slots of this call's tokens."""
        return self.index[:, None] + jnp.arange(length, dtype=jnp.int32)

    def positions(self, length: int) -> jax.Array:
        """(batch, length): each token's position in its own sequence (0 at its first real token; padding 0)."""
        return jnp.maximum(self.slots(length) - self.start[:, None], 0)

    def real(self, length: int) -> jax.Array:
        """(batch, length) bool: which of this call's tokens are not padding."""
        slots = self.slots(length)
        real = slots >= self.start[:, None]
        return real if self.end is None else real & (slots < self.end[:, None])

    def _given(self):
        """The previous pass's entry for the next call, as given (a stack's: every layer's)."""
        if self.given is None:
            return None
        if len(self.made) >= len(self.given):
            raise ValueError("the model made more cached calls than its previous pass: decoding needs the same "
                             "calls, in the same order, on every pass")
        return self.given[len(self.made)]

    def take(self):
        """The previous pass's entry for the next call (None at the prefill)."""
        entry = self._given()
        return entry if entry is None or self.layer is None else jax.tree.map(lambda a: a[self.layer], entry)

    def put(self, entry) -> None:
        if self.layer is not None and self.given is not None:  # back into its layer of the stacked entry
            entry = jax.tree.map(lambda s, e: jax.lax.dynamic_update_index_in_dim(s, e.astype(s.dtype), self.layer, 0),
                                 self._given(), entry)
        self.made.append(entry)

    def write(self, new: dict, ring: int | None = None) -> dict:
        """Attention's entry: `new` (name -> (batch, length, heads, head_dim)) written at each row's slots of
        this call's cache (an empty one at the prefill), and this layer's cache up to `seen`. In a stack the
        tokens go straight into the stacked cache, so that a step updates it in place rather than copying it,
        and only the slots attended over are read out of it. `ring`: the cache holds that many slots, slot s at
        s mod ring (a sliding window's keys), and only the call's last `ring` tokens are written."""
        stacked = self._given()
        batch, length = next(iter(new.values())).shape[:2]
        rows, slots = jnp.arange(batch)[:, None], self.slots(length)
        if ring is not None:
            slots = self.ring_slots(length, ring)
        if stacked is None:
            stacked = {n: jnp.zeros((batch, ring or self.capacity, *x.shape[2:]), x.dtype) for n, x in new.items()}
        if self.layer is None:
            entry = {n: constrain(stacked[n].at[rows, slots].set(x.astype(stacked[n].dtype), mode="drop"),
                                  CACHE_NAMES) for n, x in new.items()}
            self.made.append(entry)
            return entry
        entry = {n: constrain(stacked[n].at[self.layer, rows, slots].set(x.astype(stacked[n].dtype), mode="drop"),
                              (None, *CACHE_NAMES)) for n, x in new.items()}
        self.made.append(entry)
        width = ring or self.seen or self.capacity
        return {n: jax.lax.dynamic_slice(a, (self.layer, *(0,) * (a.ndim - 1)), (1, a.shape[1], width, *a.shape[3:]))[0]
                for n, a in entry.items()}

    def ring_slots(self, length: int, ring: int) -> jax.Array:
        """(batch, length): where this call's tokens go in a ring of `ring` slots (slot s at s mod ring), `ring`
        (out of range: dropped) for all but each row's last `ring` real ones: earlier tokens of a long call, and
        a padded chunk's padding after its `end`, would land on the places of real ones still in the window."""
        slots = self.slots(length)
        last = self.index[:, None] + length if self.end is None else jnp.minimum(self.index + length, self.end)[:, None]
        return jnp.where((slots >= last - ring) & (slots < last), slots % ring, ring)

    def inner(self, given, layer: jax.Array | None = None) -> "Calls":
        """The calls of one layer inside a stack, at the same position: `given`, the layer's own entries, or
        with `layer`, every layer's."""
        return Calls(self.index, self.start, self.capacity, given, end=self.end, seen=self.seen, layer=layer,
                     reach=self.reach)


def attend(q, k, v, is_causal: bool, calls: Calls, window=None, softcap: float | None = None,
           scale: float | None = None, sinks=None, chunk=None, keep: str | None = None, reuse: str | None = None):
    """Attention of the new tokens' queries (batch, new, heads, head_dim) over each row's cached slots: the
    new keys and values are written at the row's `index` first (zeros for padding). A query sees the slots
    from its row's `start` up to its own (all written ones without `is_causal`), within its sliding `window`
    (shard.nn.hooks.attention's; slots lie as far apart as positions) or its `chunk` (by position: a chunk starts
    at a row's start and every `chunk` slots after); a padding query, only itself. `softcap`, `scale` and `sinks`
    as the hook takes them. A chunked layer keeps one chunk (a ring), as a sliding layer its window. keep: this call's
    attention over its cache stays available to later calls of the same pass under this name; reuse: a later call
    attends over the cache kept so (its own k and v are the keeper's; it writes nothing: a shared-KV layer holds no
    cache)."""
    if reuse is not None:
        if reuse not in calls.kept:
            raise ValueError(f"attention reuses the keys and values kept as {reuse!r}, but no earlier call of this "
                             f"pass kept them (kept: {sorted(calls.kept)})")
        return calls.kept[reuse](q)
    real = calls.real(q.shape[1])[:, :, None, None]
    k, v = jnp.where(real, k, 0), jnp.where(real, v, 0)
    value, sizes = masks.windows(window)
    per_chunk, chunk_sizes = masks.chunks(chunk, is_causal, window)
    ring, by_chunk = masks.fixed(sizes) if value is None else None, False
    if ring is None and value is None and per_chunk is None and masks.fixed(chunk_sizes):
        ring, by_chunk = masks.fixed(chunk_sizes), True  # every layer's chunk alike: a ring of one chunk
    if ring is not None and is_causal and ring < calls.spans:
        held = calls.take()
        over = lambda q: _over_ring(q, k, v, calls, held, ring, softcap, scale, sinks, by_chunk)  # noqa: E731
        calls.write({"k": k, "v": v}, ring=ring)  # after: the ring's keys go in once its layer read what it held
    elif is_causal and (kinds := _stack_kinds(window, chunk, value, per_chunk, calls.spans)):
        if keep is not None:
            raise ValueError("attention keeps its cache for later calls only outside a stack of unlike layers")
        return _attend_kinds(q, k, v, calls, kinds, value if value is not None else per_chunk, softcap, scale,
                             sinks, by_chunk=value is None)
    else:
        chunk = masks.effective(per_chunk, chunk_sizes)
        cache = calls.write({"k": k, "v": v})
        window = value if value is not None else None if by_chunk else ring
        over = lambda q: _attend_written(q, cache, calls, is_causal, window, softcap, scale, sinks,  # noqa: E731
                                         chunk)
    if keep is not None:
        calls.kept[keep] = over
    return over(q)


def attend_keys(q, k, is_causal: bool, calls: Calls, values: int, softcap=None, scale=None, sinks=None):
    """`attend` for attention whose values are its keys' first `values` channels (latent attention's absorbed form):
    the cache holds the keys alone, one latent and one rotated key a token, read as both."""
    k = jnp.where(calls.real(q.shape[1])[:, :, None, None], k, 0)
    cache = calls.write({"k": k})
    both = {"k": cache["k"], "v": cache["k"]}
    return _attend_written(q, both, calls, is_causal, None, softcap, scale, sinks)[..., :values]


def _stack_kinds(window, chunk, value, per_chunk, spans: int) -> tuple | None:
    """Each layer's cache kind (cache_kinds) of a stack whose layers keep caches of different kinds, by their windows
    or else their chunks (a layer keeps one chunk's keys); None for any other call."""
    every = window[1] if value is not None else chunk[1] if per_chunk is not None else None
    kinds = None if every is None else cache_kinds(every, spans)
    return kinds if kinds is not None and len(set(kinds)) > 1 else None


def _attend_written(q, cache, calls: Calls, is_causal: bool, window, softcap, scale, sinks=None, chunk=None):
    """The queries over a cache that holds every position at its slot, this call's keys written: its first `seen`
    slots (a server attends over the slots in use, not the whole context), `window` and `chunk` (an int, a traced
    one with 0 for none, or None) masking by position."""
    width = calls.seen or calls.capacity
    new = calls.slots(q.shape[1])[:, :, None]            # (batch, new, 1): the queries' slots
    seen = jnp.arange(width)[None, None, :]               # the cache's slots attended over
    mask = (seen >= calls.start[:, None, None]) & (seen <= (new if is_causal else new[:, -1:]))
    near = masks.visible(new[..., 0], seen[0, 0], False, window)
    mask = mask if near is None else mask & near
    if chunk is not None:  # by position, slot - start: a row's chunks start at its first real token
        first = calls.start[:, None]
        mask = mask & masks.visible(new[..., 0] - first, seen[0] - first, False, None, chunk)
    mask = mask | (seen == new)
    return _attention(q, cache["k"][:, :width].astype(q.dtype), cache["v"][:, :width].astype(q.dtype), mask,
                      softcap, scale, sinks)


def _over_ring(q, k, v, calls: Calls, held: dict | None, window: int, softcap, scale, sinks=None,
              by_chunk: bool = False):
    """The new queries over the keys a ring of `window` slots held before this call (None: a fresh row, nothing
    held) and the call's own: a causal layer whose every query sees the `window` latest keys (every layer of the
    stack alike: one static window) keeps `window` slots, slot s at s mod window, so that a long generation keeps a
    window of keys per layer rather than every position. by_chunk: the ring holds a chunk, `window` its size (a
    query sees the keys of its own chunk, by position from its row's start: Llama 4's chunked layers)."""
    own = calls.slots(q.shape[1])
    keys, both = own, {"k": k, "v": v}
    if held is not None:
        last = calls.index[:, None] - 1  # the slot each ring place holds: the latest before this call (< 0: none yet)
        keys = jnp.concatenate([last - (last - jnp.arange(window)) % window, own], axis=1)
        both = {n: jnp.concatenate([held[n].astype(q.dtype), x.astype(q.dtype)], axis=1) for n, x in both.items()}
    new, seen = own[:, :, None], keys[:, None, :]
    first = calls.start[:, None, None]
    near = (new - first) // window == (seen - first) // window if by_chunk else new - seen < window
    mask = (seen >= first) & (seen >= 0) & (seen <= new) & near
    mask = mask | (seen == new)
    return _attention(q, both["k"].astype(q.dtype), both["v"].astype(q.dtype), mask, softcap, scale, sinks)


# ----------------------------------------------------------------------------- stacks of local and global layers
# One scanned stack holds one layer's program, but its layers' caches need not share a shape: a stack that mixes
# sliding layers with global ones (Gemma 2's 1:1, Gemma 3's 5:1, Qwen2's layer_types) keeps one stacked cache per
# kind of layer (`Kinds`): every position for the global layers (and windows as long as the cache), a ring of
# `window` slots for each shorter window's layers. Each layer finds its own by its index in the stack (a static
# table of each layer's rank among its kind's): it writes its keys into its kind's cache alone (a scatter at an
# out-of-range layer elsewhere, dropped, so the carried caches stay updated in place) and attends over it in a
# jax.lax.switch on its kind, so a local layer reads its ring, not a global layer's positions. Two caches carried
# on the layers axis, each layer one slice of each, would hold every position for every layer again.

def cache_kinds(windows: tuple, spans: int) -> tuple:
    """Each layer's cache kind: its ring's size (a window shorter than the `spans` positions a cache holds), or 0
    (every position: a global layer, or a window the cache never outgrows)."""
    return tuple(w if 0 < w < spans else 0 for w in windows)


@jax.tree_util.register_dataclass
@dataclass
class Kinds:
    """A stack's cache whose layers keep different kinds: kind (0, or a ring's size) -> {"k", "v"}, each
    (that kind's layers, batch, slots, kv_heads, head_dim), its layers in the stack's order."""
    caches: dict


def _attend_kinds(q, k, v, calls: Calls, kinds: tuple, value, softcap, scale, sinks=None, by_chunk: bool = False):
    """`attend` for a causal layer of a stack whose layers keep caches of different `kinds` (cache_kinds), this
    layer's window the traced `value` (0: global), or with `by_chunk` its chunk (a ring holding one chunk)."""
    names = sorted(set(kinds))
    stacked = calls._given()
    batch, length = k.shape[:2]
    if calls.layer is None:  # stack_caches' abstract pass: the empty caches of the whole stack; nothing computed
        calls.made.append(Kinds({kind: {n: jnp.zeros((kinds.count(kind), batch, kind or calls.capacity, *x.shape[2:]),
                                                      x.dtype) for n, x in (("k", k), ("v", v))} for kind in names}))
        return jnp.zeros_like(q)
    i, rows = calls.layer, jnp.arange(batch)[:, None]
    # each layer's rank among its kind's layers; count (out of range: the write is dropped) where not of that kind
    rank = {kind: jnp.asarray([kinds[:j].count(kind) if w == kind else kinds.count(kind)
                               for j, w in enumerate(kinds)], jnp.int32)[i] for kind in names}
    caches = dict(stacked.caches)

    def written(kind, slots):
        return {n: constrain(a.at[rank[kind], rows, slots].set(x.astype(a.dtype), mode="drop"), (None, *CACHE_NAMES))
                for (n, a), x in zip(caches[kind].items(), (k, v))}

    def layer_of(kind, width):  # read inside its branch: a layer of another kind never reads this one
        return {n: jax.lax.dynamic_slice(a, (rank[kind], *(0,) * (a.ndim - 1)), (1, batch, width, *a.shape[3:]))[0]
                for n, a in caches[kind].items()}

    def branch(kind):
        if kind == 0:
            window, chunk = (None, value) if by_chunk else (value, None)
            return lambda q: _attend_written(q, layer_of(0, calls.seen or calls.capacity), calls, True, window,
                                             softcap, scale, sinks, chunk)
        return lambda q: _over_ring(q, k, v, calls, layer_of(kind, kind), kind, softcap, scale, sinks, by_chunk)

    if 0 in caches:  # a global layer attends over its cache with its keys in it: written first
        caches[0] = written(0, calls.slots(length))
    out = jax.lax.switch(jnp.asarray([names.index(w) for w in kinds], jnp.int32)[i], [branch(w) for w in names], q)
    for kind in names:  # a ring's keys go in after its layer read what it held
        if kind:
            caches[kind] = written(kind, calls.ring_slots(length, kind))
    calls.made.append(Kinds(caches))
    return out


SCORES = 1 << 22  # queries x keys past which attention runs over blocks of keys
KEY_BLOCK = 2048


def _attention(q, k, v, mask, softcap=None, scale=None, sinks=None):
    """Attention with a (batch, queries, keys) mask, the logits scaled by `scale` (None: 1/sqrt(head_dim)),
    soft-capped by `softcap`, each query head's sink logit (`sinks`) in its softmax. Where the scores would be
    large (a long prompt's chunk over a long context) it runs over blocks of keys, keeping each query's running
    maximum, sum and output (the online softmax), so that its memory is bounded by a block, not by the context."""
    batch, length, heads, dim = q.shape
    width, groups = k.shape[1], heads // k.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    if length * width <= SCORES and softcap is None and sinks is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale)
    if length * width <= SCORES:
        return attn.grouped(q, k, v, mask[:, None, None], "float32", scale, softcap, sinks)
    blocks = -(-width // KEY_BLOCK)
    pad = blocks * KEY_BLOCK - width
    k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
    split = lambda x: jnp.moveaxis(x.reshape(batch, blocks, KEY_BLOCK, *x.shape[2:]), 1, 0)
    qg = q.reshape(batch, length, k.shape[2], groups, dim).astype(jnp.float32) * jnp.float32(scale)

    def fold(state, block):
        kb, vb, mb = block
        scores = attn.capped(jnp.einsum("blkgd,bwkd->bkglw", qg, kb.astype(jnp.float32)), softcap)
        return softmax.fold(state, jnp.where(mb[:, None, None], scores, -jnp.inf), vb, "bkglw,bwkd->bkgld"), None

    blocked = (split(k), split(v), split(mask.transpose(0, 2, 1)).transpose(0, 1, 3, 2))
    start = softmax.start((batch, k.shape[2], groups, length), dim, attn.sink_logits(sinks, k.shape[2]))
    state, _ = jax.lax.scan(fold, start, blocked)
    out, _ = softmax.finish(state)  # (batch, kv heads, groups, queries, dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, dim).astype(q.dtype)


def recur(step, carry, xs, calls: Calls):
    """jax.lax.scan(step, carry, xs) continuing from the carry the previous pass ended with; xs time-major, the
    carry batch-major. Over a row's padding the carry stays as it was."""
    given = calls.take()
    real = calls.real(jax.tree.leaves(xs)[0].shape[0]).T  # (time, batch)

    def masked(state, x):
        x, keep = x
        new, y = step(state, x)
        return jax.tree.map(lambda n, o: jnp.where(keep.reshape(-1, *(1,) * (n.ndim - 1)), n, o), new, state), y

    carry, ys = jax.lax.scan(masked, carry if given is None else given, (xs, real))
    calls.put(carry)
    return carry, ys
