"""DeepSeek-V3's config.json (`deepseek_v3`: DeepSeek-V3 and R1, Kimi-K2-shaped models) -> the MoE's arguments.

Its attention is multi-head latent attention (the GPT's `latent` option, models/latent.py): the queries through a
latent of q_lora_rank (or straight from the token where it is null), keys and values from one of kv_lora_rank and one
rotated key part of qk_rope_head_dim shared by the heads, RoPE on adjacent pairs (rope_interleave), YaRN whose
mscale_all_dim also scales the softmax (by its mscale squared, as transformers' yarn_apply_mscale). Its experts: the
sigmoid router with a correction bias that chooses and does not weigh (e_score_correction_bias: loaded, not trained),
group-limited top-k (n_group, topk_group), the chosen weights renormalised and times routed_scaling_factor, shared
experts beside them, and the first first_k_dense_replace layers dense. transformers adds no balancing loss to its
training loss, nor does this. The multi-token-prediction layers a checkpoint holds past num_hidden_layers are read by a
model with model.mtp_depth (shard/hf/mtp.py), else skipped with one line."""

import math

from shard.errors import UserError
from shard.hf.config_in import typed
from shard.hf.typed_rope import is_number, yarn

KIND = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# transformers 5's DeepseekV3Config defaults for the fields read here
DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_interleave=True, attention_bias=False, rope_theta=10000.0)
_NULLABLE = {"q_lora_rank"}
_TYPES = dict(routed_scaling_factor=float, norm_topk_prob=bool, hidden_act=str, rms_norm_eps=float,
              tie_word_embeddings=bool, rope_interleave=bool, attention_bias=bool, rope_theta=float)
# what older configs (R1's, written for their own modeling file) say that transformers' module always does
ALWAYS = dict(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)


def to_moe(c: dict, where: str) -> dict:
    """The MoE's arguments of a deepseek_v3 config.json."""
    get = typed(c, DEFAULTS, _TYPES, _NULLABLE, where)

    for name, value in ALWAYS.items():
        if c.get(name, value) != value:
            raise UserError(f"{where}: config.json has {name}={c[name]!r}; {KIND} runs {name}={value!r} only")
    if get("hidden_act") != "silu":
        raise UserError(f"{where}: config.json has hidden_act={get('hidden_act')!r}; {KIND} is read with silu only")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                 "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim"):
        if not get(name):
            raise UserError(f"{where}: config.json has {name}=0; it must be at least 1")
    latent = dict(q_rank=get("q_lora_rank") or 0, kv_rank=get("kv_lora_rank"), nope_dim=get("qk_nope_head_dim"),
                  rope_dim=get("qk_rope_head_dim"), v_dim=get("v_head_dim"))
    if latent["rope_dim"] % 2 or latent["v_dim"] > latent["nope_dim"] + latent["rope_dim"]:
        raise UserError(f"{where}: config.json has qk_rope_head_dim={latent['rope_dim']}, v_head_dim="
                        f"{latent['v_dim']}: the rotated part must be even and the values no wider than the keys")
    theta, scaling, scale = _rope(c, get, where, latent["nope_dim"] + latent["rope_dim"])
    return dict(vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=get("num_hidden_layers"),
                n_heads=get("num_attention_heads"), max_len=get("max_position_embeddings"), position="rope",
                norm="rmsnorm", mlp="swiglu", norm_eps=float(get("rms_norm_eps")),
                tie_embeddings=get("tie_word_embeddings"), attn_bias=get("attention_bias"), latent=latent,
                rope_theta=theta, rope_scaling=scaling, rope_interleaved=get("rope_interleave"), attn_scale=scale,
                **experts(get, where))


