"""Generating text with a trained language model (gpt, moe, lstm, or any model that attends and recurs
through shard.nn.hooks):

    python -m shard.generate RUN [--prompt TEXT ... | --prompt-file FILE | --prompt-lines FILE]
                             [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--batch B]
                             [--quantize int8|int4] [key=value ...]

Several prompts (--prompt repeated, or a file of one a line) are generated as one batch, left-padded to the
longest; each row under greedy decoding is what its prompt gives alone, and stops at EOS on its own.

One prefill pass runs the model over the prompt and fills its cache (attention's keys and values, an
LSTM's state: shard/nn/decoding.py); then one jitted loop adds a token at a time, each step running the model
on that token alone. The cache carries logical names, so under any mesh (`mesh=tp run.cpu_devices=4`, as
for training) it is split like the activations: heads over `tensor`, the batch over the batch axes.

A model with a fixed context (`max_len`: gpt, moe) generates past it with a sliding window: when the cache
is full, its last half is prefilled again as a new start (positions restart at 0) and decoding goes on. A
prompt longer than the context is refused. Text goes through the run's tokenizer (`data.tokenizer`; bytes
for the `text` source: the prompt's UTF-8 bytes are its tokens), and the model picks among its tokens;
generation stops at the tokenizer's EOS, where it has one.
"""

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from shard.data import formats
from shard.data import tokenizer as tokenizer_lib
from shard.nn import decoding
from shard.use.sampling import Sampling  # noqa: F401  (generation's setting, here by its old name too)
from shard.run import distributed
from shard.nn import hooks, partition
from shard.cli import Parser
from shard.errors import UserError
from shard.core.step import cast_floats

BYTES = 256  # the text sources' vocabulary: one token per byte


