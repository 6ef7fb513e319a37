"""DPO (train.objective=dpo, issue 49) on a synthetic preference set built here: preference rows train only
their answers' tokens; on one device the margin, the accuracy and the chosen answers' likelihood against the
rejected ones rise; the loss equals a direct computation from the two models' log-probabilities; fsdp gives
one device's curve (fsdp x tensor), and so does a reference computed once; LoRA's reference is the weights under
the adapters; what does not combine is one line; a mixture of experts' load-balancing loss is trained and logged."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import ROOT, overrides
from shard import config
from shard.nn import recorded
from shard.data import formats, preferences, tokenizer as tokenizer_lib
from shard.errors import UserError
from shard.objectives import dpo
from shard.run import trainer

# Each prompt's preferred answer names its number; the rejected one says something else.
ROWS = [{"prompt": f"n{i % 10}:", "chosen": f" {i % 10}{i % 10}", "rejected": " no"} for i in range(48)]
BASE = ["model.name=gpt", "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=8",
        "model.d_ff=64", "model.max_len=16", "data.name=documents", "data.seq_len=8", "data.batch_size=16",
        "data.prompt_field=prompt", "data.chosen_field=chosen", "data.rejected_field=rejected",
        "train.objective=dpo", "train.dpo.beta=0.5", "optimizer.lr=1e-2", "run.log_every=1", "train.steps=12"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root


def run(corpus, folder, *extra):
    return trainer.run(config.load(None, overrides(folder, *BASE, f"data.path={corpus / 'pairs.jsonl'}", *extra)))


@pytest.fixture(scope="module")
def one(corpus, tmp_path_factory):
    return run(corpus, tmp_path_factory.mktemp("one"), "run.cpu_devices=1")


def direct_loss(params, rest, graphdef, batch, beta, ref_params=None, kind="sigmoid") -> float:
    """DPO's loss from each row's log-probabilities, the softmax in float64 numpy: sigmoid, or IPO's square
    (each answer's log-probabilities averaged over its tokens); reference none: each answer's mean
    log-probability, SimPO's margin with gamma 0."""
    averaged = ref_params is None or kind == "ipo"

    def logps(p, inputs, targets, mask):
        logits = np.asarray(nnx.merge(graphdef, p, rest)(inputs), np.float64)
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0] - logz
        return (picked * mask).sum(-1) / (mask.sum(-1) if averaged else 1.0)

    sides = [(batch["inputs"], batch["targets"], batch["chosen_mask"]),
             (batch["rejected_inputs"], batch["rejected_targets"], batch["rejected_mask"])]
    pol = [logps(params, *s) for s in sides]
    ref = [logps(ref_params, *s) for s in sides] if ref_params is not None else [0.0, 0.0]
    h = (pol[0] - ref[0]) - (pol[1] - ref[1])
    if kind == "ipo":
        return float(np.mean((h - 1 / (2 * beta)) ** 2))
    return float(np.mean(np.log1p(np.exp(-beta * h))))


def test_preference_rows_train_only_the_answers(corpus, capsys):
    tok = tokenizer_lib.load("bytes")
    chat = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}],
            "rejected": "no"}
    (corpus / "chat.jsonl").write_text(json.dumps(chat) + "\n" + json.dumps({**ROWS[1], "chosen": ""}) + "\n")
    pairs = preferences.read([corpus / "pairs.jsonl"], ("prompt", "chosen", "rejected"), tok, 8)
    got = pairs.read_batch(np.array([3]))
    trained = lambda side, mask: bytes(got[side][0][got[mask][0] > 0].astype(np.uint8)).decode()
    assert trained("targets", "chosen_mask") == " 33\n" and trained("rejected_targets", "rejected_mask") == " no\n"
    assert bytes(got["inputs"][0][:4].astype(np.uint8)) == b"n3: "
    chats = preferences.read([corpus / "chat.jsonl"], ("prompt", "chosen", "rejected"), tok, 32)
    assert "1 preference pair(s) dropped" in capsys.readouterr().err  # the empty chosen answer
    got = chats.read_batch(np.array([0]))
    # the plain template's turn ends in a newline, and the separator after it is trained (as fine-tuning's)
    assert trained("targets", "chosen_mask") == "yo\n\n" and trained("rejected_targets", "rejected_mask") == "no\n\n"


