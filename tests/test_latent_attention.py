"""Multi-head latent attention (models/latent.py) against transformers' DeepseekV3Attention, the module alone: its
weights copied in, the same tokens, outputs within 1e-5; with queries through their own latent or straight from the
token, plain RoPE or DeepSeek-V3's YaRN (its softmax scale with mscale_all_dim)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from shard.models.latent import LatentAttention  # noqa: E402
from shard.models.rope import Rope  # noqa: E402

SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12,
             qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=64)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.7, "rope_theta": 1000.0}


def theirs(q_rank, rope):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    config = transformers.DeepseekV3Config(**SIZES, q_lora_rank=q_rank, rope_parameters=rope)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = m.DeepseekV3Attention(config, 0).float().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return attn, m.DeepseekV3RotaryEmbedding(config), config


def ours_of(attn, rotary, config) -> LatentAttention:
    h, d = config.num_attention_heads, config.hidden_size
    qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    rope = config.rope_parameters
    yarn = None if rope["rope_type"] == "default" else (
        rope["factor"], rope["original_max_position_embeddings"], rope["beta_fast"], rope["beta_slow"],
        rotary.attention_scaling, True)
    latent = dict(q_rank=config.q_lora_rank or 0, kv_rank=config.kv_lora_rank, nope_dim=config.qk_nope_head_dim,
                  rope_dim=config.qk_rope_head_dim, v_dim=v)
    with nnx.use_eager_sharding(False):
        ours = LatentAttention(d, h, latent, Rope(rope["rope_theta"], yarn=yarn, interleaved=True), 0.02,
                               nnx.Rngs(0), scale=attn.scaling)
    w = {n: p.detach().numpy() for n, p in attn.named_parameters()}
    if config.q_lora_rank:
        ours.q_a.set_value(jnp.asarray(w["q_a_proj.weight"].T))
        ours.q_norm.scale.set_value(jnp.asarray(w["q_a_layernorm.weight"]))
        ours.q_b.set_value(jnp.asarray(w["q_b_proj.weight"].T.reshape(-1, h, qk)))
    else:
        ours.q.set_value(jnp.asarray(w["q_proj.weight"].T.reshape(d, h, qk)))
    ours.kv_a.set_value(jnp.asarray(w["kv_a_proj_with_mqa.weight"].T))
    ours.kv_norm.scale.set_value(jnp.asarray(w["kv_a_layernorm.weight"]))
    ours.kv_b.set_value(jnp.asarray(w["kv_b_proj.weight"].T.reshape(-1, h, config.qk_nope_head_dim + v)))
    ours.out.set_value(jnp.asarray(w["o_proj.weight"].T.reshape(h, v, d)))
    return ours


@pytest.mark.parametrize("q_rank, rope", [(24, YARN), (None, {"rope_type": "default", "rope_theta": 100.0})])
def test_latent_attention_equals_deepseek_v3s(q_rank, rope):
    attn, rotary, config = theirs(q_rank, rope)
    x = np.random.default_rng(0).normal(size=(2, 20, config.hidden_size)).astype(np.float32)  # past the original 16
    positions = torch.arange(20)[None].expand(2, -1)
    mask = torch.full((20, 20), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = attn(torch.tensor(x), rotary(torch.tensor(x), positions), mask)[0].numpy()
    got = np.asarray(ours_of(attn, rotary, config)(jnp.asarray(x)))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


LATENT = ["model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.rope_interleaved=true",
          "model.latent={q_rank: 16, kv_rank: 16, nope_dim: 8, rope_dim: 4, v_dim: 8}", "train.steps=3"]


def test_a_gpt_with_latent_attention_trains_alike_on_one_device_and_split(train, tmp_path):
    """The GPT's latent option through the CLI: its loss curve on one device equals that under fsdp_tp (heads split
    over tensor, the rest over fsdp) and, while generating, the cache gives the logits of the whole sequence."""
    from conftest import TINY_GPT

    import shard
    from shard.use import generate

    one = train(*TINY_GPT, *LATENT, "checkpoint.enabled=true", subdir="one")
    split = train(*TINY_GPT, *LATENT, "mesh=fsdp_tp", "run.cpu_devices=4", subdir="split")
    np.testing.assert_allclose([h["loss"] for h in split.history], [h["loss"] for h in one.history], rtol=1e-5)
    model = shard.load_model(str(tmp_path / "one"))
    prompt = np.random.default_rng(0).integers(0, 256, (2, 6))
    tokens = generate.Generator(model)(prompt, 6, generate.Sampling(temperature=0))
    whole = np.asarray(model(jnp.asarray(np.concatenate([prompt, tokens], axis=1))))
    np.testing.assert_array_equal(whole[:, 5:-1].argmax(-1), tokens)  # each greedy token the whole pass's argmax
