"""Using a trained language model: shard.load_model restores it (on one device or into a mesh), and cached
decoding (python -m shard.generate, the end-of-run sample) gives exactly the greedy tokens of re-running
the model on the whole sequence, under one device and tensor parallelism."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shard
from conftest import ROOT, TINY_GPT, TINY_MODELS, overrides, subprocess_env
from shard import config
from shard.use import generate, load
from shard.core import registry
from shard.run import trainer
from shard.core import state as state_lib
from shard.errors import UserError

GREEDY = generate.Sampling(temperature=0, vocab=generate.BYTES)
TRAIN = ["train.steps=20", "run.cpu_devices=1", "checkpoint.enabled=true", "optimizer.lr=1e-2"]
MODELS = {
    "gpt": TINY_GPT,
    "gpt_rope": [*TINY_GPT, "model.position=rope", "model.n_kv_heads=4"],
    # dropless routing (every expert has room for every token): the cache routes one token at a time
    "moe": [*TINY_MODELS["moe"], "model.capacity_factor=4.0", "model.max_len=32", "data.seq_len=32"],
    "lstm": TINY_MODELS["lstm"],
}
PROMPT = np.array([generate.text_tokens("def f(x):\n    return")] * 2)  # 2 rows: a batch the tensor mesh copies


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}

    def get(name):
        if name not in out:
            folder = tmp_path_factory.mktemp(name)
            trainer.run(config.load(None, overrides(folder, *MODELS[name], *TRAIN)))
            out[name] = folder
        return out[name]

    return get


def untrained(loaded: load.Loaded) -> nnx.Module:
    """The run's model freshly initialised: its greedy tokens vary (a few steps of training teach mostly spaces)."""
    return state_lib.build_model(*registry.load(loaded.cfg.model), seed=1)


def edited_copy(folder, other, old: str, new: str):
    """A run folder `other` sharing `folder`'s checkpoints, its config.yaml with `old` replaced by `new` once."""
    text = (folder / "config.yaml").read_text()
    assert old in text
    other.mkdir()
    (other / "config.yaml").write_text(text.replace(old, new, 1))
    (other / "checkpoints").symlink_to(folder / "checkpoints")
    return other


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_greedy_decoding_equals_recomputing_the_whole_sequence(runs, name):
    one = load.load(runs(name), [], whole_mesh=False)
    fresh = untrained(one)
    for model in (one.model, fresh):
        want = generate.recompute(model, PROMPT, 12, vocab=generate.BYTES)
        np.testing.assert_array_equal(generate.Generator(model)(PROMPT, 12, GREEDY), want)
    assert len(set(want[0].tolist())) > 2
    if name in ("gpt", "moe"):
        tp = load.load(runs(name), ["mesh=tp", "run.cpu_devices=4"])
        assert "tensor" in str(tp.model.blocks.attn.q.get_value().sharding.spec)  # restored split, not gathered
        layout = jax.tree.map(lambda a: a.sharding, nnx.state(tp.model))
        nnx.update(tp.model, jax.device_put(nnx.state(fresh), layout))
        np.testing.assert_array_equal(generate.Generator(tp.model, tp.mesh, tp.rules)(PROMPT, 12, GREEDY), want)


def test_past_the_context_the_window_slides(runs):
    loaded = load.load(runs("gpt"), [], whole_mesh=False)
    context, prompt = loaded.model.max_len, PROMPT[:1]
    tokens = generate.Generator(loaded.model)(prompt, 2 * context, GREEDY)
    assert tokens.shape == (1, 2 * context)
    fits = context - prompt.shape[1] + 1  # the tokens generated before the cache is full
    np.testing.assert_array_equal(tokens[:, :fits], generate.recompute(loaded.model, prompt, fits, generate.BYTES))
    with pytest.raises(UserError, match="the prompt is 40 tokens but the model's context is 32"):
        generate.Generator(loaded.model)(np.zeros((1, 40), np.int32), 4, GREEDY)


def test_a_model_attending_outside_the_hooks_generates_by_re_running_it():
    from stock_models import StockTransformer

    model = StockTransformer(vocab=256, d=32, heads=4, layers=2, max_len=32, rngs=nnx.Rngs(0))
    seq = PROMPT[:1]
    for _ in range(6):  # the plain loop: the whole sequence each time, nothing padded
        seq = np.concatenate([seq, np.argmax(np.asarray(model(seq))[:, -1, :256], axis=-1)[:, None]], axis=1)
    got = generate.Generator(model, window=32)(PROMPT[:1], 6, GREEDY)
    np.testing.assert_array_equal(got, seq[:, PROMPT.shape[1]:])
    assert len(set(got[0].tolist())) > 1


