"""Gemma 4's text model against transformers': a tiny model shaped as gemma-4-E2B-it's real config (sliding layers
with a window shorter than the tokens, wider global layers with proportional RoPE, the last layers reusing earlier
layers' keys and values with double-wide MLPs, per-layer embeddings) and one with attention_k_eq_v's global layers
(values from the keys, their own key/value heads): logits on every mesh, greedy generation past the window, export
and re-import, a multimodal gemma4 folder's text model; the real config read as transformers reads it."""

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import shard  # noqa: E402
from shard import config  # noqa: E402
from shard.errors import UserError  # noqa: E402
from shard.hf import arch  # noqa: E402
from shard.run import trainer  # noqa: E402
from shard.use import export, generate, load  # noqa: E402

from conftest import overrides  # noqa: E402
from test_hf import (FINE_TUNE, MESHES, TOKENS, VOCAB, assert_exports_bitwise,  # noqa: E402
                     assert_greedy_as_transformers, first_loss, jax_logits, relative, saved_folders, torch_logits)

REAL = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf" / "gemma-4-E2B-it" / "config.json"
SMALL = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, intermediate_size=48,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=6,
             hidden_size_per_layer_input=8, max_position_embeddings=64, final_logit_softcapping=3.0,
             pad_token_id=0, bos_token_id=None, eos_token_id=None)
