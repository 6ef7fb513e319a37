"""DeepSeek-V3 (`deepseek_v3`) and GLM-4.5 (`glm4_moe`) against transformers: tiny models with DeepSeek's latent
attention (a query latent, YaRN whose mscale_all_dim scales the softmax) or GLM's grouped-query attention (a head size
of its own, RoPE on half of each head by halves, q/k/v biases, per-head q/k norms), a dense first layer, then experts
with the sigmoid router, its correction bias, group-limited choice, routed scaling and a shared expert: logits on one
device, fsdp and ep, and token by token from the generation cache (stronger than greedy tokens), export and
re-import; the real deepseek-r1 config, GLM-4.5-Air's and Kimi-K2's published ones read as transformers reads them
(DeepSeek's MTP layer and FP8 weights are what a checkpoint holds: tests/test_hf_fp8.py reads the format)."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard.errors import UserError  # noqa: E402
from shard.hf import arch  # noqa: E402
from shard.use import load  # noqa: E402

from test_hf import (TOKENS, VOCAB, adapters_merge_as_peft_merges, assert_exports_bitwise, jax_logits,  # noqa: E402
                     relative, torch_logits)

REAL = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf" / "deepseek-r1" / "config.json"
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "beta_fast": 8.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                             "rope_theta": 1000.0},
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
GLM = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
           n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
           first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
           rope_theta=1000.0, max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None)
# GLM-4.5-Air's config.json as published (zai-org/GLM-4.5-Air), the fields transformers reads
AIR = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], attention_bias=True, head_dim=128,
           hidden_act="silu", hidden_size=4096, partial_rotary_factor=0.5, intermediate_size=10944,
           max_position_embeddings=131072, moe_intermediate_size=1408, norm_topk_prob=True, num_attention_heads=96,
           n_group=1, topk_group=1, n_routed_experts=128, n_shared_experts=1, routed_scaling_factor=1.0,
           num_experts_per_tok=8, first_k_dense_replace=1, num_hidden_layers=46, num_key_value_heads=8,
           rms_norm_eps=1e-05, rope_theta=1000000, num_nextn_predict_layers=1, tie_word_embeddings=False,
           use_qk_norm=False, vocab_size=151552)
# moonshotai/Kimi-K2-Instruct's config.json as published (its architecture's fields; model_type kimi_k2, custom code
# that is DeepSeek-V3's modeling file)
KIMI = dict(architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", first_k_dense_replace=1, hidden_act="silu",
            hidden_size=7168, intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=131072,
            moe_intermediate_size=2048, moe_layer_freq=1, n_group=1, n_routed_experts=384, n_shared_experts=1,
            norm_topk_prob=True, num_attention_heads=64, num_experts_per_tok=8, num_hidden_layers=61,
            num_key_value_heads=64, num_nextn_predict_layers=0, q_lora_rank=1536, qk_nope_head_dim=128,
            qk_rope_head_dim=64, rms_norm_eps=1e-06, rope_theta=50000.0,
            rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "type": "yarn"},
            routed_scaling_factor=2.827, scoring_func="sigmoid", topk_group=1, topk_method="noaux_tc",
            tie_word_embeddings=False, v_head_dim=128, vocab_size=163840)
MESHES = {"one": [], "fsdp": ["mesh=fsdp", "run.cpu_devices=2"], "ep": ["mesh=ep", "run.cpu_devices=4"]}
FAMILIES = {"deepseek_v3": ("DeepseekV3", TINY), "glm4_moe": ("Glm4Moe", GLM)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's tiny model, every weight (and the routers' correction biases) moved off its init, saved."""
    out = {}
    for kind, (name, tiny) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, name + "Config")(**tiny)
        model = getattr(transformers, name + "ForCausalLM")(config).float().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
            for layer in model.model.layers[tiny["first_k_dense_replace"]:]:
                layer.mlp.gate.e_score_correction_bias.copy_(0.5 * torch.randn(tiny["n_routed_experts"]))
        model.generation_config.eos_token_id = None
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = str(path), model
    return out


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_logits_equal_transformers(folders, kind, mesh):
    path, model = folders[kind]
    loaded = load.load(path, MESHES[mesh], whole_mesh=mesh != "one")
    assert loaded.cfg.model.name == "moe"
    assert relative(jax_logits(loaded), torch_logits(model, TOKENS)) < 1e-5


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_logits_token_by_token_from_the_cache_equal_transformers(folders, kind):
    """A prefill of 6 tokens, then one token a call over the cache (DeepSeek's: the latent, the up-projections
    absorbed): each call's logits equal transformers' at that position (greedy tokens alone miss a 1% error)."""
    import jax.numpy as jnp
    import numpy as np

    import shard
    from shard.use import generate

    path, model = folders[kind]
    g = generate.Generator(shard.load_model(path))
    want = torch_logits(model, TOKENS)
    zero, rows = jnp.zeros(len(TOKENS), jnp.int32), len(TOKENS)
    logits, cache = g.forward(g.state, jnp.asarray(TOKENS[:, :6]), zero, zero, None, 16)
    got = [np.asarray(logits)]
    for i in range(6, TOKENS.shape[1]):
        logits, cache = g.forward(g.state, jnp.asarray(TOKENS[:, i:i + 1]), jnp.full(rows, i, jnp.int32), zero,
                                  cache, 16)
        got.append(np.asarray(logits))
    assert relative(np.stack(got, 1), want[:, 5:]) < 1e-5