def test_sampling_follows_its_settings(runs):
    generator = generate.Generator(load.load(runs("gpt"), [], whole_mesh=False).model)
    greedy = generator(PROMPT, 10, GREEDY)
    np.testing.assert_array_equal(generator(PROMPT, 10, generate.Sampling(1.0, top_k=1, vocab=256), seed=3), greedy)
    np.testing.assert_array_equal(generator(PROMPT, 10, generate.Sampling(1.0, top_p=1e-6, vocab=256), seed=3), greedy)
    hot = generate.Sampling(2.0, vocab=256)
    a, b = generator(PROMPT, 10, hot, seed=1), generator(PROMPT, 10, hot, seed=2)
    np.testing.assert_array_equal(a, generator(PROMPT, 10, hot, seed=1))
    assert (a != b).any() and (a < 256).all()


def test_load_model_from_python_and_its_errors(runs, tmp_path):
    folder = runs("gpt")
    model = shard.load_model(str(folder))
    assert model(np.zeros((1, 8), np.int32)).shape == (1, 8, 256)
    steps = sorted(int(p.name) for p in (folder / "checkpoints").iterdir() if p.name.isdigit())
    by_step = shard.load_model(str(folder / "checkpoints" / str(steps[-1])))
    np.testing.assert_array_equal(by_step.tok.get_value(), model.tok.get_value())
    with pytest.raises(UserError, match="has no step 12345"):
        shard.load_model(str(folder), step=12345)
    with pytest.raises(UserError, match="does not exist"):
        shard.load_model(str(tmp_path / "nothing"))
    other = edited_copy(folder, tmp_path / "other", "d_model: 32", "d_model: 64")
    with pytest.raises(UserError, match="has shape .* but this model's is"):
        shard.load_model(str(other))


def generate_cli(*args):
    return subprocess.run([sys.executable, "-m", "shard.generate", *map(str, args)], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)


def test_the_command_line_generates_and_refuses_bad_input_in_one_line(runs, tmp_path):
    folder = runs("gpt")
    proc = generate_cli(folder, "--prompt", "def f(x):\n    return", "--max-new-tokens", 12, "--temperature", 0,
                        "--batch", 2, "mesh=tp", "run.cpu_devices=2")
    assert proc.returncode == 0, proc.stderr
    want = generate.token_text(generate.recompute(load.load(folder, [], whole_mesh=False).model, PROMPT[:1],
                                                  12, 256)[0])
    assert proc.stdout.count("def f(x):\n    return" + want) == 2, (proc.stdout, want)
    (tmp_path / "long.txt").write_text("x" * 100)
    for args, message in ((["--prompt-file", tmp_path / "long.txt"],
                           "the prompt is 100 tokens but the model's context is 32"),
                          (["--top-p", 2], r"--top-p 2.0: must be in \(0, 1\]"),
                          (["--bogus"], "unrecognized arguments: --bogus"),
                          (["mesh.tensor=3", "run.cpu_devices=2"], "tensor=3: the fixed axes multiply to 3"),
                          (["--step", 999], "has no step 999")):
        with pytest.raises(UserError, match=message):  # python -m shard.generate prints it as one line, exit 2
            generate.main([str(folder), *map(str, args)])
    (tmp_path / "prompts.txt").write_text("def f(x):\nimport os\n")
    proc = generate_cli(folder, "--prompt-lines", tmp_path / "prompts.txt", "--max-new-tokens", 6, "--temperature", 0)
    assert proc.returncode == 0, proc.stderr
    model = load.load(folder, [], whole_mesh=False).model
    for i, text in enumerate(["def f(x):", "import os"]):
        want = generate.token_text(generate.recompute(model, np.array([generate.text_tokens(text)]), 6, 256)[0])
        assert f"--- {i}\n{text}{want}\n" in proc.stdout, (proc.stdout, want)
    proc = generate_cli(tmp_path / "nothing")
    assert proc.returncode == 2 and proc.stderr == f"error: RUN='{tmp_path / 'nothing'}' does not exist\n"


def test_the_speed_bench_checks_its_tokens_and_reports_both_rates():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "generate.py"), *TINY_GPT[1:7], "--new-tokens", "16",
                           "--prompt-len", "8", "--batch", "2"], env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["new_tokens"] == 16 and figures["cache_tokens_per_s"] > 0 and figures["recompute_tokens_per_s"] > 0


