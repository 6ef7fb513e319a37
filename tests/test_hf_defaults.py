"""Each family's defaults, where config.json leaves a field out, are transformers' own: a config.json holding only
model_type, read here, gives every option that config fields set (sizes, RoPE bases, eps, activation, tying,
windows, biases, soft-caps, experts) as transformers' config class gives it with no argument at all; and with
use_sliding_window=true alone, for the families that have that switch."""

import json

import pytest

transformers = pytest.importorskip("transformers")

from shard.hf import arch  # noqa: E402

# the families whose d_ff option is an expert's (transformers' moe_intermediate_size)
EXPERT_D_FF = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text")
# transformers' activation names -> the GPT's mlp option that computes that function
MLPS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "gelu"}


def transformers_options(kind: str, fields: dict) -> dict:
    """The GPT's options, derived from the attributes of transformers' config class of `kind`, built with `fields`
    alone (transformers 5 keeps RoPE's settings in rope_parameters: per layer type for Gemma 3 and OLMo 3)."""
    c = transformers.AutoConfig.for_model(kind, **fields)
    if kind == "gpt2":
        return dict(vocab_size=c.vocab_size, d_model=c.n_embd, n_layers=c.n_layer, n_heads=c.n_head,
                    d_ff=c.n_inner or 4 * c.n_embd, max_len=c.n_positions, mlp=MLPS[c.activation_function],
                    norm_eps=c.layer_norm_epsilon, tie_embeddings=c.tie_word_embeddings)
    n, heads, rope = c.num_hidden_layers, c.num_attention_heads, c.rope_parameters
    typed = kind in ("gemma3_text", "olmo3")
    full, local = (rope["full_attention"], rope["sliding_attention"]) if typed else (rope, None)
    assert full["rope_type"] == ("yarn" if kind == "gpt_oss" else "default")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    # the modeling files: a layer slides where layer_types says so, or every layer where the config has none
    types = getattr(c, "layer_types", None) or ["sliding_attention"] * n
    window = getattr(c, "sliding_window", None)
    out = dict(vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=n, n_heads=heads,
               n_kv_heads=c.num_key_value_heads or heads, head_dim=head_dim, max_len=c.max_position_embeddings,
               d_ff=c.moe_intermediate_size if kind in EXPERT_D_FF else c.intermediate_size,
               mlp=MLPS[getattr(c, "hidden_activation", None) or c.hidden_act], norm_eps=c.rms_norm_eps,
               tie_embeddings=c.tie_word_embeddings, rope_theta=full["rope_theta"], rope_scaling=None,
               windows=[window if t == "sliding_attention" else 0 for t in types] if window else None,
               rotary_dim=int(head_dim * full.get("partial_rotary_factor", 1.0)))
    bias = "attn_bias" if kind == "gpt_oss" else "bias"  # GPT-OSS's attention alone: its experts' are their own
    out.update({ours: getattr(c, name) for name, ours in (("attention_bias", bias), ("mlp_bias", "mlp_bias"),
                                                          ("norm_topk_prob", "norm_topk")) if hasattr(c, name)})
    if kind in ("gemma2", "gemma3_text"):
        out.update(attn_scale=c.query_pre_attn_scalar ** -0.5, attn_softcap=c.attn_logit_softcapping,
                   logit_softcap=c.final_logit_softcapping)
    if typed and "sliding_attention" in types:
        out.update(local_rope_theta=local["rope_theta"], rope_layers=[2 if t == "sliding_attention" else 1
                                                                      for t in types])
    if kind in ("smollm3", "llama4_text"):
        out.update(rope_layers=c.no_rope_layers)
    if kind == "llama4_text":  # chunks on the layers layer_types names, Llama 4's own query norm and temperature
        out.update(chunks=[c.attention_chunk_size if t == "chunked_attention" else 0 for t in c.layer_types],
                   qk_norm="l2" if c.use_qk_norm else "none", rope_interleaved=True, attn_bias=c.attention_bias,
                   attn_temperature_floor=float(c.floor_scale) if c.attn_temperature_tuning else 0.0,
                   attn_temperature_scale=c.attn_scale, windows=None)
        out.pop("bias")
    if kind in arch.experts.RELATIVE:
        out.update(n_experts=getattr(c, "num_experts", None) or c.num_local_experts, top_k=c.num_experts_per_tok,
                   aux_loss_weight=c.router_aux_loss_coef if c.output_router_logits and kind != "llama4_text" else 0.0)
    if kind == "gpt_oss":  # YaRN by default, its attention factor as transformers computes it
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")
        out.update(rope_scaling=dict(rope_type="yarn", **{k: full[k] for k in keys},
                                     attention_factor=ROPE_INIT_FUNCTIONS["yarn"](c, "cpu")[1]),
                   swiglu_limit=c.swiglu_limit, swiglu_alpha=c.swiglu_alpha, attn_sinks=True)
    return out


# and the families with a switch for their windows, switched on: the window's and its layers' defaults then
SWITCHED = [k for k in arch.SUPPORTED if "use_sliding_window" in transformers.AutoConfig.for_model(k).to_dict()]


# (Gemma 4's, DeepSeek-V3's and GLM-4.5's readers are their own modules: tests/test_hf_gemma4.py and
# test_hf_deepseek.py check their defaults; GLM-4.5's default config is refused, and fails in transformers too)
OWN_READERS = ("gemma4_text", "deepseek_v3", "glm4_moe")


@pytest.mark.parametrize("kind, fields", [(k, {}) for k in arch.SUPPORTED if k not in OWN_READERS] +
                         [(k, {"use_sliding_window": True}) for k in SWITCHED])
def test_a_config_json_of_model_type_alone_reads_as_transformers_defaults(kind, fields, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind, **fields}))
    got = arch.to_gpt(json.loads((tmp_path / "config.json").read_text()), "path")
    want = transformers_options(kind, fields)
    # what the reader leaves out is the GPT's own default: no window, no soft-cap, every channel rotated
    absent = dict(windows=None, attn_softcap=None, logit_softcap=None, rotary_dim=got.get("head_dim"),
                  rope_layers=None, bias=False)
    mismatches = {k: (got.get(k, absent.get(k)), v) for k, v in want.items() if got.get(k, absent.get(k)) != v}
    assert not mismatches, f"{kind}: option: (ours, transformers') {mismatches}"
