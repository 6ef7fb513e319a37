"""Gemma 4's text model (`gemma4_text`, and a `gemma4` folder's text_config) <-> the GPT's arguments.

Gemma 4 is Gemma 3's layers (four norms, head norms, sliding layers by layer_types, a soft-capped output) with
RMSNorm as x * w, attention unscaled with the values normed too, global layers of their own width
(global_head_dim, num_global_key_value_heads, values from the keys' projection with attention_k_eq_v, proportional
RoPE), the last num_kv_shared_layers layers reusing earlier layers' keys and values (their MLP twice as wide with
use_double_wide_mlp), per-layer embeddings (hidden_size_per_layer_input) and a scalar per layer: the GPT's options of
models/mixed.py. What this reader does not implement (the mixture-of-experts block, bidirectional attention,
another RoPE) is refused in one line naming the field.
"""

from shard.errors import UserError, warn
from shard.hf.config_in import typed
from shard.hf.typed_rope import LAYER_TYPES, is_number

KIND = "gemma4_text"
ARCHITECTURE = "Gemma4ForCausalLM"
# transformers 5's Gemma4TextConfig defaults for the fields read here
DEFAULTS = dict(vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                sliding_window=512, layer_types=None, final_logit_softcapping=None, use_bidirectional_attention=None,
                vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
                num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, global_head_dim=512,
                num_global_key_value_heads=None, rope_parameters=None, num_experts=None, top_k_experts=None,
                moe_intermediate_size=None)
_TYPES = dict(hidden_activation=str, rms_norm_eps=float, tie_word_embeddings=bool, attention_bias=bool,
              layer_types=list, final_logit_softcapping=float, attention_k_eq_v=bool, enable_moe_block=bool,
              use_double_wide_mlp=bool, rope_parameters=dict)
_NULLABLE = {"layer_types", "final_logit_softcapping", "use_bidirectional_attention", "num_global_key_value_heads",
             "rope_parameters", "hidden_size_per_layer_input", "num_experts", "top_k_experts",
             "moe_intermediate_size"}
# each layer type's RoPE where rope_parameters leaves it out (Gemma4TextConfig's)
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh")


def to_gpt(c: dict, where: str) -> dict:
    """The GPT's arguments of a gemma4_text config.json."""
    get = typed(c, DEFAULTS, _TYPES, _NULLABLE, where)

    if get("use_bidirectional_attention"):
        raise UserError(f"{where}: config.json has use_bidirectional_attention={get('use_bidirectional_attention')!r},"
                        f" which is not implemented for {KIND} (supported: null)")
    n, d, heads = get("num_hidden_layers"), get("hidden_size"), get("num_attention_heads")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "head_dim", "num_key_value_heads", "global_head_dim"):
        if not get(name):
            raise UserError(f"{where}: config.json has {name}=0; it must be at least 1")
    kv, global_kv = get("num_key_value_heads"), get("num_global_key_value_heads")
    k_eq_v = get("attention_k_eq_v")
    global_kv = global_kv if k_eq_v else None  # transformers reads it only with attention_k_eq_v
    types = _layer_types(get, n, where)
    global_dim, global_kv = _per_layer(c, types, get("global_head_dim"), global_kv, where)
    for name, value in (("num_key_value_heads", kv), ("num_global_key_value_heads", global_kv)):
        if value is not None and (not value or heads % value):
            raise UserError(f"{where}: config.json has {name}={value}; num_attention_heads={heads} must be a "
                            "multiple of it")
    act = get("hidden_activation")
    if act not in TANH_GELU:
        raise UserError(f"{where}: config.json has hidden_activation={act!r}, which is not supported for {KIND} "
                        f"(supported: {', '.join(TANH_GELU)})")
    window = get("sliding_window")
    if "sliding_attention" in types and window < 1:
        raise UserError(f"{where}: config.json has sliding_window={window}; a window holds at least one token")
    shared = get("num_kv_shared_layers")
    if shared >= n or shared and not set(types[n - shared:]) <= set(types[:n - shared]):
        raise UserError(f"{where}: config.json has num_kv_shared_layers={shared}; the layers before the shared ones "
                        f"must compute every layer type's keys and values ({n} layers, types {sorted(set(types))})")
    theta, scaling, local_theta = _rope(get, where)
    cap = get("final_logit_softcapping")
    if cap is not None and cap <= 0:
        raise UserError(f"{where}: config.json has final_logit_softcapping={cap!r}; it must be positive (or null)")
    per_layer = get("hidden_size_per_layer_input") or 0
    out = dict(vocab_size=get("vocab_size"), d_model=d, n_layers=n, n_heads=heads, n_kv_heads=kv,
               d_ff=get("intermediate_size"), head_dim=get("head_dim"), max_len=get("max_position_embeddings"),
               position="rope", norm="rmsnorm", mlp="geglu", norm_eps=float(get("rms_norm_eps")),
               tie_embeddings=get("tie_word_embeddings"), embed_scale=True, norms="both", qk_norm="head",
               attn_scale=1.0, v_norm=True, layer_scalar=True, attn_bias=get("attention_bias"),
               rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
               rope_layers=[2 if t == "sliding_attention" else 1 for t in types],
               windows=[window if t == "sliding_attention" else 0 for t in types],
               global_head_dim=global_dim, values_from_keys=k_eq_v,
               shared_kv_layers=shared, wide_shared_mlp=get("use_double_wide_mlp") and shared > 0)
    if global_kv:
        out["global_kv_heads"] = global_kv
    if per_layer:
        out.update(per_layer_dim=per_layer, per_layer_vocab=get("vocab_size_per_layer_input"))
    if cap:
        out["logit_softcap"] = float(cap)
    if get("enable_moe_block"):
        out.update(_experts(get, where, out["d_ff"]))
    if "full_attention" not in types:
        out["rope_scaling"], out["rope_theta"] = None, local_theta  # no layer rotates by it
    return out