def test_a_run_folder_from_elsewhere_runs_no_code_unless_trusted(runs, tmp_path, monkeypatch):
    """A config.yaml naming a module outside the model library must not import it (importing runs its code)."""
    other = edited_copy(runs("gpt"), tmp_path / "downloaded", "  name: gpt\n", "  name: planted:GPT\n")
    marker = tmp_path / "imported"
    (tmp_path / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\nfrom shard.models.gpt import GPT\n")
    monkeypatch.chdir(tmp_path)
    path = list(__import__("sys").path)
    with pytest.raises(UserError, match="names model 'planted:GPT', a module outside the model library.*trust_code"):
        shard.load_model(str(other))
    assert not marker.exists()
    proc = generate_cli(other, "--max-new-tokens", 2)
    assert proc.returncode == 2 and "--trust-code" in proc.stderr and not marker.exists()
    model = shard.load_model(str(other), trust_code=True)  # the caller's explicit choice
    assert marker.exists() and model(np.zeros((1, 8), np.int32)).shape == (1, 8, 256)
    assert __import__("sys").path == path  # the working directory was not left on sys.path


def test_a_run_folder_from_before_the_library_moved_under_shard_still_loads(runs, tmp_path):
    """Its config.yaml may name the library's class by its old top-level path: still the library's, no trust needed."""
    from shard.models.gpt import GPT

    other = edited_copy(runs("gpt"), tmp_path / "old", "  name: gpt\n", "  name: models.gpt:GPT\n")
    model = shard.load_model(str(other))
    assert type(model) is GPT and model(np.zeros((1, 8), np.int32)).shape == (1, 8, 256)


def test_a_loaded_model_keeps_the_rules_it_was_trained_with(runs, tmp_path):
    other = edited_copy(runs("gpt"), tmp_path / "ruled", "  rules: {}\n",
                        "  rules: {my_features: tensor, heads: null}\n")
    loaded = load.load(str(other), ["mesh=tp"], whole_mesh=False)
    assert (loaded.rules["my_features"], loaded.rules["heads"]) == ("tensor", None)  # the run's rules come along
    loaded = load.load(str(other), ["mesh=tp", "mesh.rules.heads=tensor"], whole_mesh=False)
    assert loaded.rules["heads"] == "tensor"  # the loader's own rules win


PROMPTS = [generate.text_tokens(t) for t in ("def f(x):", "import os\n", "x", "class A:\n    pass")]


@pytest.mark.parametrize("name", ["gpt", "gpt_rope", "lstm"])
def test_a_batch_of_prompts_of_different_lengths_gives_each_row_its_solo_tokens(runs, name):
    """Left-padded to the longest, masked, each row's positions from 0 at its first token (an LSTM's carry
    passes over the padding unchanged): one batch, each row as its prompt alone, under one device and tp."""
    loaded = load.load(runs(name), [], whole_mesh=False)
    fresh = untrained(loaded)
    generator = generate.Generator(fresh)
    solo = np.stack([generator(np.array([p]), 10, GREEDY)[0] for p in PROMPTS])
    assert len({tuple(row) for row in solo.tolist()}) == len(PROMPTS)  # the rows differ: a mix-up would show
    np.testing.assert_array_equal(generator(PROMPTS, 10, GREEDY), solo)
    if name != "lstm":
        tp = load.load(runs(name), ["mesh=tp", "run.cpu_devices=4"])
        nnx.update(tp.model, jax.device_put(nnx.state(fresh), jax.tree.map(lambda a: a.sharding, nnx.state(tp.model))))
        np.testing.assert_array_equal(generate.Generator(tp.model, tp.mesh, tp.rules)(PROMPTS, 10, GREEDY), solo)


def test_prompts_of_different_lengths_and_an_end_token(runs):
    loaded = load.load(runs("gpt"), [], whole_mesh=False)
    generator = generate.Generator(untrained(loaded))
    prompts = [generate.text_tokens("def f(x):"), generate.text_tokens("import os\n"), generate.text_tokens("x")]
    solo = [generator(np.array([p]), 10, GREEDY)[0] for p in prompts]
    eos = int(solo[0][3])  # a token the first row makes at its fourth step
    ended = generator(prompts, 10, GREEDY, eos=eos, pad=-1)
    for row, want in zip(ended, solo):
        cut = list(want).index(eos) + 1 if eos in want else len(want)
        assert list(row[:cut]) == list(want[:cut]) and (row[cut:] == -1).all()
    assert (generate.Generator(untrained(loaded))(np.array([prompts[0]]), 10, GREEDY, eos=eos)[0][4:].tolist()
            == [eos] * 6)
    # several end tokens (a generation_config.json list): each row ends at the first of any of them
    ends = {eos, int(solo[1][2])}
    ended = generator(prompts, 10, GREEDY, eos=ends)
    for row, want in zip(ended, solo):
        cut = next((i + 1 for i, t in enumerate(want) if t in ends), len(want))
        assert list(row[:cut]) == list(want[:cut]) and (row[cut:] == want[cut - 1]).all()
    assert generate.until_eos(solo[1], ends).tolist() == list(
        solo[1][:next(i for i, t in enumerate(solo[1]) if t in ends)])


def test_top_k_and_top_p_keep_the_set_their_definitions_name():
    """On a known distribution: top-k keeps exactly the k likeliest tokens, top-p the smallest set of the
    likeliest whose mass reaches p, each drawn in proportion to its probability within the kept set."""
    probs = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))[None].repeat(4000, axis=0)
    for sampling, kept in ((generate.Sampling(1.0, top_k=3), 3), (generate.Sampling(1.0, top_p=0.75), 3),
                           (generate.Sampling(1.0, top_p=0.8), 4), (generate.Sampling(1.0, top_k=5, top_p=0.99), 5)):
        tokens = np.asarray(sampling.pick(logits, jax.random.key(0)))
        assert set(tokens.tolist()) == set(range(kept)), (sampling, set(tokens.tolist()))
        want = probs[:kept] / probs[:kept].sum()
        np.testing.assert_allclose(np.bincount(tokens, minlength=kept)[:kept] / len(tokens), want, atol=0.03)