# E2B's shape: four sliding layers to a full one, the last layers sharing (here 3 of 6: two sliding, one full)
E2B = dict(SMALL, num_hidden_layers=6, num_kv_shared_layers=3, use_double_wide_mlp=True,
           layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
           rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 10000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
# the larger models' global layers: values from the keys' projection, key/value heads of their own; no PLE
K_EQ_V = dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, attention_k_eq_v=True, num_global_key_value_heads=4,
              hidden_size_per_layer_input=0, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
# the 26B-A4B's MoE block: a dense MLP beside four experts (two a token), each with its norms, in every layer
MOE = dict(K_EQ_V, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)
KINDS = {"e2b": lambda T: T.Gemma4ForCausalLM(T.Gemma4TextConfig(**E2B)),
         "k_eq_v": lambda T: T.Gemma4ForCausalLM(T.Gemma4TextConfig(**K_EQ_V)),
         "moe": lambda T: T.Gemma4ForCausalLM(T.Gemma4TextConfig(**MOE))}
EP = ["mesh=ep", "run.cpu_devices=4"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = saved_folders(KINDS, tmp_path_factory)
    with torch.no_grad():  # the layer scalars are buffers: moved off 1 too, so that one read wrong shows
        for _, model in out.values():
            for layer in model.model.layers:
                layer.layer_scalar.mul_(1.5 + torch.rand(1))
    for path, model in out.values():
        model.save_pretrained(path)
    return out


@pytest.mark.parametrize("kind, mesh", [("e2b", "one"), ("e2b", "fsdp"), ("k_eq_v", "one"), ("k_eq_v", "tp"),
                                        ("k_eq_v", "fsdp_tp"), ("moe", "one"), ("moe", "ep")])
def test_logits_equal_transformers(folders, kind, mesh):
    """(E2B's single key/value head does not split over tensor: refused in one line, tests/test_hf_gemma4.py's
    last test)"""
    path, model = folders[kind]
    loaded = load.load(path, EP if mesh == "ep" else MESHES[mesh] or [], whole_mesh=mesh != "one")
    assert relative(jax_logits(loaded), torch_logits(model, TOKENS)) < 1e-5


@pytest.mark.parametrize("kind", ["k_eq_v", "moe"])  # (E2B's: its server slots' test below, against transformers too)
def test_greedy_generate_equals_transformers_past_the_window(folders, kind):
    assert_greedy_as_transformers(*folders[kind])


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_and_reimport_are_bitwise(folders, kind, tmp_path):
    assert_exports_bitwise(*folders[kind], tmp_path / "out", "gemma4_text")


def test_the_real_e2b_config_reads_as_transformers_reads_it():
    if not REAL.is_file():
        pytest.skip(f"{REAL} is absent (the shared fixtures hold it in CI)")
    config = json.loads(REAL.read_text())
    g = arch.to_gpt(config["text_config"], "test")
    text = transformers.Gemma4TextConfig(**config["text_config"])
    assert g["n_layers"] == 35 and g["shared_kv_layers"] == text.num_kv_shared_layers == 20
    assert [w > 0 for w in g["windows"]] == [t == "sliding_attention" for t in text.layer_types]
    assert g["global_head_dim"] == 512 and g["head_dim"] == 256 and g["per_layer_dim"] == 256
    assert g["wide_shared_mlp"] and g["logit_softcap"] == 30.0 and g["rope_scaling"]["partial_rotary_factor"] == 0.25


def test_bad_gemma4_configs_are_one_line():
    good = dict(E2B, model_type="gemma4_text")
    for change, said in ((dict(enable_moe_block=True), "num_experts=None with enable_moe_block=true"),
                         (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
                         (dict(hidden_activation="silu"), "hidden_activation"),
                         (dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
                         (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}),
                          "rope_type")):
        with pytest.raises(UserError, match=said):
            arch.to_gpt({**good, **change}, "test")


def test_the_cache_holds_windows_and_no_shared_layer(folders):
    """The server's cache for E2B's shape: the full layer's keys and values at every position, each sliding layer's
    window (a ring), and nothing for the three layers reusing them: per slot and position 2 x 1 head x 32 wide x 4
    bytes, plus 2 sliding layers x 2 x 6 slots x 16 wide x 4 bytes a slot, whatever the context."""
    from shard.server import engine

    generator = generate.Generator(shard.load_model(folders["e2b"][0]))
    for context in (16, 32):
        want = 2 * (context * 2 * 32 * 4 + 2 * 2 * 6 * 16 * 4)
        assert engine.Engine(generator, 2, context, VOCAB).cache_bytes() == want


def test_a_lora_step_is_transformers_loss_and_its_adapters_and_export_run_as_our_model(folders, tmp_path):
    """LoRA on the attention (the shared layers' queries and outputs alone) and the MLPs of every width, two fsdp steps
    from the folder (each layer recomputed in the backward pass): the first loss is transformers' on the batch (the
    adapters start at zero); --adapters-only's folder, loaded by peft over transformers' model of the folder, and the
    merged export (python -m shard.export --format hf), read by transformers, give the tuned run's logits. A pipeline
    is refused in one line: the layers are not one stack to cut into stages."""
    peft = pytest.importorskip("peft")
    path, model = folders["e2b"]
    cfg = config.load(None, overrides(tmp_path / "run", f"train.init_from={path}", "mesh=fsdp", "run.cpu_devices=4",
                                      "train.remat=full", "train.lora.rank=4", "train.lora.alpha=8",
                                      "train.lora.targets=[q,k,v,o,mlp]", "optimizer.lr=3e-2",
                                      "checkpoint.enabled=true", *FINE_TUNE, "train.steps=2"))
    result = trainer.run(cfg)
    want = first_loss(cfg, model)
    assert abs(result.history[0]["loss"] - float(want)) < 1e-5 * float(want)
    assert export.main([str(tmp_path / "run"), "--adapters-only", "--out", str(tmp_path / "adapters")]) == 0
    assert export.main([str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    ours = jax_logits(load.load(str(tmp_path / "run"), [], whole_mesh=False))
    base = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    assert relative(torch_logits(tuned, TOKENS), ours) < 1e-5
    assert relative(torch_logits(model, TOKENS), ours) > 1e-3  # the adapters matter
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    assert relative(torch_logits(merged, TOKENS), ours) < 1e-5
    with pytest.raises(UserError) as e:
        trainer.run(config.load(None, overrides(tmp_path / "pp", f"train.init_from={path}", "mesh=pp",
                                                "run.cpu_devices=2", *FINE_TUNE)))
    assert "a GPT whose layers differ, as Gemma 4's, runs them one by one" in str(e.value) and "\n" not in str(e.value)


def test_a_multimodal_gemma4_folder_loads_its_language_model(tmp_path, capsys):
    """A tiny Gemma4ForConditionalGeneration (a vision tower and its projection beside the language model): the text
    model is read, the towers skipped with one line, the logits those of the model on text alone."""
    torch.manual_seed(0)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    model = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=E2B, vision_config=vision, audio_config=None)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    loaded = load.load(str(tmp_path), [], whole_mesh=False)
    assert "its language model is read, model.embed_vision and model.vision_tower skipped" in capsys.readouterr().err
    assert relative(jax_logits(loaded), torch_logits(model, TOKENS)) < 1e-5


def test_the_servers_slots_answer_as_transformers_past_the_window(folders):
    """Two slots at different places (prompts of 5 and 3 tokens), 10 greedy tokens each through the server's engine:
    each transformers' greedy continuation of its prompt alone, the shared layers reading their keepers' rings."""
    from shard.server import engine

    path, model = folders["e2b"]
    slots = engine.Engine(generate.Generator(shard.load_model(path)), 2, 32, VOCAB)
    slots.allocate()
    prompts = [TOKENS[0, :5].tolist(), TOKENS[1, :3].tolist()]
    got = [[int(slots.start(i, p, 0.0, 0, 1.0).tokens)] for i, p in enumerate(prompts)]
    for _ in range(9):
        picked = slots.advance([g[-1] for g in got], [len(p) + len(g) - 1 for p, g in zip(prompts, got)],
                               *engine.Engine.settings(2))
        for g, t in zip(got, np.asarray(picked.tokens)[:, 0]):
            g.append(int(t))
    for p, g in zip(prompts, got):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, pad_token_id=0)[0, len(p):]
        assert g == want.tolist()


def test_a_config_json_of_model_type_alone_reads_as_transformers_defaults():
    g = arch.to_gpt({"model_type": "gemma4_text"}, "test")
    c = transformers.Gemma4TextConfig()
    full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    local = c.per_layer_config[c.layer_types.index("sliding_attention")]
    assert [w == c.sliding_window if w else t == "full_attention" for w, t in zip(g["windows"], c.layer_types)] == \
        [True] * c.num_hidden_layers
    assert (g["n_layers"], g["d_model"], g["n_heads"], g["n_kv_heads"], g["head_dim"], g["d_ff"], g["vocab_size"],
            g["max_len"], g["per_layer_dim"], g["per_layer_vocab"], g["shared_kv_layers"]) == \
        (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, local.num_key_value_heads, local.head_dim,
         c.intermediate_size, c.vocab_size, c.max_position_embeddings, c.hidden_size_per_layer_input,
         c.vocab_size_per_layer_input, c.num_kv_shared_layers)
    assert g["global_head_dim"] == c.per_layer_config[full[0]].head_dim
    full_rope, local_rope = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
    assert (g["rope_theta"], g["local_rope_theta"], g["rope_scaling"]["partial_rotary_factor"]) == \
        (full_rope["rope_theta"], local_rope["rope_theta"], full_rope["partial_rotary_factor"])
    assert "logit_softcap" not in g and c.final_logit_softcapping is None
