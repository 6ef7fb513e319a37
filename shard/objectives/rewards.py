"""GRPO's reward functions (`train.grpo.rewards`, weighted by `train.grpo.weights`): each scores a completion's
text against its row's reference answer, on the host, once per rollout.

Built-in, named by a config:
- `exact`: 1 where the completion, stripped of surrounding whitespace, equals the answer (stripped), else 0;
- `number`: 1 where the last number in the completion equals the answer's last number within
  `train.grpo.tolerance` (absolute), else 0 (no number: 0);
- `regex`: 1 where `train.grpo.pattern` matches somewhere in the completion (a format reward), else 0;
- `length`: minus the completion's length in tokens over `train.grpo.max_new_tokens` (0 to -1: a penalty on
  long answers).

A user's own, `package.module:function`, is called as function(completions, answers) -> one float each. It is
imported only under `train.grpo.trust_code=true`, which only the command line can give (a config file setting it
is refused, and the run's config.yaml records it false): importing a module runs its code, so a file that merely
names one runs nothing, as a model named by a run folder is not imported without --trust-code
(shard/core/registry.py).
"""

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from shard.core import registry
from shard.errors import UserError

BUILT_IN = ("exact", "number", "regex", "length")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class Completion:
    """What a reward sees of one rollout."""
    text: str      # the completion, decoded, without its end token
    answer: str    # the row's reference answer (data.answer_field)
    tokens: int    # the completion's length in tokens (its end token included)


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def exact(done: Sequence[Completion]) -> np.ndarray:
    return np.array([c.text.strip() == c.answer.strip() for c in done], np.float32)


def number(done: Sequence[Completion], tolerance: float) -> np.ndarray:
    def one(c):
        got, want = last_number(c.text), last_number(c.answer)
        return got is not None and want is not None and abs(got - want) <= tolerance
    return np.array([one(c) for c in done], np.float32)


def matches(done: Sequence[Completion], pattern: re.Pattern) -> np.ndarray:
    return np.array([pattern.search(c.text) is not None for c in done], np.float32)


def length(done: Sequence[Completion], most: int) -> np.ndarray:
    return -np.array([c.tokens for c in done], np.float32) / max(most, 1)


class Rewards:
    """The configured reward functions and weights: `score(completions)` -> (rows,) float32 weighted sums, and
    each function's mean (for metrics.jsonl)."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None, *, pattern: str | None = None,
                 tolerance: float = 1e-6, max_new_tokens: int = 1, trusted: bool = False):
        names = [str(n) for n in names]
        if not names:
            raise UserError(f"train.grpo.rewards is empty; name at least one of {', '.join(BUILT_IN)} or "
                            "package.module:function")
        weights = [1.0] * len(names) if not weights else [float(w) for w in weights]
        if len(weights) != len(names):
            raise UserError(f"train.grpo.weights has {len(weights)} entries for {len(names)} rewards "
                            f"(train.grpo.rewards={names}); give one weight per reward, or none (all 1)")
        self.names, self.weights = names, weights
        self.metrics = [f"grpo/reward_{n.rpartition(':')[2]}" for n in names]  # each reward's mean, by its name
        self.fns = [self._resolve(n, pattern, tolerance, max_new_tokens, trusted) for n in names]

    @staticmethod
    def _resolve(name: str, pattern, tolerance, most, trusted) -> Callable:
        if name == "exact":
            return exact
        if name == "number":
            return lambda done: number(done, tolerance)
        if name == "length":
            return lambda done: length(done, most)
        if name == "regex":
            if not pattern:
                raise UserError("train.grpo.rewards names regex but train.grpo.pattern is empty; give the pattern a "
                                "completion must match")
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise UserError(f"train.grpo.pattern={pattern!r} is not a regular expression ({e})") from None
            return lambda done: matches(done, compiled)
        if ":" not in name:
            raise UserError(f"train.grpo.rewards: unknown reward {name!r}; built-in: {', '.join(BUILT_IN)}, or "
                            "package.module:function (with train.grpo.trust_code=true)")
        if not trusted:
            raise UserError(f"train.grpo.rewards names {name!r}, a function outside the framework: importing its "
                            "module would run its code; set train.grpo.trust_code=true if you trust it")
        module_name, _, fn_name = name.partition(":")
        try:
            module = registry._import(module_name)
        except (ImportError, ValueError, TypeError) as e:
            raise UserError(f"train.grpo.rewards: cannot import module {module_name!r} ({e})") from None
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            raise UserError(f"train.grpo.rewards: module {module_name!r} has no function {fn_name!r}")
        return lambda done: _users(fn, name, done)

    def score(self, done: Sequence[Completion]) -> tuple[np.ndarray, dict]:
        """(rows,) rewards, and each reward's mean by name (`grpo/reward_<name>`)."""
        total, means = np.zeros(len(done), np.float32), {}
        for metric, weight, fn in zip(self.metrics, self.weights, self.fns):
            values = np.asarray(fn(done), np.float32)
            total += weight * values
            means[metric] = float(values.mean()) if len(values) else 0.0
        return total, means


def _users(fn, name: str, done: Sequence[Completion]) -> np.ndarray:
    values = np.asarray(fn([c.text for c in done], [c.answer for c in done]), np.float32).reshape(-1)
    if len(values) != len(done):
        raise UserError(f"train.grpo.rewards: {name} returned {len(values)} values for {len(done)} completions; "
                        "it must return one float per completion")
    return values


def advantages(rewards, group: int, eps: float = 1e-4):
    """Each reward less its group's mean, over the group's standard deviation (GRPO's normalisation; the rows of
    one prompt are neighbours), and each group's standard deviation (0: every completion scored alike, no
    signal, advantage 0). Traced in the step, or on numpy arrays."""
    grouped = jnp.reshape(rewards, (-1, group))
    # the sample standard deviation (ddof=1), as TRL's GRPOTrainer (torch's Tensor.std); DeepSeekMath leaves it open
    spread = jnp.std(grouped, axis=1, ddof=1)
    adv = (grouped - jnp.mean(grouped, axis=1, keepdims=True)) / (spread[:, None] + eps)
    return adv.reshape(-1), spread