def test_margin_accuracy_and_chosen_likelihood_rise(one):
    h = one.history
    first, last = h[:3], h[-3:]
    mean = lambda rows, k: np.mean([r[k] for r in rows])
    assert h[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-6)  # the model is its reference at step 1
    assert mean(last, "dpo/margin") > mean(first, "dpo/margin") + 0.5
    assert mean(last, "dpo/accuracy") > 0.9 > mean(first, "dpo/accuracy")
    gap = lambda rows: mean(rows, "dpo/chosen_logp") - mean(rows, "dpo/rejected_logp")
    assert gap(last) > gap(first) + 1.0
    assert one.eval["eval_dpo/accuracy"] > 0.9


def test_the_loss_is_dpo_of_the_two_models_log_probabilities(one, corpus):
    """The trained model against its reference (the frozen copy kept in the state) on some pairs; and IPO's."""
    state = jax.device_get(one.state)
    cfg = config.load(None, overrides(corpus / "x", *BASE, f"data.path={corpus / 'pairs.jsonl'}"))
    batch = preferences.splits(cfg.data)[0].read_batch(np.arange(4))
    objective = dpo.build(cfg)
    model = nnx.merge(one.graphdef, state.params, state.rest)
    reference = nnx.merge(one.graphdef, state.extra["reference"], state.rest)
    got, _ = objective.loss(model, batch, reference)
    want = direct_loss(state.params, state.rest, one.graphdef, batch, 0.5, state.extra["reference"])
    assert float(got) == pytest.approx(want, abs=1e-6) and 0 < want < np.log(2.0) - 0.1  # the two models differ
    got, _ = dpo.DPO(0.5, "ipo", "init").loss(model, batch, reference)
    want = direct_loss(state.params, state.rest, one.graphdef, batch, 0.5, state.extra["reference"], "ipo")
    # IPO's square of a margin of summed float32 log-likelihoods: a few float32 ulps of its ~4 (1e-6 missed by 1.5e-6)
    assert float(got) == pytest.approx(want, rel=1e-5) and want != pytest.approx(1.0, abs=0.01)  # not (0 - 1)^2


@functools.cache
def tiny_moe(weight: float):
    """(graphdef, params, rest) of a tiny mixture of experts (the same weights whatever its load-balancing `weight`),
    built once: merge it with copy=True (a forward pass writes the variables it records)."""
    from shard.models.moe import MoE

    with nnx.use_eager_sharding(False):
        model = MoE(vocab_size=256, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=16, n_experts=4, top_k=2,
                    aux_loss_weight=weight, rngs=nnx.Rngs(0))
    return nnx.split(model, nnx.Param, ...)


def moe_step(goal, batch: dict, weight: float):
    """One train step (SGD, rate 1) of the objective `goal` on `batch`, from tiny_moe(weight), the reference (where
    the goal keeps one) its starting weights: (the step's metrics, the gradients)."""
    from shard.core import step
    from shard.core.state import TrainState

    graphdef, params, rest = tiny_moe(weight)
    tx = optax.sgd(1.0)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest, opt_state=tx.init(params),
                       extra={"reference": params})
    train = step.make_train_step(graphdef, tx, goal, jnp.float32,
                                 reference=(lambda s: s.extra["reference"]) if goal.reference else None)
    new, out = jax.jit(train)(state, batch)
    return jax.device_get(out), jax.tree.map(lambda a, b: np.asarray(a - b), params, new.params)


def balancing_loss(weight: float, rows):
    """The starting model's load-balancing loss on `rows` (one forward of the model alone), and its gradient."""
    graphdef, params, rest = tiny_moe(weight)

    def aux(p):
        model = nnx.merge(graphdef, p, rest, copy=True)
        model(jnp.asarray(rows))
        return recorded.collect(model)[0]

    value, grads = jax.value_and_grad(aux)(params)
    return float(value), jax.tree.map(np.asarray, grads)


