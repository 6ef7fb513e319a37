"""GRPO (train.objective=grpo): its rewards, the rollouts' layout, and runs of a tiny model on single-digit
addition (built here, offline): the reward rises, QLoRA on 2 processes with accumulation gives one device's curve,
a resume is bitwise, each of a step's updates takes its learning rate, and what does not combine is refused in one
line."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shard import config
from shard.errors import UserError
from shard.objectives import rewards, rollouts
from tests.conftest import overrides

MODEL = ["model.name=gpt", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_len=16"]


def done(*texts, answer="7", tokens=2):
    return [rewards.Completion(t, answer, tokens) for t in texts]


def test_built_in_rewards():
    np.testing.assert_array_equal(rewards.exact(done(" 7\n", "7 ", "77", "")), [1, 1, 0, 0])
    np.testing.assert_array_equal(rewards.number(done("so 3, then 7", "7.0000001", "1,007", "x", answer="n = 7"), 1e-6),
                                  [1, 1, 0, 0])
    assert rewards.last_number("1,007 and -2.5e1") == -25.0
    scored, means = rewards.Rewards(["exact", "regex", "length"], [1.0, 0.5, 2.0], pattern=r"^\d",
                                    max_new_tokens=4).score(done("7", "x7", tokens=1) + done("8", tokens=4))
    np.testing.assert_allclose(scored, [1 + 0.5 - 0.5, 0 + 0 - 0.5, 0 + 0.5 - 2.0])
    assert means == pytest.approx({"grpo/reward_exact": 1 / 3, "grpo/reward_regex": 2 / 3,
                                   "grpo/reward_length": -0.5})


@pytest.mark.parametrize("names, weights, pattern, message", [
    (["exact", "number"], [1.0], None, "train.grpo.weights has 1 entries for 2 rewards"),
    (["close"], [], None, "unknown reward 'close'"),
    (["regex"], [], None, "train.grpo.pattern is empty"),
    (["regex"], [], "(", "is not a regular expression"),
    ([], [], None, "train.grpo.rewards is empty"),
])
def test_bad_rewards_are_one_line(names, weights, pattern, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        rewards.Rewards(names, weights, pattern=pattern)


def test_a_users_reward_runs_only_with_trust(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("RAN = []\nRAN.append(1)\n"
                                            "def longest(completions, answers):\n"
                                            "    return [len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="set train.grpo.trust_code=true"):
        rewards.Rewards(["my_rewards:longest"], [])
    import sys
    assert "my_rewards" not in sys.modules  # refused before anything was imported
    scored, _ = rewards.Rewards(["my_rewards:longest"], [], trusted=True).score(done("abc", "d"))
    np.testing.assert_array_equal(scored, [3, 1])
    with pytest.raises(UserError, match="has no function 'nothing'"):
        rewards.Rewards(["my_rewards:nothing"], [], trusted=True)


def test_advantages_are_normalised_within_each_group():
    """Over the group's sample standard deviation (TRL's torch std): [1, 0, 0, 1] has sqrt(4 x 0.25 / 3)."""
    adv, spread = rewards.advantages(np.array([1, 0, 0, 1, 2, 2, 2, 2], np.float32), group=4)
    std = np.sqrt(1 / 3)
    np.testing.assert_allclose(adv[:4], np.array([1, -1, -1, 1]) * 0.5 / (std + 1e-4), rtol=1e-6)
    np.testing.assert_array_equal(adv[4:], 0)
    np.testing.assert_allclose(spread, [std, 0], rtol=1e-6)


def test_rollouts_are_laid_out_as_causal_rows():
    prompts = jnp.array([[0, 0, 51, 43, 52, 61], [0, 51, 43, 52, 61, 50]], jnp.int32)  # left-padded
    start = jnp.array([2, 1], jnp.int32)
    tokens = jnp.array([[55, 10, 99], [10, 56, 57]], jnp.int32)
    keep = rollouts.kept(tokens, np.array([10], np.int32))  # up to and including the first end token
    np.testing.assert_array_equal(keep, [[True, True, False], [True, False, False]])
    rows = rollouts.layout(prompts, start, tokens, keep)
    np.testing.assert_array_equal(rows["inputs"], [[51, 43, 52, 61, 55, 10, 0, 0], [51, 43, 52, 61, 50, 10, 0, 0]])
    np.testing.assert_array_equal(rows["targets"][:, :6], [[43, 52, 61, 55, 10, 0], [43, 52, 61, 50, 10, 0]])
    np.testing.assert_array_equal(rows["completion"], [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0, 0]])


# ---- runs on single-digit addition
@pytest.fixture(scope="module")
def addition(tmp_path_factory):
    """Rows 'a+b=' (a + b < 10) with their answers, and completions for fine-tuning."""
    folder = tmp_path_factory.mktemp("addition")
    with open(folder / "add.jsonl", "w") as f:
        for a in range(10):
            for b in range(10 - a):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "completion": f"{a + b}\n"}) + "\n")
    return folder


def grpo(addition, *extra):
    return [*MODEL, "data.name=documents", f"data.path={addition}/add.jsonl", "data.prompt_field=prompt",
            "data.answer_field=answer", "data.eval_fraction=0.2", "train.objective=grpo", "train.grpo.group=8",
            "train.grpo.max_new_tokens=2", "optimizer.warmup_steps=0", *extra]


# From a random model: the reward is a completion starting with a digit (a format reward, about 4% of a random
# model's completions at first). A constant learning rate, so that the first steps of a longer run are a short run's.
DIGIT_FIRST = ["train.grpo.rewards=[regex]", "train.grpo.pattern=^[0-9]", "data.batch_size=8", "optimizer.lr=1e-2",
               "optimizer.min_lr_ratio=1", "train.grpo.updates=2", "run.log_every=1"]
STEPS = 24


@pytest.fixture(scope="module")
def learned(tmp_path_factory, addition):
    """24 steps on one device, checkpointed at 12 and 24."""
    from shard.run import trainer

    folder = tmp_path_factory.mktemp("learned")
    args = overrides(folder, *grpo(addition, *DIGIT_FIRST), f"train.steps={STEPS}", "run.cpu_devices=1",
                     "checkpoint.enabled=true", f"checkpoint.every={STEPS // 2}", "checkpoint.async=false")
    return folder, args, trainer.run(config.load(None, args))


@pytest.mark.slow
def test_the_reward_rises(learned):
    reward = [r["grpo/reward"] for r in learned[2].history]
    assert len(reward) == STEPS
    assert np.mean(reward[-6:]) > np.mean(reward[:6]) + 0.3, reward


@pytest.mark.slow
def test_resume_is_bitwise_with_the_rollouts(tmp_path, learned):
    from shard.run import trainer

    folder, args, whole = learned
    shutil.copytree(folder, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / str(STEPS))  # as if stopped after step 12
    resumed = trainer.run(config.load(None, [*args, f"run.dir={tmp_path}/run"]))
    assert resumed.start_step == STEPS // 2
    drop = ("step_time_s", "data_wait_s", "tokens_per_s", "tflops_per_device", "compile_s", "startup_s",
            "grpo/rollout_s", "grpo/update_s", "peak_memory_gb")
    same = lambda h: [{k: v for k, v in r.items() if k not in drop} for r in h]
    assert same(resumed.history) == same(whole.history)[STEPS // 2:]
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(whole.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_qlora_on_two_processes_with_accumulation_gives_one_devices_curve(train, tmp_path, addition):
    """LoRA on an nf4 base (the KL's reference: the dequantized base; the rollouts decode through the layers' weights
    built one at a time) on 2 real processes of 2 devices each, fsdp x tensor, 2 microbatches: the rollouts, their
    rewards (scored once, on the first process's host) and the updates are one device's (fixed seed)."""
    from test_multihost import launch

    qlora = [*grpo(addition, *DIGIT_FIRST), "train.steps=2", "train.lora.rank=4", "train.lora.targets=[q,k,v,o,mlp]",
             "train.lora.base=nf4"]
    one = train(*qlora, "run.cpu_devices=1").history
    folder = tmp_path / "two"
    done = launch("local", "--processes=2", "--", *overrides(folder, *qlora), "mesh=fsdp_tp", "train.grad_accum=2",
                  "run.cpu_devices=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    many = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    many = [r for r in many if "loss" in r and "eval_loss" not in r]
    for key in ("grpo/reward", "grpo/completion_len", "grpo/zero_variance_groups"):  # the same rollouts
        assert [r[key] for r in many] == [r[key] for r in one], key
    for key in ("loss", "grpo/kl", "grad_norm"):  # (the loss sums terms that cancel: an absolute tolerance)
        np.testing.assert_allclose([r[key] for r in many], [r[key] for r in one], rtol=1e-4, atol=2e-5)


# ---- the loss on fixed rollouts: 2 prompts x 4 completions of 8 tokens, each completion's tokens from 3 on
SCORES = np.array([1.0, 0.0, 0.5, 0.0, 0.2, 1.0, 1.0, 0.0], np.float32)


def rollout_rows() -> dict:
    rng = np.random.default_rng(0)
    completion = np.zeros((8, 8), np.float32)
    for row, end in enumerate([8, 6, 7, 5, 8, 4, 8, 6]):
        completion[row, 3:end] = 1
    return {"inputs": rng.integers(1, 256, (8, 8)).astype(np.int32),
            "targets": rng.integers(1, 256, (8, 8)).astype(np.int32), "completion": completion,
            "advantage": np.asarray(rewards.advantages(SCORES, group=4)[0])}


def log_probs(graphdef, params, rest, rows) -> np.ndarray:
    """(rows, length) log p(target) in float64 numpy, from the model's logits."""
    from flax import nnx

    logits = np.asarray(nnx.merge(graphdef, params, rest, copy=True)(rows["inputs"]), np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return np.take_along_axis(logits, rows["targets"][..., None], -1)[..., 0] - logz


def test_the_loss_is_deepseekmaths_grpo(tmp_path, addition):
    """DeepSeekMath's GRPO loss (as TRL's loss_type="grpo") in float64 numpy from the scores: advantages normalised
    in each group over its sample standard deviation (TRL's torch std) + 1e-4; per token, the clipped surrogate
    min(r A, clip(r, 1 - eps, 1 + eps) A) negated plus beta x the k3 KL exp(ref - logp) - (ref - logp) - 1; each
    completion's mean over its tokens, averaged. The sampling policy's log-probabilities differ from the model's, so
    the clip acts on both sides with both signs of advantage, and the reference differs from the model."""
    from flax import nnx

    from shard.objectives import grpo as grpo_lib
    from test_dpo import tiny_moe

    eps, beta = 0.2, 0.1
    cfg = config.load(None, overrides(tmp_path, *grpo(addition, "train.grpo.group=4", f"train.grpo.beta={beta}",
                                                      f"train.grpo.epsilon={eps}")))
    graphdef, params, rest = tiny_moe(0.0)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    ref_params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), params)
    rows = rollout_rows()
    logp, ref = log_probs(graphdef, params, rest, rows), log_probs(graphdef, ref_params, rest, rows)
    rows["old"] = (logp + np.random.default_rng(1).uniform(-0.6, 0.6, logp.shape)).astype(np.float32)
    model, reference = (nnx.merge(graphdef, p, rest, copy=True) for p in (params, ref_params))
    got, stats = grpo_lib.build(cfg).loss(model, rows, reference)

    grouped = SCORES.astype(np.float64).reshape(2, 4)
    adv = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(8, 1)
    ratio, mask = np.exp(logp - rows["old"]), rows["completion"] > 0
    surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    mean = lambda x: np.mean((x * mask).sum(1) / mask.sum(1))
    want = mean(-surrogate + beta * kl)
    for side in (ratio > 1 + eps, ratio < 1 - eps):  # the clip acts where the sign of A makes it bind, and not
        assert (side & mask & (adv > 0)).any() and (side & mask & (adv < 0)).any()
    assert beta * mean(kl) > 1e-2  # the KL term counts (the reference differs)
    assert float(got) == pytest.approx(want, abs=1e-6)
    assert float(stats["grpo/kl"]) == pytest.approx(mean(kl), rel=1e-5)


