"""Qwen3.5's text model against transformers': gated DeltaNet linear layers (models/deltanet.py) three to one full
layer with a gated output, scanned a period at a time. The chunked delta rule equals the rule token by token (a NumPy
loop here) on lengths no multiple of the chunk; a tiny random model's logits on one device and under fsdp and tp, its
greedy tokens with the recurrent state carried between calls, export and re-import; the real 9B config read as
transformers reads it; bad configs one line."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import shard  # noqa: E402
from shard import config  # noqa: E402
from shard.errors import UserError  # noqa: E402
from shard.hf import arch  # noqa: E402
from shard.models import deltanet  # noqa: E402
from shard.run import trainer  # noqa: E402
from shard.use import generate, load  # noqa: E402

from conftest import overrides  # noqa: E402
from test_hf import (FINE_TUNE, MESHES, TOKENS, VOCAB, adapters_merge_as_peft_merges,  # noqa: E402
                     assert_exports_bitwise, jax_logits, relative, saved_folders, torch_logits)

REAL = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf" / "qwen3.5-9b" / "config.json"
# the 9B's shape scaled down: key heads shared by two value heads each, partial rotary (a quarter of 16 channels)
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=None, eos_token_id=None)
# the MoE families' layers: four experts (two a token) beside a shared expert; Qwen3-Next's projections fused per key
# head, its router's weights not renormalised
EXPERTS = dict(SMALL, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
               shared_expert_intermediate_size=40)
KINDS = {"qwen3_5": lambda T: T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**SMALL)),
         "qwen3_5_moe": lambda T: T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**EXPERTS)),
         "qwen3_next": lambda T: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**EXPERTS, norm_topk_prob=False))}
EP = ["mesh=ep", "run.cpu_devices=4"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return saved_folders(KINDS, tmp_path_factory)


def delta_rule(q, k, v, beta, g, state):
    """The gated delta rule token by token, in NumPy: (batch, time, heads, ...) inputs."""
    out = np.zeros(v.shape, np.float64)
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[..., None, None]
        error = v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + np.einsum("bhk,bhv->bhkv", k[:, t], error * beta[:, t, :, None])
        out[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


@pytest.mark.parametrize("length", [21, 8, 3])
def test_the_chunked_delta_rule_equals_the_rule_token_by_token(length):
    """Chunks of 8 over 21 tokens (two whole chunks and a padded one), one whole chunk, a part of one; from a state
    that is not zero, as a long prompt's next chunk starts."""
    rng = np.random.default_rng(length)
    b, h, dk, dv = 2, 3, 8, 6
    q, k = (rng.normal(size=(b, length, h, dk)) / np.sqrt(dk) for _ in range(2))
    v = rng.normal(size=(b, length, h, dv))
    beta, g = 1 / (1 + np.exp(-rng.normal(size=(b, length, h)))), -np.abs(rng.normal(size=(b, length, h)))
    state = rng.normal(size=(b, h, dk, dv))
    want, want_state = delta_rule(q, k, v, beta, g, state)
    time_major = [jnp.asarray(np.moveaxis(x, 1, 0), jnp.float32) for x in (q, k, v, beta, g)]
    chunks = lambda *a: deltanet.chunked(*a, chunk=8)  # noqa: E731
    for form in (deltanet.recurrent, chunks):
        got_state, got = form(jnp.asarray(state, jnp.float32), *time_major)
        np.testing.assert_allclose(np.moveaxis(np.asarray(got), 0, 1), want, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(got_state), want_state, atol=2e-5, rtol=1e-4)
    if length != 21:
        return
    # training differentiates the chunks: their gradient is the token-by-token rule's
    weights = jnp.asarray(rng.normal(size=(length, b, h, dv)), jnp.float32)
    loss = lambda form: lambda *x: jnp.sum(form(jnp.asarray(state, jnp.float32), *x)[1] * weights)  # noqa: E731
    grad = lambda form: jax.jit(jax.grad(loss(form), argnums=(0, 1, 2, 3, 4)))(*time_major)  # noqa: E731
    for want, got in zip(grad(deltanet.recurrent), grad(chunks)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind, mesh", [("qwen3_5", "one"), ("qwen3_5_moe", "ep"), ("qwen3_next", "tp")])
def test_logits_equal_transformers(folders, kind, mesh):
    """(ep splits the experts over 4 devices and the rest over fsdp: the linear layers' weights too, by embed; tp
    their key heads)"""
    path, model = folders[kind]
    loaded = load.load(path, EP if mesh == "ep" else MESHES[mesh] or [], whole_mesh=mesh != "one")
    assert relative(jax_logits(loaded), torch_logits(model, TOKENS)) < 1e-5


def test_greedy_generate_carries_the_state_as_transformers(folders):
    """Twenty greedy tokens after a prompt of five: the linear layers' convolution windows and states carried from
    call to call (no per-position cache for them), the full layers' keys and values cached."""
    path, model = folders["qwen3_5"]
    prompt = TOKENS[:, :5]
    with torch.no_grad():
        want = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=20, pad_token_id=0).numpy()[:, 5:]
    got = generate.Generator(shard.load_model(path))(prompt, 20, generate.Sampling(temperature=0))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_export_and_reimport_are_bitwise(folders, kind, tmp_path):
    """(Qwen3-Next's router without renormalisation is written as qwen3_next, its projections fused again; with it,
    as qwen3_5_moe_text, whose table is Qwen3.5's linear layers and these experts)"""
    written = {"qwen3_5": "qwen3_5_text", "qwen3_next": "qwen3_next"}[kind]
    assert_exports_bitwise(*folders[kind], tmp_path / "out", written)


