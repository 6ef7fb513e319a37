"""GLM-4.5's config.json (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6) <-> the MoE's arguments.

Its experts and router are DeepSeek-V3's (shard/hf/deepseek.py: sigmoid scores with a correction bias that chooses
and does not weigh, group-limited top-k, routed scaling, shared experts, dense first layers); its attention is plain
grouped-query attention with a head size of its own (head_dim, apart from hidden_size / heads), biases on the queries,
keys and values but not the output (attention_bias), optional per-head query and key norms (use_qk_norm), and RoPE on
the first partial_rotary_factor of each head's channels by halves (rotate_half), not on adjacent pairs. Its tensor
table is tables.py's (`_glm4_moe`). The multi-token-prediction layers a checkpoint holds past num_hidden_layers are read
by a model with model.mtp_depth (shard/hf/mtp.py), else skipped with one line."""

from shard.errors import UserError
from shard.hf import deepseek
from shard.hf.config_in import typed
from shard.hf.typed_rope import is_number

KIND = "glm4_moe"
ARCHITECTURE = "Glm4MoeForCausalLM"
# transformers 5's Glm4MoeConfig defaults (GLM-4.5-Air's shape) for the fields read here
DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                num_attention_heads=96, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
                routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                use_qk_norm=False, rope_theta=10000.0, partial_rotary_factor=0.5)
_NULLABLE = {"head_dim"}
_TYPES = dict(routed_scaling_factor=float, norm_topk_prob=bool, hidden_act=str, rms_norm_eps=float,
              tie_word_embeddings=bool, attention_bias=bool, use_qk_norm=bool, rope_theta=float,
              partial_rotary_factor=float)


def to_moe(c: dict, where: str) -> dict:
    """The MoE's arguments of a glm4_moe config.json."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    get = typed({**c, **{k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}}, DEFAULTS,
                _TYPES, _NULLABLE, where)
    if get("hidden_act") != "silu":
        raise UserError(f"{where}: config.json has hidden_act={get('hidden_act')!r}; {KIND} is read with silu only")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UserError(f"{where}: config.json has rope_type={kind!r}, which is not supported for {KIND} "
                        "(supported: default)")
    for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads"):
        if not get(name):
            raise UserError(f"{where}: config.json has {name}=0; it must be at least 1")
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    if heads % kv_heads:
        raise UserError(f"{where}: config.json has num_attention_heads={heads}, not a multiple of "
                        f"num_key_value_heads={kv_heads}")
    head_dim = get("head_dim") or get("hidden_size") // heads
    factor, theta = get("partial_rotary_factor"), get("rope_theta")
    rotary = int(head_dim * factor)  # as transformers' GlmRotaryEmbedding rounds it
    if not 0 < factor <= 1 or rotary % 2 or not rotary or not is_number(theta) or theta <= 0:
        raise UserError(f"{where}: config.json has partial_rotary_factor={factor!r}, rope_theta={theta!r}; the factor "
                        f"must give an even number of head_dim={head_dim}'s channels and the base be positive")
    return dict(vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_heads=heads, n_kv_heads=kv_heads,
                head_dim=head_dim, max_len=get("max_position_embeddings"), position="rope", norm="rmsnorm",
                mlp="swiglu", norm_eps=float(get("rms_norm_eps")), tie_embeddings=get("tie_word_embeddings"),
                qkv_bias=get("attention_bias"), qk_norm="head" if get("use_qk_norm") else "none",
                rope_theta=float(theta), rotary_dim=0 if rotary == head_dim else rotary,
                n_layers=get("num_hidden_layers"), **deepseek.experts(get, where))


def is_glm(g: dict) -> bool:
    """An MoE routed as DeepSeek-V3 routes, with plain attention: written as glm4_moe."""
    return g.get("router") == "sigmoid" and bool(g.get("score_correction")) and not g.get("latent")


def from_moe(g: dict) -> dict:
    """The glm4_moe config.json of an MoE's arguments (every default given); one line where GLM-4.5 cannot hold
    them."""
    want = dict(position="rope", norm="rmsnorm", mlp="swiglu", routing="dropless", norms="pre", bias=False,
                mlp_bias=False, attn_bias=False, rope_interleaved=False, windows=None, chunks=None, rope_layers=None,
                embed_scale=False, router_bias=False, router_norm=False, expert_scale=False, weigh_inputs=False,
                shared_gate=False, expert_bias=False, swiglu_limit=0.0, beside_d_ff=0, logit_softcap=0.0,
                rope_scaling=None, attn_scale=0.0, attn_softcap=0.0, attn_sinks=False)
    deepseek.refuse_unlike(g, want, {} if g.get("qk_norm") in ("none", "head") else {"qk_norm": g.get("qk_norm")},
                           KIND, "GLM-4.5", "qk_norm none or head")
    head_dim = g["head_dim"]
    rope = {"rope_type": "default", "rope_theta": g["rope_theta"],
            "partial_rotary_factor": (g.get("rotary_dim") or head_dim) / head_dim}
    return dict(model_type=KIND, architectures=[ARCHITECTURE], **deepseek.shared_config(g),
                num_key_value_heads=g["n_kv_heads"], head_dim=head_dim, rope_parameters=rope,
                attention_bias=bool(g.get("qkv_bias")), use_qk_norm=g["qk_norm"] == "head")
