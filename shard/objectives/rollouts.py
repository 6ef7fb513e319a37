"""GRPO's rollouts and prompts: completions sampled inside the train step, and the rows they start from.

Sampling runs the generator's own prefill and decoding loop (shard/use/generate.py) traced into the step: one
prefill over the left-padded prompts, then one scan adding a token at a time from the KV cache, with the
cache's logical names splitting it over the training mesh as the activations are. No token goes back to the
host while a completion grows; the host sees the finished completions once, to score them.

The completions are then laid out for the update as ordinary causal rows: each row's prompt (its padding
rolled to the end), its completion, then padding; `completion` marks the targets the loss counts (the
completion's tokens up to and including its first end token).
"""

import jax
import jax.numpy as jnp
import numpy as np

from shard.data import documents, formats
from shard.errors import UserError
from shard.nn.partition import constrain
from shard.use import generate


def sample(model, prompts, start, key, new_tokens: int, sampling: generate.Sampling, dtype) -> jax.Array:
    """(rows, new_tokens) int32 tokens after each left-padded prompt (rows, P) whose first real token is in
    column `start`, from the cache: traced, for the step's own program."""
    gen = generate.Generator(model, dtype=dtype)
    rows, length = prompts.shape
    capacity = length + new_tokens
    if gen.context and capacity > gen.context:
        raise UserError(f"train.grpo.max_new_tokens={new_tokens} after prompts of up to {length} tokens is "
                        f"{capacity} tokens, past the model's context ({gen.context}, max_len); shorten one")
    if not gen.caches():
        raise UserError("train.objective=grpo samples from the model's cache: its attention must go through "
                        "shard.nn.hooks (the library's models do)")
    first_key, rest_key = jax.random.split(key)
    logits, cache = gen.forward(gen.state, prompts, jnp.zeros(rows, jnp.int32), start, None, capacity)
    first = sampling.pick(logits, first_key)
    if new_tokens == 1:
        return first[:, None]
    rest, _ = gen._decode_steps(gen.state, cache, first, jnp.full(rows, length, jnp.int32), start, rest_key,
                                capacity=capacity, steps=new_tokens - 1, sampling=sampling)
    return jnp.concatenate([first[:, None], rest], axis=1)


def kept(tokens, end_ids) -> jax.Array:
    """(rows, new) bool: each completion's tokens up to and including its first end token."""
    if not len(end_ids):
        return jnp.ones(tokens.shape, bool)
    hit = jnp.isin(tokens, jnp.asarray(end_ids, tokens.dtype))
    return (jnp.cumsum(hit, axis=1) - hit) == 0


def layout(prompts, start, tokens, keep) -> dict:
    """The update's rows: inputs and next-token targets of prompt + completion with each prompt's padding
    rolled to the end (so positions start at 0 and a causal pass needs no mask), and `completion`, 1 on the
    targets that are completion tokens the row kept."""
    rows, length = prompts.shape
    whole = jnp.concatenate([prompts, jnp.where(keep, tokens, 0)], axis=1)
    width = whole.shape[1]
    rolled = jnp.take_along_axis(whole, (jnp.arange(width)[None] + start[:, None]) % width, axis=1)
    at = jnp.arange(width - 1)[None] - (length - start[:, None] - 1)  # target t is completion token `at`
    inside = (at >= 0) & (at < tokens.shape[1])
    counted = inside & jnp.take_along_axis(keep, jnp.clip(at, 0, tokens.shape[1] - 1), axis=1)
    out = {"inputs": rolled[:, :-1], "targets": rolled[:, 1:], "completion": counted.astype(jnp.float32)}
    return {k: constrain(v, ("batch", None)) for k, v in out.items()}


class Prompts:
    """A split's rows as left-padded prompt tokens (`inputs`, `start`: the first real column) and the index of
    each row's answer (`row`), read in batches by index (the data pipeline's source protocol)."""

    def __init__(self, tokens: np.ndarray, start: np.ndarray, rows: np.ndarray):
        self.tokens, self.start, self.rows = tokens, start, rows

    def __len__(self) -> int:
        return len(self.rows)

    def read_batch(self, indices: np.ndarray) -> dict:
        return {"inputs": self.tokens[indices], "start": self.start[indices], "row": self.rows[indices]}


def read_rows(cfg, tok) -> tuple[list[list[int]], list[str]]:
    """Every row's prompt tokens (a chat's messages rendered with the tokenizer's template, ready for the
    assistant's turn) and its answer's text, from data.path's files."""
    prompt_field, answer_field = cfg.data.prompt_field, cfg.data.answer_field
    if cfg.data.name != "documents" or not prompt_field or not answer_field:
        raise UserError("train.objective=grpo reads prompts and answers from rows: set data.name=documents, "
                        "data.prompt_field and data.answer_field")
    formatter = formats.Formatter((prompt_field,), tok)
    prompts, answers = [], []
    for path in documents.corpus_files(cfg.data.path):
        for batch in documents.rows(path, (prompt_field, answer_field)):
            for prompt, answer in batch:
                if isinstance(prompt, (list, tuple)):
                    prompts.append(formatter.prompt_ids(list(prompt)))
                else:
                    prompts.append(tok.prompt(formats.text_value(prompt, prompt_field, str(path))))
                answers.append(formats.text_value(answer, answer_field, str(path)))
    if not prompts:
        raise UserError(f"data.path={cfg.data.path!r} holds no rows")
    if min(len(p) for p in prompts) == 0:
        raise UserError(f"data.prompt_field={prompt_field}: a prompt is empty; every row needs one")
    return prompts, answers


def left_padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in zip(tokens, prompts):
        row[width - len(p):] = p
    return tokens, (width - np.array([len(p) for p in prompts])).astype(np.int32)
