"""Sampling from a trained language model, a token at a time over a sliding window."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample(graphdef: nnx.GraphDef, params, rest, prompt: list[int], length: int, window: int,
           seed: int = 0, temperature: float = 0.8) -> list[int]:
    """Continue `prompt` by `length` tokens. Recomputes the window each token: no cache, simple and
    correct for short samples."""

    @jax.jit
    def next_token(params, rest, tokens, position, key):
        model = nnx.merge(graphdef, params, rest)
        model.eval()  # no dropout, running statistics
        logits = model(tokens)[0, position].astype(jnp.float32)
        return jax.random.categorical(key, logits / temperature)

    prompt = list(prompt) or [ord("\n")]  # something to condition on
    tokens = list(prompt)
    key = jax.random.key(seed)
    for _ in range(length):
        context = tokens[-window:]
        padded = np.zeros((1, window), np.int32)
        padded[0, :len(context)] = context
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(params, rest, padded, len(context) - 1, sub)))
    return tokens[len(prompt):]