def test_the_cache_holds_the_latent_and_the_rotated_key(folders):
    """The server's cache for the tiny DeepSeek: per slot, position and layer the normed key/value latent and the one
    rotated key (16 + 4 values, 4 bytes each), not every head's expanded keys and values (2 x 4 heads x 12)."""
    import shard
    from shard.server import engine
    from shard.use import generate

    generator = generate.Generator(shard.load_model(folders["deepseek_v3"][0]))
    for context in (16, 32):
        want = 2 * context * TINY["num_hidden_layers"] * (TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]) * 4
        assert engine.Engine(generator, 2, context, VOCAB).cache_bytes() == want


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_export_and_reimport_are_bitwise(folders, kind, tmp_path):
    """(the routers' correction biases, no parameters, written too)"""
    assert_exports_bitwise(*folders[kind], tmp_path / "out", kind)


# LoRA on the latent attention's four projections and its output (and the router), GLM-4.5's plain attention
ADAPTED = {"deepseek_v3": [["q_a", "kv_b", "o"], ["q_b", "kv_a", "router"]], "glm4_moe": [["q", "k", "v", "o"]]}


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_lora_adapters_are_peft_weights_of_our_merged_model(folders, kind, tmp_path):
    """(peft takes the Linears named gate_proj, up_proj and down_proj of these families for their experts: adapters
    on the dense and shared MLPs are refused in one line, their merged export being the way out)"""
    adapters_merge_as_peft_merges(folders[kind][0], "moe", ADAPTED[kind], tmp_path)
    with pytest.raises(UserError, match="peft reads adapters on a .* model's down_proj, gate_proj, up_proj as its "
                                        "experts'") as e:
        adapters_merge_as_peft_merges(folders[kind][0], "moe", [["mlp"]], tmp_path / "mlp")
    assert "\n" not in str(e.value)


def test_the_real_r1_config_reads_as_transformers_reads_it():
    if not REAL.is_file():
        pytest.skip(f"{REAL} is absent (the shared fixtures hold it in CI)")
    config = json.loads(REAL.read_text())
    g = arch.to_gpt(config, "test")
    theirs = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k != "auto_map"})
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    assert g["latent"] == dict(q_rank=1536, kv_rank=512, nope_dim=128, rope_dim=64, v_dim=128)
    assert g["attn_scale"] == pytest.approx(yarn_apply_mscale(theirs.rope_parameters, 192 ** -0.5), rel=1e-12)
    assert (g["n_experts"], g["top_k"], g["n_group"], g["topk_group"], g["dense_layers"]) == (256, 8, 8, 4, 3)


def test_a_kimi_k2_folder_reads_as_deepseek_v3(folders, tmp_path):
    """Kimi-K2's folders say model_type kimi_k2 (custom code, DeepSeek-V3's): read as deepseek_v3, no code of theirs
    run; its published config as transformers' DeepseekV3Config reads it, and a tiny one with transformers' logits."""
    import shutil

    g = arch.to_gpt(KIMI, "test")
    theirs = transformers.DeepseekV3Config(**{k: v for k, v in KIMI.items() if k != "model_type"})
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    assert g["attn_scale"] == pytest.approx(yarn_apply_mscale(theirs.rope_parameters, 192 ** -0.5), rel=1e-12)
    assert (g["n_experts"], g["n_group"], g["routed_scaling"], g["n_heads"]) == (384, 1, 2.827, 64)
    path, model = folders["deepseek_v3"]
    shutil.copytree(path, tmp_path / "kimi")
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(config))
    assert relative(jax_logits(load.load(str(tmp_path / "kimi"), [], whole_mesh=False)),
                    torch_logits(model, TOKENS)) < 1e-5


