"""GLM-4.5 (`glm4_moe`) against transformers: a tiny model with its head size apart from hidden_size / heads, RoPE on
half of each head's channels, biases on the queries, keys and values, per-head q/k norms, a dense first layer, then
DeepSeek-V3's router (sigmoid, correction bias, group-limited choice, routed scaling) and a shared expert: logits on one
device, fsdp and ep, greedy generation, export and re-import; GLM-4.5-Air's published config read as transformers
reads it."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard.errors import UserError  # noqa: E402
from shard.hf import arch  # noqa: E402
from shard.use import load  # noqa: E402

from test_hf import (TOKENS, VOCAB, assert_exports_bitwise, assert_greedy_as_transformers, jax_logits,  # noqa: E402
                     relative, torch_logits)

TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
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
MESHES = {"one": [], "fsdp": ["mesh=fsdp", "run.cpu_devices=2"], "ep": ["mesh=ep", "run.cpu_devices=4"]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny model, every weight (and the routers' correction biases) moved off its init, saved."""
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**TINY)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for layer in model.model.layers[TINY["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.5 * torch.randn(TINY["n_routed_experts"]))
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("glm4_moe")
    model.save_pretrained(path)
    return str(path), model


@pytest.mark.parametrize("mesh", list(MESHES))
def test_logits_equal_transformers(folder, mesh):
    path, model = folder
    loaded = load.load(path, MESHES[mesh], whole_mesh=mesh != "one")
    assert loaded.cfg.model.name == "moe"
    assert relative(jax_logits(loaded), torch_logits(model, TOKENS)) < 1e-5


def test_greedy_generation_equals_transformers(folder):
    assert_greedy_as_transformers(*folder)


def test_export_and_reimport_are_bitwise(folder, tmp_path):
    assert_exports_bitwise(*folder, tmp_path / "out", "glm4_moe")


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


def test_bad_glm_configs_are_one_line():
    good = dict(TINY, model_type="glm4_moe")
    for change, said in ((dict(hidden_act="gelu"), "hidden_act"), (dict(first_k_dense_replace=3), "first_k_dense"),
                         (dict(partial_rotary_factor=0.45), "partial_rotary_factor"),
                         (dict(num_key_value_heads=3), "num_key_value_heads"),
                         (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type")):
        with pytest.raises(UserError, match=said) as e:
            arch.to_gpt({**good, **change}, "test")
        assert "\n" not in str(e.value)