def assert_balancing_trained(goal, batch: dict, rows):
    """The step's `aux_loss` is the model's load-balancing loss over `rows` (the policy's forward rows), and the
    gradient of the step's loss less that of the same step without it is the balancing loss's own gradient."""
    weighted, plain = moe_step(goal, batch, 0.5), moe_step(goal, batch, 0.0)
    want, want_grads = balancing_loss(0.5, rows)
    assert 0.5 < want < 0.5 * 4  # weight x (1 when balanced ... n_experts when collapsed)
    assert float(weighted[0]["aux_loss"]) == pytest.approx(want, rel=1e-5)
    assert float(plain[0]["aux_loss"]) == 0.0 and float(weighted[0]["loss"]) == pytest.approx(float(plain[0]["loss"]))
    router = want_grads["blocks"]["ffn"]["router"][...]
    assert np.abs(router).max() > 1e-3  # the balancing term moves the router
    for got, bare, grad in zip(jax.tree.leaves(weighted[1]), jax.tree.leaves(plain[1]), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got - bare, grad, rtol=1e-3, atol=1e-6)


def test_a_mixture_of_experts_balancing_loss_is_trained_and_logged(corpus):
    """As TRL adds router_aux_loss_coef x aux_loss: the balancing loss of the policy's one forward pass over both
    answers (at step 1 the reference is the same model: its own would double it; the rejected rows alone differ)."""
    cfg = config.load(None, overrides(corpus / "x", *BASE, f"data.path={corpus / 'pairs.jsonl'}"))
    batch = preferences.splits(cfg.data)[0].read_batch(np.arange(4))
    rows = np.concatenate([batch["inputs"], batch["rejected_inputs"]])  # TRL's concatenated forward
    assert_balancing_trained(dpo.build(cfg), batch, rows)