def test_bad_deepseek_configs_are_one_line():
    good = dict(TINY, model_type="deepseek_v3")
    for change, said in ((dict(scoring_func="softmax"), "scoring_func"), (dict(hidden_act="gelu"), "hidden_act"),
                         (dict(first_k_dense_replace=3), "first_k_dense_replace"),
                         (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type")):
        with pytest.raises(UserError, match=said) as e:
            arch.to_gpt({**good, **change}, "test")
        assert "\n" not in str(e.value)


def test_a_config_json_of_model_type_alone_reads_as_transformers_defaults():
    g = arch.to_gpt({"model_type": "deepseek_v3"}, "test")
    c = transformers.DeepseekV3Config()
    assert g["latent"] == dict(q_rank=c.q_lora_rank, kv_rank=c.kv_lora_rank, nope_dim=c.qk_nope_head_dim,
                               rope_dim=c.qk_rope_head_dim, v_dim=c.v_head_dim)
    assert (g["n_layers"], g["d_model"], g["n_heads"], g["vocab_size"], g["max_len"], g["d_ff"], g["dense_d_ff"],
            g["n_experts"], g["top_k"], g["n_group"], g["topk_group"], g["dense_layers"], g["shared_experts"],
            g["routed_scaling"], g["norm_topk"], g["norm_eps"], g["rope_theta"], g["tie_embeddings"]) == \
        (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.vocab_size, c.max_position_embeddings,
         c.moe_intermediate_size, c.intermediate_size, c.n_routed_experts, c.num_experts_per_tok, c.n_group,
         c.topk_group, c.first_k_dense_replace, c.n_shared_experts, c.routed_scaling_factor, c.norm_topk_prob,
         c.rms_norm_eps, c.rope_parameters["rope_theta"], c.tie_word_embeddings)
    assert g["rope_scaling"] is None and g["attn_scale"] == c.qk_head_dim ** -0.5 and g["rope_interleaved"]


def test_glm_4_5_airs_config_reads_as_transformers_reads_it():
    g = arch.to_gpt(AIR, "test")
    theirs = transformers.Glm4MoeConfig(**{k: v for k, v in AIR.items() if k not in ("architectures", "model_type")})
    rotary = int(theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"])
    assert (g["head_dim"], g["rotary_dim"], g["n_kv_heads"], g["rope_theta"]) == \
        (theirs.head_dim, rotary, theirs.num_key_value_heads, theirs.rope_parameters["rope_theta"])
    assert (g["n_experts"], g["top_k"], g["d_ff"], g["dense_d_ff"], g["dense_layers"], g["shared_experts"],
            g["routed_scaling"], g["qkv_bias"], g["qk_norm"]) == \
        (theirs.n_routed_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
         theirs.intermediate_size, theirs.first_k_dense_replace, theirs.n_shared_experts,
         theirs.routed_scaling_factor, True, "none")


def test_glm_4_5s_default_config_is_refused_in_one_line_as_transformers_cannot_run_it():
    """transformers' Glm4MoeConfig() gives head_dim 4096 // 96 = 42 and rotates 21 of its channels: its own model
    fails on it (an index out of range), so a config.json of model_type alone is refused, naming the fields."""
    with pytest.raises(UserError, match="partial_rotary_factor=0.5.*head_dim=42") as e:
        arch.to_gpt({"model_type": "glm4_moe"}, "test")
    assert "\n" not in str(e.value)


def test_bad_glm_configs_are_one_line():
    good = dict(GLM, model_type="glm4_moe")
    for change, said in ((dict(hidden_act="gelu"), "hidden_act"), (dict(first_k_dense_replace=3), "first_k_dense"),
                         (dict(partial_rotary_factor=0.45), "partial_rotary_factor"),
                         (dict(num_key_value_heads=3), "num_key_value_heads"),
                         (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type")):
        with pytest.raises(UserError, match=said) as e:
            arch.to_gpt({**good, **change}, "test")
        assert "\n" not in str(e.value)