def _experts(get, where: str, dense_ff: int) -> dict:
    """The MoE's options of Gemma 4's MoE block (enable_moe_block): in every layer num_experts experts of
    moe_intermediate_size (GeGLU, as the dense MLP) beside the dense MLP of intermediate_size, each token to its
    top_k_experts by a softmax over all, renormalised, times the chosen expert's per_expert_scale; the router's input
    normed without a weight, times its scale and 1/sqrt(hidden_size). Every token computed by its experts (dropless),
    as transformers does; transformers adds no balancing loss to Gemma 4's training loss, nor does this."""
    n, k, width = get("num_experts"), get("top_k_experts"), get("moe_intermediate_size")
    for name, value in (("num_experts", n), ("top_k_experts", k), ("moe_intermediate_size", width)):
        if not value:
            raise UserError(f"{where}: config.json has {name}={value!r} with enable_moe_block=true; it must be at "
                            "least 1")
    if k > n:
        raise UserError(f"{where}: config.json has top_k_experts={k}, more than num_experts={n}")
    return dict(n_experts=n, top_k=k, d_ff=width, beside_d_ff=dense_ff, routing="dropless", router="softmax_topk",
                norm_topk=True, router_norm=True, expert_scale=True, aux_loss_weight=0.0)


def _per_layer(c: dict, types: list, global_dim: int, global_kv: int | None, where: str) -> tuple:
    """(the full layers' head size, their key/value heads or None): per_layer_config (layer -> head_dim and
    num_key_value_heads, as transformers saves its config) where config.json has it, else global_head_dim and
    num_global_key_value_heads, as the config class makes it. Every full layer alike, the others none."""
    given = c.get("per_layer_config")
    if given is None:
        return global_dim, global_kv
    full = {str(i) for i, t in enumerate(types) if t == "full_attention"}
    entries = list(given.values()) if isinstance(given, dict) else []
    if not isinstance(given, dict) or set(given) != full or any(
            not isinstance(e, dict) or not set(e) <= {"head_dim", "num_key_value_heads"} or e != entries[0]
            for e in entries):
        raise UserError(f"{where}: config.json has per_layer_config={given!r}; {KIND} reads the same head_dim (and "
                        f"num_key_value_heads) for each full_attention layer ({', '.join(sorted(full, key=int))}), "
                        "nothing for the others")
    one = entries[0] if entries else {}
    for name, value in one.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{where}: config.json has per_layer_config {name}={value!r}; it must be at least 1")
    return one.get("head_dim", 0), one.get("num_key_value_heads")


