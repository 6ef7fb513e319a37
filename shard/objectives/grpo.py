"""GRPO, `train.objective=grpo`: group relative policy optimisation on rewarded rollouts (DeepSeekMath's).

Each train step, on the run's mesh and inside one compiled program:
1. samples `train.grpo.group` completions of each of the batch's prompts from the policy's KV cache
   (shard/objectives/rollouts.py; temperature, top_p and max_new_tokens under train.grpo.*), the draw keyed by
   (train.seed, step), so a resumed run samples what the uninterrupted one did;
2. scores them on the host (one callback a step, not a token; with several processes, on the host of the process
   holding the mesh's first device: every process reads every row's answer; the scores then reach every device)
   with train.grpo.rewards (shard/objectives/rewards.py) and normalises the rewards within each prompt's group
   (the advantages);
3. takes `train.grpo.updates` optimiser steps on those rollouts, each through the step's usual machinery (the
   strategies' shardings, microbatches and reduction): the loss is each completion's mean over its tokens of the
   clipped policy-gradient term, min(r A, clip(r, 1 - epsilon, 1 + epsilon) A) negated, r the ratio of the
   policy's probability to the sampling policy's, plus `beta` times the KL to the reference (the k3 estimator
   exp(ref - logp) - (ref - logp) - 1), averaged over the completions; the step adds what the policy's forward
   pass over the rollouts records (a router's load-balancing loss, `aux_loss`), never the reference's.

The reference is the starting weights (shard/strategies/reference.py: under LoRA the weights without the
adapters, else a frozen copy); beta=0 keeps none. The run's step counts batches of rollouts, not updates, and
the learning rate follows the steps: a step's updates all take its rate (shard/core/optim.py).
Eval scores one greedy completion of each held-out prompt: eval_grpo/reward.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from shard import data as data_lib
from shard.core.precision import cast_floats
from shard.data import tokenizer as tokenizer_lib
from shard.errors import UserError
from shard.objectives import Objective, rewards as rewards_lib, rollouts
from shard.use import generate

ROLLOUT_STREAM = 0x47525030  # "GRP0": the rollouts' draws apart from every other use of train.seed
TIMES = ("grpo/rollout_s", "grpo/update_s")


def build(cfg) -> "GRPO":
    return GRPO(cfg)


class GRPO(Objective):
    name = "grpo"
    switches = {"grpo": "`train.objective=grpo`"}
    refuses = {("grpo", "pipeline"): "the rollouts run the whole model one token at a time, which a pipeline's "
                                     "stages do not; use mesh.stage=1",
               ("grpo", "context"): "the rollouts add one token at a time, which cannot be split over context; use "
                                    "mesh.context=1",
               ("grpo", "offload"): "the rollouts read the weights before the update moves them to the device; use "
                                    "train.offload=none"}

    def __init__(self, cfg):
        g = cfg.train.grpo
        self.group, self.new_tokens, self.beta, self.epsilon = g.group, g.max_new_tokens, g.beta, g.epsilon
        self.updates_per_step = g.updates
        self.reference = "init" if g.beta > 0 else None
        self.reference_label = f"train.objective=grpo with train.grpo.beta={g.beta:g}"  # what keeps a reference
        self.seed = cfg.train.seed
        self.tok = tokenizer_lib.load(cfg.data.tokenizer) if cfg.data.name == "documents" else tokenizer_lib.Bytes()
        self.ends = np.array(sorted(generate.stop_ids(self.tok)), np.int32)
        self.sampling = generate.Sampling(g.temperature, 0, g.top_p, vocab=self.tok.vocab_size)
        self.rewards = rewards_lib.Rewards(g.rewards, g.weights, pattern=g.pattern, tolerance=g.tolerance,
                                           max_new_tokens=g.max_new_tokens, trusted=g.trust_code)
        self.answers: list[str] = []
        self.dtype = jnp.float32
        self._stamps: dict = {}

    # ---- what it combines with (beyond `refuses`)
    def check(self, cfg, mesh_shape: dict) -> None:
        rows = cfg.data.batch_size * self.group
        if rows % cfg.train.grad_accum:
            raise UserError(f"train.grad_accum={cfg.train.grad_accum} must divide the rollouts' rows, data.batch_size "
                            f"x train.grpo.group = {rows}")

    def columns(self, data_cfg) -> tuple[str, ...]:
        return (data_cfg.prompt_field, data_cfg.answer_field)

    # ---- rows
    def data(self, cfg, seed: int, cache_dir) -> data_lib.Data:
        prompts, self.answers = rollouts.read_rows(cfg, self.tok)
        tokens, start = rollouts.left_padded(prompts)
        order = np.random.default_rng([seed, data_lib.SHUFFLE_STREAM]).permutation(len(prompts))
        held = max(1, int(round(len(prompts) * cfg.data.eval_fraction)))
        if len(prompts) - held < cfg.data.batch_size:
            raise UserError(f"data.batch_size={cfg.data.batch_size} is larger than the train split "
                            f"({len(prompts) - held} of data.path's {len(prompts)} rows)")
        split = lambda idx: rollouts.Prompts(tokens[idx], start[idx], idx.astype(np.int32))
        train_src, eval_src = split(order[held:]), split(order[:held])
        rows = data_lib.Rows(0, cfg.data.batch_size)
        train = data_lib.grain.MapDataset.source(data_lib.TrainBatches(
            train_src, data_lib.EpochOrder(len(train_src), seed), cfg.data.batch_size, rows))
        return data_lib.Data(task="lm", train=train, eval=data_lib.EvalBatches(eval_src, lambda b: b,
                                                                               cfg.data.batch_size, rows),
                             batch_size=cfg.data.batch_size, tokens_per_example=self.group * self.new_tokens,
                             num_classes=self.tok.vocab_size, rows=rows,
                             largest_token=int(tokens.max(initial=0)))  # the job checks it against the embedding

    # ---- the loss on rollouts (inside the step, per microbatch)
    def loss(self, model, batch: dict, reference):
        logp = token_logp(model, batch)
        old = batch["old"] if "old" in batch else jax.lax.stop_gradient(logp)
        ratio = jnp.exp(logp - old)
        adv = batch["advantage"][:, None]
        clipped = jnp.clip(ratio, 1 - self.epsilon, 1 + self.epsilon)
        per_token = -jnp.minimum(ratio * adv, clipped * adv)
        weight = batch["completion"]
        mean = lambda x: jnp.mean(jnp.sum(x * weight, axis=1) / jnp.maximum(jnp.sum(weight, axis=1), 1.0))
        stats = {"grpo/clipped": mean((clipped != ratio).astype(jnp.float32))}
        if reference is not None:
            gap = jax.lax.stop_gradient(token_logp(reference, batch)) - logp
            kl = jnp.exp(gap) - gap - 1
            per_token = per_token + self.beta * kl
            stats["grpo/kl"] = mean(kl)
        return mean(per_token), stats

    def eval_sums(self, model, batch: dict, reference) -> dict:
        """One greedy completion of each held-out prompt, scored: the real rows' reward sums."""
        greedy = generate.Sampling(0.0, vocab=self.sampling.vocab)
        tokens = rollouts.sample(model, batch["inputs"], batch["start"], jax.random.key(0), self.new_tokens, greedy,
                                 self.dtype)
        keep = rollouts.kept(tokens, self.ends)
        scored, _ = self._score(tokens, keep, batch["row"])
        mask = batch["mask"]
        return {"count": jnp.sum(mask), "loss": -jnp.sum(mask * scored), "grpo/reward": jnp.sum(mask * scored),
                "grpo/completion_len": jnp.sum(mask * jnp.sum(keep, axis=1))}

    # ---- the step: rollouts, rewards, then the updates
    def around(self, train_fn, graphdef, dtype, trainable=None):
        """The train step on a batch of prompts: train_fn (one optimiser step on rollouts) run `updates` times on
        the rollouts sampled here."""
        self.dtype = dtype  # the compute dtype, for eval's rollouts too

        def step(state, batch):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), ROLLOUT_STREAM), state.step)
            weights = state.params if trainable is None else trainable.weights(state, trainable.get(state))
            policy = nnx.merge(graphdef, cast_floats(jax.lax.stop_gradient(weights), dtype), state.rest, copy=True)
            prompts = io_callback(self._begin, jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32),
                                  batch["inputs"].astype(jnp.int32))
            prompts, start, row = (jnp.repeat(x, self.group, axis=0) for x in (prompts, batch["start"], batch["row"]))
            tokens = rollouts.sample(policy, prompts, start, key, self.new_tokens, self.sampling, dtype)
            keep = rollouts.kept(tokens, self.ends)
            scored, means = self._score(tokens, keep, row)
            advantage, spread = rewards_lib.advantages(scored, self.group)
            rows = {**rollouts.layout(prompts, start, tokens, keep), "advantage": advantage}
            if self.updates_per_step > 1:  # the sampling policy's log-probabilities, for the later updates' ratios
                rows["old"] = jax.lax.stop_gradient(token_logp(policy, rows))
            begun = state.step
            # one update compiled, run `updates` times (the last one's metrics reported), each at the run's step:
            # the learning rate is the step's (shard/core/optim.py), and what the step keys by it draws alike
            def update(s, _):
                s, out = train_fn(s, rows)
                return s.replace(step=begun), out

            state, outs = jax.lax.scan(update, state, length=self.updates_per_step)
            out = jax.tree.map(lambda x: x[-1], outs)
            times = io_callback(self._end, jax.ShapeDtypeStruct((2,), jnp.float32), out["loss"])
            out = {**out, "grpo/reward": jnp.mean(scored), "grpo/reward_std": jnp.mean(spread),
                   "grpo/completion_len": jnp.mean(jnp.sum(keep, axis=1).astype(jnp.float32)),
                   "grpo/zero_variance_groups": jnp.sum(spread == 0).astype(jnp.float32),
                   **{name: means[i] for i, name in enumerate(self.rewards.metrics)},
                   **{name: times[i] for i, name in enumerate(TIMES)}}
            return state.replace(step=begun + 1), out

        return step

    def _score(self, tokens, keep, row):
        """(rows,) rewards and each reward function's mean, from the host."""
        shapes = (jax.ShapeDtypeStruct((tokens.shape[0],), jnp.float32),
                  jax.ShapeDtypeStruct((len(self.rewards.names),), jnp.float32))
        return io_callback(self._host_score, shapes, tokens, keep, row)

    def _host_score(self, tokens, keep, row):
        self._stamps["scored"] = time.perf_counter()
        done = [rewards_lib.Completion(self.tok.decode(generate.until_eos(t[k], self.ends)), self.answers[int(r)],
                                       int(k.sum()))
                for t, k, r in zip(np.asarray(tokens), np.asarray(keep), np.asarray(row))]
        total, means = self.rewards.score(done)
        return total, np.array(list(means.values()), np.float32)

    def _begin(self, prompts):
        self._stamps["begun"] = time.perf_counter()
        return np.asarray(prompts, np.int32)

    def _end(self, _loss):
        now, s = time.perf_counter(), self._stamps
        return np.array([s.get("scored", now) - s.get("begun", now), now - s.get("scored", now)], np.float32)


def token_logp(model, batch: dict) -> jax.Array:
    """(rows, length) float32: the model's log-probability of each target."""
    logits = model(batch["inputs"]).astype(jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), batch["targets"][..., None], axis=-1)[..., 0]


OBJECTIVE = GRPO