def test_the_end_of_run_sample_of_a_padded_vocabulary_picks_among_the_tokenizers_tokens(tmp_path, capsys):
    result = trainer.run(config.load(None, overrides(tmp_path, *TINY_GPT, "model.vocab_size=264", "train.steps=1",
                                                     "train.sample_len=8", "run.cpu_devices=1")))
    assert result.sample and "sample:" in capsys.readouterr().out  # 8 of the 256 byte tokens, as text


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_left_padded_batch_equals_transformers_generate_with_its_attention_mask(tmp_path, kind):
    """Prompts of different lengths, left-padded with a mask on both sides: our greedy tokens (one device and
    tp) are transformers' `generate(do_sample=False)`, row for row."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
    else:
        reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2,
                                                                         n_head=4, n_positions=64))
    reference = reference.float().eval()
    with torch.no_grad():
        for p in reference.parameters():  # off their initial values: a mix-up of any weight shows
            p.add_(0.05 * torch.randn_like(p))
    reference.generation_config.eos_token_id = None  # greedy runs its full length, as ours
    reference.save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 300, n).tolist() for n in (3, 9, 5, 1)]
    width = max(map(len, prompts))
    ids, mask = np.zeros((len(prompts), width), np.int64), np.zeros((len(prompts), width), np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    with torch.no_grad():
        want = reference.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                                  max_new_tokens=10, pad_token_id=0).numpy()[:, width:]
    assert len({tuple(row) for row in want.tolist()}) == len(prompts)
    greedy = generate.Sampling(temperature=0)
    np.testing.assert_array_equal(generate.Generator(shard.load_model(str(tmp_path)))(prompts, 10, greedy), want)
    tp = load.load(str(tmp_path), ["mesh=tp", "run.cpu_devices=2"])
    np.testing.assert_array_equal(generate.Generator(tp.model, tp.mesh, tp.rules)(prompts, 10, greedy), want)


def test_sliding_windows_decode_as_recomputing_with_a_window_sized_cache():
    """A sliding layer keeps `window` slots, slot s at s mod window, a global one every position: a stack mixing
    two windows and a global layer keeps one cache per kind (every layer alike: test_hf.py's Mistral). Left-padded
    prompts of different lengths generate past the windows, each row as recomputing its own sequence does."""
    from shard.models.gpt import GPT

    model = state_lib.build_model(GPT, dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                            max_len=24, position="rope", norm="rmsnorm", mlp="swiglu",
                                            windows=[6, 0, 4]), 0)
    prompts = [list(range(1, 11)), [11, 12, 13]]
    g = generate.Generator(model)
    got = g(prompts, 12, generate.Sampling(temperature=0))
    for prompt, row in zip(prompts, got):
        np.testing.assert_array_equal(row, generate.recompute(model, np.array([prompt]), 12)[0])
    cache = jax.eval_shape(lambda: g.forward(g.state, jnp.zeros((1, 10), jnp.int32), jnp.zeros(1, jnp.int32),
                                             jnp.zeros(1, jnp.int32), None, 22)[1])
    # (layers of the kind, batch, slots, heads, dim): the windows, and the 22 positions for the global layer
    assert {kind: c["k"].shape for kind, c in cache[0][0].caches.items()} == {
        0: (1, 1, 22, 2, 8), 4: (1, 1, 4, 2, 8), 6: (1, 1, 6, 2, 8)}