def experts(get, where: str) -> dict:
    """The MoE's expert and router arguments of DeepSeek-V3's fields (`get`: config_in.typed's reader), which
    GLM-4.5's config.json shares (shard/hf/glm.py)."""
    for name in ("num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                 "topk_group"):
        if not get(name):
            raise UserError(f"{where}: config.json has {name}=0; it must be at least 1")
    n, dense = get("num_hidden_layers"), get("first_k_dense_replace")
    if dense >= n:
        raise UserError(f"{where}: config.json has first_k_dense_replace={dense} of num_hidden_layers={n}; at least "
                        "one layer must hold the experts")
    return dict(n_experts=get("n_routed_experts"), top_k=get("num_experts_per_tok"), d_ff=get("moe_intermediate_size"),
                routing="dropless", router="sigmoid", n_group=get("n_group"), topk_group=get("topk_group"),
                routed_scaling=float(get("routed_scaling_factor")), norm_topk=get("norm_topk_prob"),
                score_correction=True, shared_experts=get("n_shared_experts"), dense_layers=dense,
                dense_d_ff=get("intermediate_size"), aux_loss_weight=0.0)


def _rope(c: dict, get, where: str, qk_dim: int) -> tuple[float, dict | None, float]:
    """(theta, the GPT's rope_scaling, the softmax scale): rope_parameters, or rope_scaling with rope_theta beside
    it (R1's), plain or YaRN."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if not isinstance(params, dict):
        raise UserError(f"{where}: config.json has rope_parameters={params!r}; a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", get("rope_theta"))
    if not is_number(theta) or theta <= 0:
        raise UserError(f"{where}: config.json has rope_theta={theta!r}; it must be a positive number")
    scale = qk_dim ** -0.5
    if kind == "default":
        return float(theta), None, scale
    if kind != "yarn":
        raise UserError(f"{where}: config.json has rope_type={kind!r}, which is not supported for {KIND} "
                        "(supported: default, yarn)")
    scaling = yarn(params, where, get)
    every = params.get("mscale_all_dim")
    if every:  # transformers' yarn_apply_mscale: the softmax scale times mscale(factor, mscale_all_dim) squared
        mscale = 1.0 if scaling["factor"] <= 1 else 0.1 * every * math.log(scaling["factor"]) + 1.0
        scale *= mscale * mscale
    return float(theta), scaling, scale


def rows(row) -> tuple:
    """DeepSeek-V3's tensor table (shard/hf/tables.py's rows, `row` its Row): the latent attention's projections and
    norms in both stacks (the dense first layers', `dense_blocks`, and the experts' layers', `blocks`, whose tensors
    count on from the dense ones'), the dense MLPs, each expert's MLP, the shared experts (as one MLP z wide) and the
    router with its correction. Letters: c the query/key head width (nope + rope), r the query latent, a the key/value
    down-projection (latent + rope), l the key/value latent, m a head's key part and value (nope + v), t the value
    width, g the dense MLPs' width, z the shared experts'."""
    L = "model.layers.{i}."
    A = L + "self_attn."
    out = [row("tok", "model.embed_tokens.weight", "v e", "v e")]
    for stack in ("dense_blocks.", "blocks."):
        at = stack + "attn."
        out += [row(at + "q", A + "q_proj.weight", "(h c) e", "e h c"),
                row(at + "q_a", A + "q_a_proj.weight", "r e", "e r"),
                row(at + "q_a_bias", A + "q_a_proj.bias", "r", "r"),
                row(at + "q_norm.scale", A + "q_a_layernorm.weight", "r", "r"),
                row(at + "q_b", A + "q_b_proj.weight", "(h c) r", "r h c"),
                row(at + "kv_a", A + "kv_a_proj_with_mqa.weight", "a e", "e a"),
                row(at + "kv_a_bias", A + "kv_a_proj_with_mqa.bias", "a", "a"),
                row(at + "kv_norm.scale", A + "kv_a_layernorm.weight", "l", "l"),
                row(at + "kv_b", A + "kv_b_proj.weight", "(h m) l", "l h m"),
                row(at + "out", A + "o_proj.weight", "e (h t)", "h t e"),
                row(at + "out_bias", A + "o_proj.bias", "e", "e"),
                row(stack + "ln1.scale", L + "input_layernorm.weight", "e", "e"),
                row(stack + "ln2.scale", L + "post_attention_layernorm.weight", "e", "e")]
    return (*out, *expert_rows(row))


def expert_rows(row) -> tuple:
    """The MLPs' rows of DeepSeek-V3's table, GLM-4.5's too: the dense first layers' MLPs (g wide), each expert's MLP,
    the shared experts (one MLP z wide), the router and its correction, the final norm and the output layer."""
    L = "model.layers.{i}."
    M, E = L + "mlp.", L + "mlp.experts.{x}."
    return (row("dense_blocks.ffn.w_gate", M + "gate_proj.weight", "g e", "e g"),
            row("dense_blocks.ffn.w_in", M + "up_proj.weight", "g e", "e g"),
            row("dense_blocks.ffn.w_out", M + "down_proj.weight", "e g", "g e"),
            row("blocks.ffn.router", M + "gate.weight", "x e", "e x"),
            row("blocks.ffn.correction", M + "gate.e_score_correction_bias", "x", "x"),
            row("blocks.ffn.w_gate", E + "gate_proj.weight", "f e", "x e f"),
            row("blocks.ffn.w_in", E + "up_proj.weight", "f e", "x e f"),
            row("blocks.ffn.w_out", E + "down_proj.weight", "e f", "x f e"),
            row("blocks.ffn.shared.w_gate", M + "shared_experts.gate_proj.weight", "z e", "e z"),
            row("blocks.ffn.shared.w_in", M + "shared_experts.up_proj.weight", "z e", "e z"),
            row("blocks.ffn.shared.w_out", M + "shared_experts.down_proj.weight", "e z", "z e"),
            row("ln_f.scale", "model.norm.weight", "e", "e"), row("head", "lm_head.weight", "v e", "e v"))


def sizes(g: dict) -> dict:
    """The letters of `rows` for an MoE's arguments (with every default)."""
    mlps = dict(g=g.get("dense_d_ff") or g["d_ff"], z=g.get("shared_experts", 0) * (g.get("shared_d_ff") or g["d_ff"]))
    latent = g.get("latent") or {}
    if not latent:
        return mlps
    nope, rot, v = latent["nope_dim"], latent["rope_dim"], latent["v_dim"]
    return dict(c=nope + rot, r=latent["q_rank"], a=latent["kv_rank"] + rot, l=latent["kv_rank"], m=nope + v, t=v,
                **mlps)


def is_deepseek(g: dict) -> bool:
    """An MoE with latent attention: written as deepseek_v3, and only so."""
    return bool(g.get("latent"))


def from_moe(g: dict) -> dict:
    """The deepseek_v3 config.json of an MoE's arguments (every default given); one line where DeepSeek-V3 cannot
    hold them."""
    want = dict(position="rope", norm="rmsnorm", mlp="swiglu", routing="dropless", router="sigmoid",
                score_correction=True, norms="pre", qk_norm="none", qkv_bias=False, bias=False, mlp_bias=False,
                rope_interleaved=True, windows=None, chunks=None, rope_layers=None, embed_scale=False,
                router_bias=False, router_norm=False, expert_scale=False, weigh_inputs=False, shared_gate=False,
                expert_bias=False, swiglu_limit=0.0, beside_d_ff=0, logit_softcap=0.0)
    scaling = g.get("rope_scaling") or {}
    refuse_unlike(g, want, {"rope_scaling": scaling} if scaling and scaling.get("rope_type") != "yarn" else {},
                  KIND, "DeepSeek-V3", "YaRN or no rope_scaling")
    latent = g["latent"]
    rope = {"rope_type": "default", "rope_theta": g["rope_theta"]} if not scaling else \
        {**scaling, "rope_theta": g["rope_theta"]}
    plain = (latent["nope_dim"] + latent["rope_dim"]) ** -0.5
    if g.get("attn_scale") and not math.isclose(g["attn_scale"], plain, rel_tol=1e-12):
        # the softmax scale is YaRN's: plain x mscale(factor, mscale_all_dim)^2, mscale = 0.1 x all_dim x ln f + 1
        if not scaling or scaling["factor"] <= 1 or g["attn_scale"] < plain:
            raise UserError(f"--format hf: attn_scale={g['attn_scale']!r} fits no {KIND} config.json: its softmax "
                            f"scale is 1/sqrt({latent['nope_dim'] + latent['rope_dim']}), or with YaRN that times "
                            "YaRN's mscale squared")
        rope["mscale_all_dim"] = (math.sqrt(g["attn_scale"] / plain) - 1) / (0.1 * math.log(scaling["factor"]))
    return dict(model_type=KIND, architectures=[ARCHITECTURE], **shared_config(g), num_key_value_heads=g["n_heads"],
                kv_lora_rank=latent["kv_rank"], q_lora_rank=latent["q_rank"] or None,
                qk_rope_head_dim=latent["rope_dim"], v_head_dim=latent["v_dim"], qk_nope_head_dim=latent["nope_dim"],
                rope_parameters=rope, rope_interleave=True, attention_bias=g["attn_bias"])


def refuse_unlike(g: dict, want: dict, wrong: dict, kind: str, family: str, also: str) -> None:
    """One line where an MoE's arguments `g` differ from what `family`'s config.json (`kind`) can hold: the options in
    `want` that differ, then `wrong` (found by the caller, `also` saying what is allowed there), then shared experts
    wider than the routed ones (DeepSeek-V3's and GLM-4.5's are as wide)."""
    wrong = {**{k: g.get(k) for k, v in want.items() if (g.get(k) or None) != (v or None)}, **wrong}
    if g.get("shared_experts", 0) and g.get("shared_d_ff") not in (0, None, g["d_ff"]):
        wrong["shared_d_ff"] = g["shared_d_ff"]
    if wrong:
        raise UserError(f"--format hf: {', '.join(f'{k}={v!r}' for k, v in wrong.items())} fits no {kind} config.json: "
                        f"{family} has {', '.join(f'{k}={v!r}' for k, v in want.items() if k in wrong)}, {also}, "
                        "shared experts as wide as the routed ones")


def shared_config(g: dict) -> dict:
    """The config.json fields DeepSeek-V3 and GLM-4.5 write alike: the sizes, the experts and their router."""
    return dict(vocab_size=g["vocab_size"], hidden_size=g["d_model"],
                intermediate_size=g.get("dense_d_ff") or g["d_ff"], moe_intermediate_size=g["d_ff"],
                num_hidden_layers=g["n_layers"], num_attention_heads=g["n_heads"],
                n_shared_experts=g.get("shared_experts", 0), n_routed_experts=g["n_experts"],
                routed_scaling_factor=float(g.get("routed_scaling", 1.0)), n_group=g.get("n_group", 1),
                topk_group=g.get("topk_group", 1), num_experts_per_tok=g["top_k"],
                first_k_dense_replace=g.get("dense_layers", 0), norm_topk_prob=g["norm_topk"], hidden_act="silu",
                max_position_embeddings=g["max_len"], rms_norm_eps=g["norm_eps"],
                tie_word_embeddings=g["tie_embeddings"], torch_dtype="float32", pad_token_id=None, bos_token_id=None,
                eos_token_id=None, num_nextn_predict_layers=g.get("mtp_depth", 0))