def test_a_mixture_of_experts_balancing_loss_is_trained_and_logged(tmp_path, addition):
    """The balancing loss of the policy's forward pass over the rollouts is added and logged as aux_loss, and not
    the reference's (at step 1 the same model: its own would double it)."""
    from shard.objectives import grpo as grpo_lib
    from test_dpo import assert_balancing_trained

    cfg = config.load(None, overrides(tmp_path, *grpo(addition, "train.grpo.group=4", "train.grpo.beta=0.1")))
    rows = rollout_rows()
    assert_balancing_trained(grpo_lib.build(cfg), rows, rows["inputs"])


def test_each_update_of_a_step_takes_the_steps_learning_rate():
    """train.grpo.updates=2: the optimizer's count advances twice a step, the schedule once (warmup and decay span
    train.steps); plain SGD shows the rate it applied."""
    from shard.core import optim

    cfg = config.load(None, ["optimizer.name=sgd", "optimizer.momentum=0", "optimizer.lr=1.0", "optimizer.clip_norm=0",
                             "optimizer.warmup_steps=4", "optimizer.weight_decay=0"]).optimizer
    tx, schedule = optim.build(cfg, 10, updates_per_step=2)
    params, state, rates = {"w": jnp.zeros(())}, None, []
    state = tx.init(params)
    for _ in range(8):
        update, state = tx.update({"w": jnp.ones(())}, state, params)
        rates.append(-float(update["w"]))
    assert rates == pytest.approx([float(schedule(i // 2)) for i in range(8)])
    assert rates[0] == rates[1] == 0.0 and rates[2] == rates[3] == pytest.approx(0.25)


def test_trust_comes_from_the_command_line_never_from_a_file(tmp_path):
    """A config file that turns trust on is refused; the command line's trust is not written to the run's
    config.yaml, so a run read back from its folder runs no reward's code unless trusted again."""
    file = tmp_path / "grpo.yaml"
    file.write_text("train:\n  grpo:\n    rewards: [my_module:score]\n    trust_code: true\n")
    with pytest.raises(UserError, match="sets train.grpo.trust_code: only the command line can"):
        config.load(file, [])
    cfg = config.load(None, ["train.grpo.trust_code=true"])
    assert cfg.train.grpo.trust_code and "trust_code: false" in config.to_yaml(cfg)


@pytest.mark.parametrize("extra, message", [
    (["mesh=pp", "run.cpu_devices=2", "pipeline.schedule=1f1b"], "train.objective=grpo with mesh.stage=2"),
    (["data.answer_field=null"], "set data.name=documents, data.prompt_field and data.answer_field"),
    (["train.grpo.rewards=[my_module:score]"], "set train.grpo.trust_code=true"),
    (["train.grad_accum=3"], "train.grad_accum=3 must divide the rollouts' rows"),
    (["train.offload=optimizer"], "use train.offload=none"),
    (["mesh.replica=2", "train.sync=local_sgd"], "train.objective=grpo with train.grpo.beta=0.04"),
])
def test_what_does_not_combine_is_one_line(tmp_path, addition, extra, message):
    from shard.plan import analysis

    cfg = config.load(None, overrides(tmp_path, *grpo(addition, "data.batch_size=8"), *extra))
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        analysis.analyse(cfg, jax.devices()[:2])