def _layer_types(get, n: int, where: str) -> list[str]:
    """layer_types, by default five sliding layers to one full; the last layer full whatever they say (transformers
    forces it, with a warning: so does this reader)."""
    types = get("layer_types")
    types = list(types) if types is not None else [LAYER_TYPES[(i + 1) % 6 != 0] for i in range(n)]
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise UserError(f"{where}: config.json has layer_types={types!r}; {KIND} reads one of "
                        f"{', '.join(LAYER_TYPES)} per layer, {n} in all")
    if types[-1] != "full_attention":
        warn(f"{where}: config.json's last layer is {types[-1]}; transformers makes it full_attention, and so "
             "does this reader")
        types[-1] = "full_attention"
    return types


def _rope(get, where: str) -> tuple[float, dict | None, float]:
    """(the full layers' theta, their scaling, the sliding layers' theta): rope_parameters per layer type, the
    sliding layers' RoPE plain, the full layers' plain or proportional."""
    given = get("rope_parameters") or {}
    if not set(given) <= set(LAYER_TYPES):
        raise UserError(f"{where}: config.json has rope_parameters={given!r}; {KIND} reads one mapping per layer "
                        f"type ({', '.join(LAYER_TYPES)})")
    params = {t: dict(given.get(t) or ROPE[t]) for t in LAYER_TYPES}
    for t, p in params.items():
        kind, theta = p.get("rope_type", "default"), p.get("rope_theta")
        allowed = ("default",) if t == "sliding_attention" else ("default", "proportional")
        if kind not in allowed:
            raise UserError(f"{where}: config.json has {t} rope_type={kind!r}, which is not supported for {KIND} "
                            f"(supported: {', '.join(allowed)})")
        if not is_number(theta) or theta <= 0:
            raise UserError(f"{where}: config.json has {t} rope_theta={theta!r}; it must be a positive number")
    full = params["full_attention"]
    scaling = None
    if full.get("rope_type") == "proportional":
        fraction, factor = full.get("partial_rotary_factor", 1.0), full.get("factor", 1.0)
        for name, value in (("partial_rotary_factor", fraction), ("factor", factor)):
            if not is_number(value) or value <= 0 or name == "partial_rotary_factor" and value > 1:
                raise UserError(f"{where}: config.json has full_attention {name}={value!r}; it must be a positive "
                                f"number{' up to 1' if name == 'partial_rotary_factor' else ''}")
        scaling = dict(rope_type="proportional", partial_rotary_factor=float(fraction), factor=float(factor))
    return float(full["rope_theta"]), scaling, float(params["sliding_attention"]["rope_theta"])


# The GPT options only Gemma 4's layers have: a GPT with any of them is written as gemma4_text, and only so
OPTIONS = ("global_head_dim", "global_kv_heads", "values_from_keys", "v_norm", "shared_kv_layers", "wide_shared_mlp",
           "per_layer_dim", "per_layer_vocab", "layer_scalar")


def is_gemma4(g: dict) -> bool:
    return any(g.get(name) for name in OPTIONS)