def test_the_real_9b_config_reads_as_transformers_reads_it():
    if not REAL.is_file():
        pytest.skip(f"{REAL} is absent (the shared fixtures hold it in CI)")
    config = json.loads(REAL.read_text())
    g = arch.to_gpt(config["text_config"], "test")
    text = transformers.Qwen3_5Config(**config).text_config
    assert [t == "deltanet" for t in g["layer_types"]] == [t == "linear_attention" for t in text.layer_types]
    assert g["deltanet"] == dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv=4)
    assert g["rotary_dim"] == 64 and g["rope_theta"] == 1e7 and g["attn_gate"] and g["norm"] == "rmsnorm+1"
    assert (g["n_layers"], g["n_heads"], g["n_kv_heads"], g["head_dim"]) == (32, 16, 4, 256)


def test_bad_qwen3_5_configs_are_one_line():
    good = dict(SMALL, model_type="qwen3_5_text")
    for change, said in ((dict(layer_types=["full_attention"] * 7), "layer_types"),
                         (dict(linear_num_value_heads=3), "linear_num_value_heads=3"),
                         (dict(hidden_act="gelu"), "hidden_act"),
                         (dict(attention_bias=True), "attention_bias"),
                         (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type")):
        with pytest.raises(UserError, match=said):
            arch.to_gpt({**good, **change}, "test")


def test_a_multimodal_qwen3_5_folder_loads_its_language_model(tmp_path_factory, capsys):
    """A Qwen3_5ForConditionalGeneration folder (as the Hub's Qwen3.5 ships): the language model under
    model.language_model., its output layer outside it, the vision tower skipped with one line; the text logits as
    transformers' whole model gives them."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    ids = dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
               vision_end_token_id=VOCAB - 4)
    config = transformers.Qwen3_5Config(text_config=dict(SMALL, num_hidden_layers=4), vision_config=vision, **ids)
    path, model = saved_folders({"mm": lambda T: T.Qwen3_5ForConditionalGeneration(config)}, tmp_path_factory)["mm"]
    loaded = load.load(path, [], whole_mesh=False)
    assert "a qwen3_5 folder: its language model is read, model.visual skipped" in capsys.readouterr().err
    tokens = TOKENS % (VOCAB - 8)  # text alone: no image or video token
    assert relative(jax_logits(loaded, tokens), torch_logits(model, tokens)) < 1e-5


def test_the_servers_cache_keeps_states_for_linear_layers_and_positions_for_full_ones(folders):
    """Per slot, each of the 6 linear layers its convolution's window (3 inputs of 2 x 16 query, 2 x 16 key and
    4 x 16 value channels) and its state (4 value heads x 16 x 16), float32, whatever the context; each of the 2 full
    layers 2 x 2 key/value heads x 16 wide x 4 bytes a position."""
    from shard.server import engine

    generator = generate.Generator(shard.load_model(folders["qwen3_5"][0]))
    linear = 3 * (32 + 32 + 64) * 4 + 4 * 16 * 16 * 4
    for context in (16, 32):
        want = 2 * (6 * linear + context * 2 * 2 * 2 * 16 * 4)
        assert engine.Engine(generator, 2, context, VOCAB).cache_bytes() == want


def test_lora_adapters_are_peft_weights_of_our_merged_model(folders, tmp_path):
    """Random adapters on the full layers' attention, every MLP, and the linear layers' projections (`linear`: three
    of ours side by side in in_proj_qkv), each place of the scanned period its own Hugging Face layers: peft merges
    them into the weights of our merged model."""
    adapters_merge_as_peft_merges(folders["qwen3_5"][0], "gpt", [["q", "v"], ["k", "o", "mlp"], ["linear"]], tmp_path)


def test_fine_tuning_under_fsdp_with_accumulation_gives_the_one_device_curve(folders, train):
    """Qwen3.5-MoE's four layers (a period: three DeltaNet layers and a gated full one, experts in each) fine-tuned
    from the folder three steps: under fsdp on two devices with two microbatches, the losses of one device."""
    base = [f"train.init_from={folders['qwen3_5'][0]}", *FINE_TUNE, "train.steps=3", "optimizer.lr=1e-2"]
    one = train(*base, "run.cpu_devices=1", subdir="one")
    many = train(*base, "mesh=fsdp", "run.cpu_devices=2", "train.grad_accum=2", subdir="many")
    losses = [r["loss"] for r in one.history]
    assert losses[-1] < losses[0]
    np.testing.assert_allclose([r["loss"] for r in many.history], losses, rtol=1e-5)


def test_context_parallelism_is_refused_in_one_line(folders, tmp_path):
    """The linear layers' state runs along the whole sequence, which mesh.context would split."""
    with pytest.raises(UserError) as e:
        trainer.run(config.load(None, overrides(tmp_path / "cp", f"train.init_from={folders['qwen3_5'][0]}",
                                                "mesh=cp", "run.cpu_devices=2", *FINE_TUNE)))
    assert "gated DeltaNet" in str(e.value) and "\n" not in str(e.value)


def test_packed_documents_restart_the_linear_layers_state():
    """Two documents packed in one row (data.packing=documents) give each one's logits alone: the linear layers run
    token by token there, their convolution window and state restarting at each document's first token."""
    from flax import nnx

    from shard.models.gpt import GPT
    from shard.nn import hooks

    with nnx.use_eager_sharding(False):
        model = GPT(vocab_size=50, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, position="rope",
                    norm="rmsnorm+1", mlp="swiglu", qk_norm="head", attn_gate=True,
                    layer_types=["deltanet"] * 3 + ["attention"], rngs=nnx.Rngs(0),
                    deltanet=dict(key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv=4))
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 50, 7), rng.integers(0, 50, 9)
    # one call: the two packed, then each alone at the start of its own row (padding, segment 0, after it)
    rows = np.stack([np.concatenate([a, b]), np.pad(a, (0, 9)), np.pad(b, (0, 7))])
    segments = np.asarray([[1] * 7 + [2] * 9, [1] * 7 + [0] * 9, [1] * 9 + [0] * 7])
    places = np.asarray([list(range(7)) + list(range(9)), list(range(16)), list(range(16))])
    graphdef, state = nnx.split(model)
    with hooks.packed(jnp.asarray(segments), jnp.asarray(places)):
        out = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(rows)))
    packed, alone = out[0], np.concatenate([out[1, :7], out[2, :9]])
    assert relative(packed, alone) < 1e-5
