"""The online softmax over blocks of keys (Milakov and Gimelshein 2018; flash attention's forward pass).

Each query keeps its running maximum score, its sum of exponentials below that maximum and its weighted sum of
values; a block of keys updates all three, rescaling what came before to the new maximum. Attention over a long
sequence then holds one block's scores at a time, never a whole row's. Ring attention folds the context devices'
chunks with it as they pass (shard/nn/ring.py), generation folds blocks of a long cache (shard/nn/decoding.py).
A query that has seen no key yet (every score of the blocks so far masked, -inf) keeps nothing: no NaN.
Attention sinks (GPT-OSS's) are in the state from the start: a key of the sink's logit whose value is zero.
"""

import jax.numpy as jnp


def start(queries: tuple, dim: int, sink=None) -> tuple:
    """The state before any block, for queries of shape `queries` and values of `dim` channels: (maximum, sum,
    weighted values), float32. `sink`: each query's sink logit (broadcasting to `queries`; None: none), one more
    term of its softmax that weighs no value: the maximum starts at it and the sum at exp(0) (as splash's kernel)."""
    if sink is None:
        return jnp.full(queries, -jnp.inf), jnp.zeros(queries), jnp.zeros((*queries, dim))
    return jnp.broadcast_to(jnp.asarray(sink, jnp.float32), queries), jnp.ones(queries), jnp.zeros((*queries, dim))


def fold(state: tuple, scores, values, product: str) -> tuple:
    """`state` with one block of keys folded in: `scores` (queries..., keys) float32, -inf where masked; `values`
    the block's, multiplied with the weights by the einsum `product` ("weights, values -> queries..., dim")."""
    best, total, out = state
    new_best = jnp.maximum(best, scores.max(axis=-1))
    seen = jnp.isfinite(new_best)
    rescale = jnp.where(seen, jnp.exp(best - new_best), 0.0)
    weights = jnp.where(seen[..., None], jnp.exp(scores - new_best[..., None]), 0.0)
    out = out * rescale[..., None] + jnp.einsum(product, weights, values.astype(jnp.float32))
    return new_best, total * rescale + weights.sum(axis=-1), out


def finish(state: tuple) -> tuple:
    """(the attention output, float32, and each query's log-sum-exp) of the folded blocks."""
    best, total, out = state
    return out / total[..., None], best + jnp.log(total)