def from_gpt(g: dict, moe: dict | None = None) -> dict:
    """The gemma4_text config.json of a GPT's arguments (with_defaults'), or with `moe` (an MoE's arguments) its MoE
    block's; one line naming what Gemma 4 cannot hold."""
    want = dict(position="rope", norm="rmsnorm", mlp="geglu", embed_scale=True, norms="both", qk_norm="head",
                attn_scale=1.0, v_norm=True, layer_scalar=True, qkv_bias=False, bias=False, mlp_bias=False,
                attn_sinks=False, rope_interleaved=False, rotary_dim=0, attn_softcap=0.0, chunks=None,
                attn_temperature_floor=0.0)
    wrong = {k: g[k] for k, v in want.items() if (g[k] or None) != (v or None)}
    n = g["n_layers"]
    windows = list(g["windows"] or [0] * n)
    rotations = list(g["rope_layers"] or [1] * n)
    sizes = {w for w in windows if w}
    if len(sizes) > 1 or [2 if w else 1 for w in windows] != rotations or windows[-1]:
        wrong["windows/rope_layers"] = (windows, rotations)
    scaling = g["rope_scaling"]
    if scaling is not None and scaling.get("rope_type") != "proportional":
        wrong["rope_scaling"] = scaling
    if g["values_from_keys"] and g["qkv_bias"] or g["wide_shared_mlp"] and not g["shared_kv_layers"]:
        wrong["values_from_keys/wide_shared_mlp"] = (g["values_from_keys"], g["wide_shared_mlp"])
    if g["global_kv_heads"] and not g["values_from_keys"]:
        wrong["global_kv_heads"] = g["global_kv_heads"]  # transformers reads it only with attention_k_eq_v
    experts = {}
    if moe is not None:
        block = dict(router="softmax_topk", norm_topk=True, router_norm=True, expert_scale=True, router_bias=False,
                     n_group=1, topk_group=1, routed_scaling=1.0, score_correction=False, weigh_inputs=False,
                     shared_experts=0, dense_layers=0, expert_bias=False, swiglu_limit=0.0)
        wrong.update({k: moe[k] for k, v in block.items() if k in moe and moe[k] != v})
        if not moe.get("beside_d_ff"):
            wrong["beside_d_ff"] = moe.get("beside_d_ff", 0)
        experts = dict(enable_moe_block=True, num_experts=moe.get("n_experts", 8), top_k_experts=moe.get("top_k", 2),
                       moe_intermediate_size=g["d_ff"], intermediate_size=moe.get("beside_d_ff"))
        want.update(block)
    if wrong:
        raise UserError(f"--format hf: {', '.join(f'{k}={v!r}' for k, v in wrong.items())} fits no {KIND} "
                        f"config.json: Gemma 4 has {', '.join(f'{k}={v!r}' for k, v in want.items() if k in wrong)}, "
                        "one sliding window on the layers that rotate by local_rope_theta (2) and a global last layer, "
                        "proportional or plain RoPE, global_kv_heads only with values_from_keys, and a wide MLP only "
                        "on shared layers")
    full = {"rope_type": "default", "rope_theta": g["rope_theta"]} if scaling is None else \
        {**{k: v for k, v in scaling.items() if k != "factor" or v != 1.0}, "rope_theta": g["rope_theta"]}
    out = dict(model_type=KIND, architectures=[ARCHITECTURE], vocab_size=g["vocab_size"], hidden_size=g["d_model"],
                intermediate_size=g["d_ff"], num_hidden_layers=n, num_attention_heads=g["n_heads"],
                num_key_value_heads=g["n_kv_heads"], head_dim=g["head_dim"],
                global_head_dim=g["global_head_dim"] or g["head_dim"],
                num_global_key_value_heads=g["global_kv_heads"] or None, attention_k_eq_v=g["values_from_keys"],
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=g["max_len"],
                rms_norm_eps=g["norm_eps"], tie_word_embeddings=g["tie_embeddings"], attention_bias=g["attn_bias"],
                sliding_window=min(sizes) if sizes else DEFAULTS["sliding_window"],
                layer_types=[LAYER_TYPES[bool(w)] for w in windows],
                rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": (
                    g["local_rope_theta"] or ROPE["sliding_attention"]["rope_theta"])}},
                final_logit_softcapping=g["logit_softcap"] or None, use_bidirectional_attention=None,
                hidden_size_per_layer_input=g["per_layer_dim"],
                vocab_size_per_layer_input=g["per_layer_vocab"] or g["vocab_size"],
                num_kv_shared_layers=g["shared_kv_layers"], use_double_wide_mlp=g["wide_shared_mlp"],
                enable_moe_block=False, torch_dtype="float32")
    return {**out, **experts}