class Generator:
    """A model's prefill and decoding loop, jitted once per prompt length and chunk length, under a mesh's
    rules (or on one device)."""

    def __init__(self, model: nnx.Module, mesh=None, rules: dict | None = None, dtype=jnp.float32,
                 window: int | None = None):
        self.graphdef, self.state = nnx.split(model)
        self.context = getattr(model, "max_len", None)  # a fixed context (learned positions), else unbounded
        self.window = window  # for a model that keeps nothing through the hooks: how many tokens it sees (seq_len)
        # a model whose positions read differently once a call reaches past this many tokens (LongRoPE's long
        # factors): its cache is computed again, the whole sequence at once, when the sequence first passes it, as
        # transformers' generate does for Phi-3
        self.refill_at = getattr(model, "refill_at", None)
        self.mesh, self.rules, self.dtype = mesh, rules, jnp.dtype(dtype)
        self._prefill = jax.jit(self.forward, static_argnames="capacity")
        # The cache is donated: each chunk writes its tokens into the buffers it was given, not into a copy.
        self._decode = jax.jit(self._decode_steps, static_argnames=("capacity", "steps", "sampling"),
                               donate_argnames="cache")
        self._whole = jax.jit(self._pick_at, static_argnames="sampling")
        self._caches = None  # whether the model's calls keep a cache (known at the first call)
        self.weights = None  # `state` stored otherwise (quantized: shard/quant/serving.py) -> the model's state

    def _model(self, state) -> nnx.Module:
        """The model in the compute dtype, for inference (no dropout, running statistics)."""
        state = state if self.weights is None else self.weights(state)
        model = nnx.merge(self.graphdef, cast_floats(state, self.dtype), copy=True)
        model.eval()
        return model

    def forward(self, state, tokens, index, start, cache, capacity: int, end=None, last=None, seen: int | None = None,
                reach: int | None = None):
        """Logits of the last of `tokens` (float32; of each row's column `last` where given) and the cache with
        them written at each row's `index` (its padding before its `start` and from its `end`; attending over
        its first `seen` slots; a row spanning `reach` positions, default capacity: shard/nn/decoding.py)."""
        model = self._model(state)
        calls = decoding.Calls(jnp.asarray(index, jnp.int32), jnp.asarray(start, jnp.int32), capacity, cache,
                               end=None if end is None else jnp.asarray(end, jnp.int32), seen=seen, reach=reach)
        with hooks.use(decode=calls):
            logits = model(tokens)
        logits = logits[:, -1] if last is None else jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        return logits.astype(jnp.float32), calls.made

    def _decode_steps(self, state, cache, token, index, start, key, capacity: int, steps: int, sampling: Sampling):
        """`steps` tokens after `token`, one forward pass each, in one scan."""
        def step(carry, key):
            cache, token, index = carry
            logits, cache = self.forward(state, token[:, None], index, start, cache, capacity)
            token = sampling.pick(logits, key)
            return (cache, token, index + 1), token

        (cache, _, _), tokens = jax.lax.scan(step, (cache, token, index), jax.random.split(key, steps))
        return tokens.T, cache

    def _pick_at(self, state, tokens, last, key, sampling: Sampling):
        """The token after position `last` of `tokens`, from one pass over all of them (no cache)."""
        return sampling.pick(self._model(state)(tokens)[:, last].astype(jnp.float32), key)

    def _uncached(self, prompt: np.ndarray, new_tokens: int, sampling: Sampling, key, rules) -> np.ndarray:
        """Each token by re-running the model on the sequence's last tokens (at most its context, or `window`),
        padded at the end to one length so that one program serves every step: for a model whose attention or
        recurrence does not go through shard.nn.hooks, and so keeps nothing between calls."""
        width = prompt.shape[1] + new_tokens - 1
        width = min(width, self.context or self.window or width)
        seq, made = prompt, []
        for _ in range(new_tokens):
            window = seq[:, -width:]
            padded = np.zeros((len(seq), width), np.int32)
            padded[:, :window.shape[1]] = window
            key, sub = jax.random.split(key)
            made.append(np.asarray(self._whole(self.state, self.place(padded, rules), window.shape[1] - 1, sub,
                                               sampling=sampling)))
            seq = np.concatenate([seq, made[-1][:, None]], axis=1)
        return np.stack(made, axis=1)

    def batch_rules(self, batch: int) -> dict | None:
        """The training rules, less what one token at a time cannot use: the length split over `context`, and
        the batch axes where they do not divide the batch (the batch is then copied to each device)."""
        if self.mesh is None:
            return None
        rules = {**self.rules, "length": None}
        if batch % partition.batch_shards(rules, self.mesh.shape):
            rules["batch"] = None
        return rules

    def caches(self) -> bool:
        """Whether any call of the model keeps a cache (a trace, no compile), known at the first call."""
        if self._caches is None:
            probe = functools.partial(self.forward, index=np.zeros(1), start=np.zeros(1), cache=None, capacity=1)
            self._caches = bool(jax.tree.leaves(jax.eval_shape(probe, self.state, jnp.zeros((1, 1), jnp.int32))[1]))
        return self._caches

    def __call__(self, prompt, new_tokens: int, sampling: Sampling = Sampling(), seed: int = 0,
                 eos=None, pad: int | None = None) -> np.ndarray:
        """(batch, prompt length) int tokens, or a list of prompts of any lengths -> (batch, new_tokens) int
        tokens. Prompts of different lengths run as one batch, left-padded to the longest: padding is never
        attended and each row's positions start at 0 at its first token, so under greedy decoding each row is
        what its prompt gives alone (while it fits in a fixed context; past it the whole batch's window slides
        at once). A model that keeps no cache runs one group per length. `eos`: a token id or several (a
        model's generation_config.json may list several end tokens); a row ends at the first of them, the rest
        of its row is `pad` (default: the end token it met), and generation stops once every row has ended."""
        lengths = [len(p) for p in prompt]
        if min(lengths, default=0) == 0:
            raise UserError("a prompt is empty; give at least one token (one byte of text)")
        if len(set(lengths)) > 1 and not self.caches():
            out = np.empty((len(prompt), new_tokens), np.int32)
            for length in sorted(set(lengths)):
                rows = [i for i, p in enumerate(prompt) if len(p) == length]
                out[rows] = self(np.array([prompt[i] for i in rows], np.int32), new_tokens, sampling, seed, eos, pad)
            return out
        padded = np.zeros((len(prompt), max(lengths)), np.int32)
        for row, p in zip(padded, prompt):
            row[len(row) - len(p):] = p
        made = self._generate(padded, padded.shape[1] - np.array(lengths, np.int32), new_tokens, sampling, seed, eos)
        return made if not len(end_ids(eos)) else after_eos(made, eos, pad)

    def _generate(self, prompt: np.ndarray, pads: np.ndarray, new_tokens: int, sampling: Sampling, seed: int,
                  eos) -> np.ndarray:
        """`prompt` left-padded, each row's first real token in its column `pads`."""
        batch, length = prompt.shape
        # a fixed context bounds the cache; within it, the cache holds what this call needs, not the model's maximum
        capacity = min(length + new_tokens, self.context or length + new_tokens)
        if length > capacity:
            raise UserError(f"the prompt is {length} tokens but the model's context is {self.context} (max_len); "
                            f"shorten the prompt to at most {self.context} tokens")
        rules, key = self.batch_rules(batch), jax.random.key(seed)
        seq, made, cache, index = prompt, [], None, 0
        with partition.activate(self.mesh, rules):
            if not self.caches():
                return self._uncached(prompt, new_tokens, sampling, key, rules)
            while sum(m.shape[1] for m in made) < new_tokens and not ended(made, eos):
                key, sub = jax.random.split(key)
                refill = cache is not None and index == self.refill_at
                if cache is None or index == capacity or refill:  # the start, or a full cache: prefill (the last half)
                    window = seq if cache is None or refill else seq[:, -(capacity // 2):]
                    start = np.maximum(pads - (seq.shape[1] - window.shape[1]), 0).astype(np.int32)
                    logits, cache = distributed.finished(self._prefill(
                        self.state, self.place(window, rules), np.zeros(batch, np.int32), start, None,
                        capacity=capacity))
                    token, index = sampling.pick(logits, sub), window.shape[1]
                    chunk = np.asarray(token)[:, None]
                else:
                    steps = min(new_tokens - sum(m.shape[1] for m in made), capacity - index)
                    if self.refill_at is not None and index < self.refill_at:
                        steps = min(steps, self.refill_at - index)
                    tokens, cache = distributed.finished(self._decode(
                        self.state, cache, token, np.full(batch, index, np.int32), start, sub, capacity=capacity,
                        steps=steps, sampling=sampling))
                    chunk, token, index = np.asarray(tokens), tokens[:, -1], index + steps
                made.append(chunk)
                seq = np.concatenate([seq, chunk], axis=1)
        out = np.concatenate(made, axis=1)[:, :new_tokens]
        ends = end_ids(eos)
        return np.pad(out, ((0, 0), (0, new_tokens - out.shape[1])), constant_values=ends[0] if len(ends) else 0)

    def place(self, tokens: np.ndarray, rules):
        if self.mesh is None:
            return jnp.asarray(tokens)
        spec = partition.logical_to_spec(("batch", None), rules, self.mesh.shape)
        return jax.device_put(tokens, NamedSharding(self.mesh, spec))


def end_ids(eos) -> np.ndarray:
    """The end token ids `eos` names: None, one id, or several."""
    return np.array(sorted(eos) if isinstance(eos, (set, frozenset)) else [] if eos is None else np.ravel(eos),
                    np.int64)


def ended(made: list, eos) -> bool:
    """Whether every row of the chunks made so far holds an end token."""
    ends = end_ids(eos)
    return len(ends) > 0 and bool(made) and bool(np.isin(np.concatenate(made, axis=1), ends).any(axis=1).all())


def after_eos(tokens: np.ndarray, eos, pad: int | None = None) -> np.ndarray:
    """Each row up to and including its first end token, `pad` after it (default: that end token)."""
    hit = np.cumsum(np.isin(tokens, end_ids(eos)), axis=1)
    first = np.take_along_axis(tokens, np.argmax(hit == 1, axis=1)[:, None], axis=1)
    return np.where((hit > 1) | ((hit == 1) & ~np.isin(tokens, end_ids(eos))), first if pad is None else pad,
                    tokens).astype(np.int32)


def output_vocab(model: nnx.Module) -> int:
    """The width of a language model's logits (a trace on one token, nothing computed)."""
    graphdef, state = nnx.split(model)
    return jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, jnp.zeros((1, 1), jnp.int32)).shape[-1]


def recompute(model: nnx.Module, prompt: np.ndarray, new_tokens: int, vocab: int | None = None) -> np.ndarray:
    """Greedy tokens by re-running the model on the whole sequence for each one, no cache: the reference the
    cached loop must equal (tests, bench/generate.py). A causal model's outputs at a position do not depend on
    what follows it, so the sequence is padded at its end to one length (one program)."""
    return Generator(model)._uncached(np.asarray(prompt, np.int32), new_tokens, Sampling(0, vocab=vocab),
                                      jax.random.key(0), None)


def text_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def until_eos(tokens, eos):
    """A row's tokens before its first end token (all of them without one)."""
    tokens = np.asarray(tokens)
    hits = np.flatnonzero(np.isin(tokens, end_ids(eos)))
    return tokens[:hits[0]] if len(hits) else tokens


def stop_ids(tok) -> frozenset[int]:
    """The ids that end an answer: the tokenizer's end tokens (its EOS and generation_config.json's list) and
    its chat template's end-of-turn token."""
    turn = formats.end_of_turn_id(tok)
    return frozenset(tok.end_ids) | ({turn} if turn is not None else set())


def token_text(tokens) -> str:
    return bytes(int(t) % BYTES for t in tokens).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- command line

def main(argv: list[str]) -> int:
    from shard.quant import serving
    from shard.use import load

    parser = Parser(prog="python -m shard.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", metavar="RUN", help="run folder (or its checkpoints/ or a step folder)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", action="append", metavar="TEXT", help="text to continue (default: a newline); "
                        "repeat it for a batch of prompts, generated together")
    source.add_argument("--prompt-file", metavar="FILE", help="file whose text to continue")
    source.add_argument("--prompt-lines", metavar="FILE", help="file of prompts, one a line, generated together")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = all tokens")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 = all tokens")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="continuations of the prompt, sampled "
                        "together")
    load.add_loading_arguments(parser)
    serving.add_argument(parser)
    args, overrides, whole_mesh = load.parse_loading(parser, argv)
    if args.max_new_tokens < 1 or args.batch < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} and --batch {args.batch} must be at least 1")
    prompts = args.prompt or ["\n"]
    for flag, path in (("--prompt-file", args.prompt_file), ("--prompt-lines", args.prompt_lines)):
        if path:
            try:
                text = open(path, encoding="utf-8", errors="replace").read()
            except OSError as e:
                raise UserError(f"{flag} {path}: {e.strerror or e}") from None
            prompts = [text] if flag == "--prompt-file" else [line for line in text.splitlines() if line]
    if not prompts:
        raise UserError(f"--prompt-lines {args.prompt_lines}: the file holds no prompt (one a line)")

    loaded = load.load(args.run, overrides, step=args.step, whole_mesh=whole_mesh, key="RUN",
                       trust_code=args.trust_code)
    generator = serving.quantize_generator(Generator(loaded.model, loaded.mesh if whole_mesh else None, loaded.rules,
                                                     loaded.cfg.train.dtype, window=loaded.cfg.data.seq_len),
                                           args.quantize)
    tok = load.load_tokenizer(args.run, key="RUN")
    embedded = output_vocab(loaded.model)  # may be fewer than the tokenizer's tokens (gemma-3's image tokens)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, vocab=min(tok.vocab_size, embedded)).check()
    rows = [prompt for prompt in prompts for _ in range(args.batch)]
    start = time.perf_counter()
    asked = [tok.prompt(prompt) for prompt in rows]
    for ids in asked:
        if wrong := tokenizer_lib.unembedded(tok, ids, embedded):
            raise UserError(f"the prompt: {wrong}")
    ends = stop_ids(tok)
    out = generator(asked, args.max_new_tokens, sampling, seed=args.seed, eos=ends)
    seconds = time.perf_counter() - start
    for i, (prompt, ids, row) in enumerate(zip(rows, asked, out)):
        if len(rows) > 1:
            print(f"--- {i}")
        print(prompt + tok.continuation(ids, until_eos(row, ends)))
    print(f"{loaded.cfg.model.name} at step {loaded.step} of {args.run}: {len(rows)} x {args.max_new_tokens} tokens, "
          f"{out.size / seconds:,.0f} tokens/s ({seconds:.2f} s, compiling included)", file=sys.stderr)
    return 0

