"""What a model keeps between its calls while it generates: attention's keys and values, a recurrence's carry.

Generating (shard/generate.py) runs the model once over the prompt (the prefill), then on one token at a
time. The model itself does not change for it: its attention, positions, layer stack and recurrences go
through `shard.hooks`, which under `hooks.use(decode=Calls(...))` keep their state here:

- attention writes the new tokens' keys and values into its cache at the current position and attends
  over every position written so far (`attend`);
- positions count on from the current position;
- a recurrence (the LSTM's scan over time) starts from the carry its previous call ended with;
- the stack of layers scans over its layers' caches with its layers (one slice each).

The state is a list with one entry per call, in the order the model makes its calls (a stack's entry is
the list of its layer's entries, stacked on a leading `layers` axis). Each call takes the entry its
predecessor left at its place and puts its new one; the prefill takes nothing and starts each entry.
The caches carry logical names, so the rules shard them like the activations they hold: heads over
`tensor`, the batch over the batch axes.
"""

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from shard.partition import constrain

CACHE_NAMES = ("batch", None, "kv_heads", "head_dim")  # (batch, position, key/value heads, head size)


@dataclass
class Calls:
    """The entries of one forward pass (or of one layer, inside a stack)."""
    index: jax.Array        # the position of this call's first token
    capacity: int           # positions each attention cache holds
    given: list | None      # the previous pass's entries; None for the prefill
    made: list = field(default_factory=list)

    def take(self):
        """The previous pass's entry for the next call (None at the prefill)."""
        if self.given is None:
            return None
        if len(self.made) >= len(self.given):
            raise ValueError("the model made more cached calls than its previous pass: decoding needs the same "
                             "calls, in the same order, on every pass")
        return self.given[len(self.made)]

    def put(self, entry) -> None:
        self.made.append(entry)

    def inner(self, given) -> "Calls":
        """The calls of one layer inside a stack, at the same position."""
        return Calls(self.index, self.capacity, None if self.given is None else given)


def attend(q, k, v, is_causal: bool, calls: Calls):
    """Attention of the new tokens' queries (batch, new, heads, head_dim) over every cached position: the
    new keys and values are written at `calls.index` first. Positions not yet written are masked out, and
    under causal attention each new token sees only the positions up to its own."""
    entry = calls.take()
    if entry is None:  # the prefill starts an empty cache
        empty = lambda x: jnp.zeros((x.shape[0], calls.capacity, *x.shape[2:]), x.dtype)
        entry = {"k": empty(k), "v": empty(v)}
    start = (0, calls.index, 0, 0)
    keys = constrain(jax.lax.dynamic_update_slice(entry["k"], k.astype(entry["k"].dtype), start), CACHE_NAMES)
    values = constrain(jax.lax.dynamic_update_slice(entry["v"], v.astype(entry["v"].dtype), start), CACHE_NAMES)
    calls.put({"k": keys, "v": values})
    new = calls.index + jnp.arange(q.shape[1])            # the queries' positions
    seen = jnp.arange(calls.capacity)                     # the cache's positions
    mask = seen[None, :] <= new[:, None] if is_causal else seen[None, :] < new[-1] + 1
    return jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask=mask[None, None])


def recur(step, carry, xs, calls: Calls):
    """jax.lax.scan(step, carry, xs) continuing from the carry the previous pass ended with."""
    given = calls.take()
    carry, ys = jax.lax.scan(step, carry if given is None else given, xs)
    calls.put(carry)
    return carry, ys