def test_precomputed_reference_gives_the_copys_curve(one, corpus, tmp_path):
    """train.dpo.precompute=true: no copy in the state, the starting weights' log-likelihoods computed once."""
    got = run(corpus, tmp_path, "run.cpu_devices=1", "train.dpo.precompute=true")
    assert "reference" not in (jax.device_get(got.state).extra or {}) and (tmp_path / "dpo_reference.npz").is_file()
    np.testing.assert_allclose([r["loss"] for r in got.history], [r["loss"] for r in one.history], rtol=1e-6)
    assert got.eval["eval_dpo/margin"] == pytest.approx(one.eval["eval_dpo/margin"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_fsdp_and_tensor_parallelism_give_one_devices_curve(one, corpus, tmp_path):
    many = run(corpus, tmp_path, "mesh=fsdp_tp", "mesh.fsdp=2", "mesh.tensor=2", "run.cpu_devices=4")
    np.testing.assert_allclose([r["loss"] for r in many.history], [r["loss"] for r in one.history], rtol=2e-5)
    np.testing.assert_allclose([r["dpo/margin"] for r in many.history], [r["dpo/margin"] for r in one.history],
                               rtol=1e-4, atol=1e-6)


def test_lora_without_a_reference(corpus, tmp_path):
    """LoRA keeps no copy (the reference is the weights under the adapters); reference-free, the loss at step 1
    is SimPO's from the starting model's log-probabilities (the adapters start at zero)."""
    got = run(corpus, tmp_path, "run.cpu_devices=1", "train.lora.rank=4", "train.dpo.reference=none", "train.steps=1")
    state = jax.device_get(got.state)
    assert "reference" not in (state.extra or {})
    cfg = config.load(None, overrides(tmp_path / "x", *BASE, f"data.path={corpus / 'pairs.jsonl'}"))
    first = dpo.build(cfg).data(cfg, cfg.train.seed, None).train[0]
    want = direct_loss(state.params, state.rest, got.graphdef, first, 0.5)
    assert got.history[0]["loss"] == pytest.approx(want, abs=1e-6)


def test_qlora_s_reference_is_its_quantized_base(corpus, tmp_path):
    """An nf4 base: the reference is the dequantized base, built in the stack like the trained model's (no copy);
    at step 1 the two are the same model (the adapters start at zero), so the loss is log 2, and the margin rises."""
    got = run(corpus, tmp_path, "run.cpu_devices=1", "train.lora.rank=4", "train.lora.targets=[q,k,v,o,mlp]",
              "train.lora.base=nf4", "optimizer.lr=3e-2")
    h = got.history
    assert h[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-6) and h[0]["dpo/margin"] == pytest.approx(0, abs=1e-6)
    assert np.mean([r["dpo/margin"] for r in h[-3:]]) > np.mean([r["dpo/margin"] for r in h[:3]]) + 0.2
    assert "reference" not in (jax.device_get(got.state).extra or {})


@pytest.mark.slow
def test_lora_on_two_processes_is_one_devices_curve_and_exports(corpus, tmp_path):
    """DPO under LoRA (the reference: the weights under the adapters) on 2 real processes of 2 devices, fsdp x tensor:
    one device's curve; the run is then a run like any other, its merged model exported to a Hugging Face folder
    that transformers loads with the run's logits."""
    import torch
    import transformers

    import shard
    from shard import export
    from test_multihost import launch

    llama = ["model.position=rope", "model.mlp=swiglu", "model.norm=rmsnorm", "train.steps=4", "train.lora.rank=4",
             "train.lora.targets=[q,k,v,o,mlp]", "checkpoint.enabled=true", "checkpoint.every=4"]
    one = run(corpus, tmp_path / "one", "run.cpu_devices=1", *llama)
    folder = tmp_path / "two"
    done = launch("local", "--processes=2", "--", *overrides(folder, *BASE, f"data.path={corpus / 'pairs.jsonl'}",
                                                            *llama), "mesh=fsdp_tp", "run.cpu_devices=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    many = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    many = [r for r in many if "dpo/margin" in r]
    np.testing.assert_allclose([r["loss"] for r in many], [r["loss"] for r in one.history], rtol=2e-5)
    np.testing.assert_allclose([r["dpo/margin"] for r in many], [r["dpo/margin"] for r in one.history], rtol=1e-4,
                               atol=1e-6)
    assert export.main([str(folder), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    tokens = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    ours = np.asarray(shard.load_model(str(folder))(tokens), np.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens).long()).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("extra, says", [
    (["mesh.stage=2", "run.cpu_devices=2", "pipeline.schedule=1f1b"], "train.objective=dpo with mesh.stage=2"),
    (["data.rejected_field=null"], "set data.rejected_field"),
    (["train.offload=optimizer"], "use train.offload=none"),
    (["train.dpo.precompute=true", "train.lora.rank=4"], "costs no memory; leave train.dpo.precompute=false"),
])
def test_refusals_are_one_line(corpus, tmp_path, extra, says):
    with pytest.raises(UserError, match=says):
        run(corpus, tmp_path, *extra)


def test_chat_pairs_train_only_the_answer_under_a_real_template(tmp_path):
    """A real chat template (Qwen2.5's, whose rendering tests/test_real_tokenizers.py holds to transformers'):
    only the answer's turn is trained, from where the prompt rendered with the generation prompt ends, not the
    assistant turn inside the prompt."""
    folder = ROOT.parent / "shared" / "fixtures" / "hf" / "qwen2.5-0.5b-instruct"
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent (a clone without ../shared): the real tokenizer files are not here")
    prompt = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"},
              {"role": "user", "content": "And 4 and 4?"}]
    row = {"q": prompt, "good": [{"role": "assistant", "content": "8"}], "bad": "9"}
    (tmp_path / "chat.jsonl").write_text(json.dumps(row) + "\n")
    tok = tokenizer_lib.load(str(folder))
    got = preferences.read([tmp_path / "chat.jsonl"], ("q", "good", "bad"), tok, 96).read_batch(np.array([0]))
    asked = formats.Formatter(("q",), tok).prompt_ids(prompt)
    for side, mask, answer in (("", "chosen_mask", "8"), ("rejected_", "rejected_mask", "9")):
        inputs, trained = got[side + "inputs"][0], np.flatnonzero(got[mask][0])  # target t is token t + 1
        assert list(inputs[:len(asked)]) == list(asked) and trained[0] + 1 == len(asked)
        assert tok.decode(got[side + "targets"][0][trained]).startswith(answer)
        assert "5" in tok.decode(inputs[:len(asked)])  # the prompt's own assistant turn, untrained
