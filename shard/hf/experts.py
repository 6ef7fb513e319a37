"""Mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE): config.json <-> the library MoE's arguments.

Their attention, norms and RoPE are their dense relatives' (Mistral's, Qwen3's; OLMoE's a Llama's with q/k norms
over the whole projection, qk_norm=projection), read and written by config_in.py and config_out.py; this module
reads and writes the experts. Each family routes as transformers does: a softmax over all experts in float32,
the top num_experts_per_tok taken, their weights renormalised (Mixtral always; Qwen3-MoE with norm_topk_prob),
every token computed by each of its experts (routing=dropless: no capacity, no token dropped).

The load-balancing loss: transformers adds router_aux_loss_coef x its load_balancing_loss_func to the training
loss only where output_router_logits is true, so the import sets aux_loss_weight to the coefficient then (with
balancing=pooled, that function's form) and to 0 otherwise. Mixtral's router_jitter_noise multiplies the
router's input by noise in transformers' training mode only: a regulariser like dropout, not read. OLMoE's
clip_qkv (clamping queries, keys and values) is refused in one line where set.
"""

from shard.errors import UserError
from shard.hf import config_in, config_out, deepseek, glm

# Each family's dense relative: the architecture whose attention and norms it has (config_in.py reads them), and the
# one config_out.py exports a model with those to.
RELATIVE = {"mixtral": "mistral", "qwen3_moe": "qwen3", "olmoe": "llama", "gpt_oss": "gpt_oss",
            "llama4_text": "llama4_text"}
EXPORTED = {"llama": "mixtral", "qwen3": "qwen3_moe"}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "llama4_text": "Llama4ForCausalLM"}
# transformers 5's defaults (configuration_<model_type>.py) for every field read, where config.json leaves one out
DEFAULTS = {
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                    max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    sliding_window=None, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2,
                    output_router_logits=False, router_aux_loss_coef=0.001),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=None, hidden_act="silu",
                      max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      attention_bias=False, use_sliding_window=False, sliding_window=4096, rope_theta=10000.0,
                      decoder_sparse_step=1, moe_intermediate_size=768, num_local_experts=128, num_experts_per_tok=8,
                      norm_topk_prob=False, output_router_logits=False, router_aux_loss_coef=0.001,
                      mlp_only_layers=None),
    "olmoe": dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                  rope_theta=10000.0, clip_qkv=None, num_local_experts=64, num_experts_per_tok=8,
                  output_router_logits=False, router_aux_loss_coef=0.01, norm_topk_prob=False),
    "gpt_oss": dict(num_local_experts=128, num_experts_per_tok=4, output_router_logits=False,
                    router_aux_loss_coef=0.001, swiglu_alpha=1.702, swiglu_limit=7.0),
    "llama4_text": dict(num_local_experts=16, num_experts_per_tok=1, output_router_logits=False,
                        router_aux_loss_coef=0.001, moe_layers=None, interleave_moe_layer_step=1),
}
# GPT-OSS's experts as the MoE's options: its biased router (top-k of the logits, a softmax over those), biases on
# every expert matrix, the clamped SwiGLU (its limit and alpha read from config.json)
GPT_OSS = dict(router="topk_softmax", router_bias=True, expert_bias=True)
# Llama 4's: the top-k logits' sigmoids scale each chosen expert's input, a shared expert of the experts' width beside
LLAMA4 = dict(router="topk_sigmoid", weigh_inputs=True, shared_experts=1)
# Fields the dense relative reads that the family has not: their value in its modeling file (Qwen3-MoE's window,
# where use_sliding_window sets one, is every layer's: its config has no layer_types nor max_window_layers)
NOT_READ = {"olmoe": dict(mlp_bias=False), "qwen3_moe": dict(max_window_layers=0, layer_types=None)}
OLMOE_IDS = dict(pad_token_id=1, eos_token_id=50279)  # OlmoeConfig's defaults: none where past the vocabulary
MOE_ARGS = ("n_experts", "top_k", "capacity_factor", "aux_loss_weight", "routing", "norm_topk", "balancing")


def to_moe(kind: str, config: dict, where: str) -> dict:
    """The MoE's arguments (model.* keys) of a Mixtral or Qwen3-MoE config.json."""
    relative = RELATIVE[kind]
    # num_experts is both families' other name of num_local_experts (their configs' attribute_map)
    c = {**DEFAULTS[kind], **({"num_local_experts": config["num_experts"]} if "num_experts" in config else {}),
         **config, **NOT_READ.get(kind, {})}
    if kind == "olmoe":
        _check_olmoe(c, where)
    kwargs = config_in._rope_model(relative, config_in._fields(relative, c, where), c, where)

    def field(name: str, want: type):
        value = c[name]
        if not isinstance(value, want) or (want is int and (isinstance(value, bool) or value < 1)):
            raise UserError(f"{where}: config.json has {name}={value!r}; transformers reads {name} as "
                            f"{'a positive int' if want is int else 'a ' + want.__name__}")
        return value

    n, k = field("num_local_experts", int), field("num_experts_per_tok", int)
    if k > n:
        raise UserError(f"{where}: config.json has num_experts_per_tok={k}, more than num_local_experts={n}")
    if kind == "qwen3_moe":
        _check_all_sparse(c, kwargs["n_layers"], field, where)
        kwargs["d_ff"] = field("moe_intermediate_size", int)
    if kind == "olmoe":
        if kwargs["n_heads"] * kwargs["head_dim"] != kwargs["d_model"]:
            raise UserError(f"{where}: config.json has head_dim={kwargs['head_dim']} x num_attention_heads="
                            f"{kwargs['n_heads']} != hidden_size={kwargs['d_model']}, the width of OLMoE's query norm")
        kwargs["qk_norm"] = "projection"
    if kind == "gpt_oss":
        limit, alpha = field("swiglu_limit", float), field("swiglu_alpha", float)
        if limit <= 0:
            raise UserError(f"{where}: config.json has swiglu_limit={limit!r}; it must be positive")
        kwargs.update(GPT_OSS, swiglu_limit=limit, swiglu_alpha=alpha)
    if kind == "llama4_text":
        _llama4_layers(c, kwargs["n_layers"], field, where)
        kwargs.update(LLAMA4)
    coef = field("router_aux_loss_coef", float)
    if kind == "llama4_text":  # transformers' Llama 4 adds no load-balancing loss to its training loss
        coef = 0.0
    return dict(kwargs, n_experts=n, top_k=k, routing="dropless", balancing="pooled",
                norm_topk=kind in ("mixtral", "gpt_oss") or kind != "llama4_text" and field("norm_topk_prob", bool),
                aux_loss_weight=coef if field("output_router_logits", bool) else 0.0)


def _llama4_layers(c: dict, n_layers: int, field, where: str) -> None:
    """Llama 4's mixture-of-experts layers (moe_layers, or every interleave_moe_layer_step-th layer): all of them,
    as Scout's; one line for dense layers among them (Maverick's interleaving)."""
    moe = c["moe_layers"]
    if moe is None:
        step = field("interleave_moe_layer_step", int)
        moe = list(range(step - 1, n_layers, step))
    if not isinstance(moe, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in moe):
        raise UserError(f"{where}: config.json has moe_layers={moe!r}; transformers reads a list of layer indices")
    dense = [i for i in range(n_layers) if i not in moe]
    if dense:
        raise UserError(f"{where}: config.json makes layer{'s' * (len(dense) > 1)} {', '.join(map(str, dense[:4]))}"
                        f"{', ...' * (len(dense) > 4)} of {n_layers} dense MLPs among the experts' layers (Llama 4 "
                        "Maverick's interleaving); only models whose every layer is a mixture of experts are supported")


def _check_all_sparse(c: dict, n_layers: int, field, where: str) -> None:
    """Qwen3-MoE's layers are dense MLPs where mlp_only_layers names them or decoder_sparse_step skips them: one
    line for any (the model's blocks are all mixtures of experts)."""
    step, only = field("decoder_sparse_step", int), c["mlp_only_layers"] or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise UserError(f"{where}: config.json has mlp_only_layers={only!r}; transformers reads a list of layer "
                        "indices")
    dense = [i for i in range(n_layers) if i in only or (i + 1) % step]
    if dense:
        name, value = ("mlp_only_layers", only) if only else ("decoder_sparse_step", step)
        raise UserError(f"{where}: config.json has {name}={value!r}, making layer{'s' * (len(dense) > 1)} "
                        f"{', '.join(map(str, dense[:4]))}{', ...' * (len(dense) > 4)} a dense MLP among the experts' "
                        "layers; only models whose every layer is a mixture of experts are supported")


def _check_olmoe(c: dict, where: str) -> None:
    """What OLMoE's attention may have that the MoE has not: clamping, biases (its experts have none)."""
    if c["clip_qkv"] is not None:
        raise UserError(f"{where}: config.json has clip_qkv={c['clip_qkv']!r}; clamping the queries, keys and values "
                        "is not supported (only clip_qkv=null)")
    if c["attention_bias"] is True:
        raise UserError(f"{where}: config.json has attention_bias=true; biases on OLMoE's attention are not supported "
                        "(its experts have none, and the MoE's bias option would put them there too)")


def from_moe(kwargs: dict) -> dict:
    """The config.json of an MoE model's arguments; UserError where no family holds it."""
    routing = _routing_defaults()
    if deepseek.is_deepseek(kwargs):
        return deepseek.from_moe({**_moe_defaults(), **routing, **config_out.with_defaults(kwargs)})
    if glm.is_glm(kwargs):
        return glm.from_moe({**_moe_defaults(), **routing, **config_out.with_defaults(kwargs)})
    if _is_gpt_oss(kwargs, routing):
        return _gpt_oss_config(kwargs)
    if _routes_as(LLAMA4, kwargs, routing):
        return _llama4_config(kwargs)
    changed = [f"{k}={v!r}" for k, v in kwargs.items() if k in routing and v != routing[k]]
    if changed:
        raise UserError(f"--format hf: model 'moe' with {', '.join(changed)} routes as none of the mixture-of-experts "
                        f"architectures written here ({', '.join(RELATIVE)}); leave the MoE's router, shared-expert "
                        "and dense-layer options at their defaults")
    dense = {k: v for k, v in kwargs.items() if k not in MOE_ARGS and k not in routing}
    g = {**_moe_defaults(), **kwargs, **config_out.with_defaults(dense)}
    olmoe = g["qk_norm"] == "projection" and g["norms"] == "pre"  # a Llama's attention, q/k normed over all heads
    if olmoe:
        dense = {**dense, "qk_norm": "none"}
    kind = EXPORTED.get(config_out._kind({**g, **dense}))
    if olmoe:
        kind = "olmoe" if kind == "mixtral" and g["n_heads"] * g["head_dim"] == g["d_model"] \
            and not any(g["windows"] or []) else None  # OLMoE's attention is global
    if kind == "qwen3_moe" and any(g["windows"] or []) and not all(g["windows"]):
        kind = None  # its window is every layer's
    if kind == "mixtral" and not g["norm_topk"]:
        kind = None  # Mixtral always renormalises
    if kind is None or g["routing"] != "dropless":
        raise UserError(f"--format hf: model 'moe' with these options is none of the mixture-of-experts "
                        f"architectures a Hugging Face folder can hold ({', '.join(RELATIVE)}): they need "
                        "routing=dropless (transformers drops no token), position=rope, norm=rmsnorm, mlp=swiglu, "
                        "no biases; Mixtral norm_topk=true, Qwen3-MoE qk_norm=head, OLMoE qk_norm=projection "
                        "with n_heads x head_dim = d_model and no windows; Qwen3-MoE's windows on every layer or "
                        "none")
    config = config_out.dense_from_gpt(dense, "gpt")
    config.update(model_type=kind, architectures=[ARCHITECTURES[kind]], num_local_experts=g["n_experts"],
                  num_experts_per_tok=g["top_k"], router_aux_loss_coef=float(g["aux_loss_weight"]),
                  output_router_logits=g["balancing"] == "pooled" and g["aux_loss_weight"] > 0)
    if kind != "qwen3_moe":
        for name in ("attention_bias", "mlp_bias"):  # not Mixtral's fields, nor OLMoE's MLP's (all false here)
            config.pop(name, None)
    if kind == "olmoe":
        config.update(norm_topk_prob=g["norm_topk"], clip_qkv=None,
                      **{k: None for k, v in OLMOE_IDS.items() if v >= g["vocab_size"]})
    if kind == "qwen3_moe":
        config.update(moe_intermediate_size=g["d_ff"], norm_topk_prob=g["norm_topk"], decoder_sparse_step=1,
                      mlp_only_layers=[])
    return config


def _moe_defaults() -> dict:
    import inspect

    from shard.models.moe import MoE

    return {k: p.default for k, p in inspect.signature(MoE.__init__).parameters.items() if k in MOE_ARGS}


def _routing_defaults() -> dict:
    """The MoE's options no family here has (its other routers, shared experts, dense layers), with their defaults."""
    import inspect

    from shard.models.gpt import GPT
    from shard.models.moe import MoE

    gpt = inspect.signature(GPT.__init__).parameters
    return {k: p.default for k, p in inspect.signature(MoE.__init__).parameters.items()
            if k not in gpt and k not in MOE_ARGS and p.default is not inspect.Parameter.empty}


def _routes_as(options: dict, kwargs: dict, routing: dict, free: tuple = ()) -> bool:
    """Whether an MoE has a family's routing `options` and every other routing option (but `free`) at its default."""
    ours = {k: kwargs.get(k, routing[k]) for k in routing}
    return all(ours[k] == v for k, v in options.items()) and \
        all(ours[k] == routing[k] for k in routing if k not in (*options, *free))


def _is_gpt_oss(kwargs: dict, routing: dict) -> bool:
    """An MoE with GPT-OSS's router and experts (its other options checked by _gpt_oss_config)."""
    return _routes_as(GPT_OSS, kwargs, routing, ("swiglu_limit", "swiglu_alpha")) and \
        kwargs.get("swiglu_limit", 0) > 0


def _newer_family(kwargs: dict, kind: str, own: set[str], fits, needs: str) -> tuple[dict, dict]:
    """(the MoE's arguments with every default, config.json's fields both GPT-OSS and Llama 4 write) of an MoE with
    `kind`'s router and experts; one line where its attention is not that family's: a Llama's (rope, RMSNorm, SwiGLU,
    pre-norms, dropless, q/k/v/o biases or none, every channel rotated, no soft-caps) with no option of the other
    family's (`own`: those of the newer options it may set) and `fits(g)` true; `needs` says what it takes."""
    g = {**_moe_defaults(), **_routing_defaults(), **config_out.with_defaults(kwargs)}
    llama = (g["position"], g["norm"], g["mlp"], g["norms"], g["routing"]) == \
        ("rope", "rmsnorm", "swiglu", "pre", "dropless") and not (g["qkv_bias"] and not g["attn_bias"]) and \
        not (g["bias"] or g["mlp_bias"] or g["embed_scale"]) and g["rotary_dim"] in (0, g["head_dim"]) and \
        not (g["attn_softcap"] or g["logit_softcap"] or g["attn_scale"] or g["local_rope_theta"])
    if not (llama and config_out.newer_attention(g) <= own and fits(g)):
        raise UserError(f"--format hf: model 'moe' with {kind}'s router and experts is a {kind} folder only with its "
                        "attention: position=rope, norm=rmsnorm, mlp=swiglu, routing=dropless, no biases but "
                        f"attn_bias, {needs}")
    common = dict(model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=g["vocab_size"],
                  hidden_size=g["d_model"], num_hidden_layers=g["n_layers"], num_attention_heads=g["n_heads"],
                  num_key_value_heads=g["n_kv_heads"], head_dim=g["head_dim"], intermediate_size=g["d_ff"],
                  max_position_embeddings=g["max_len"], rms_norm_eps=g["norm_eps"], hidden_act="silu",
                  attention_bias=g["attn_bias"], tie_word_embeddings=g["tie_embeddings"],
                  num_local_experts=g["n_experts"], num_experts_per_tok=g["top_k"], torch_dtype="float32",
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return g, common


def _rope_fields(g: dict, scaling_kind: str) -> dict:
    """rope_parameters: the family's one scaling kind or none, with the base."""
    scaling = dict(g["rope_scaling"] or {})
    scaling.pop("rope_type", None)
    return dict(rope_type=scaling_kind, **scaling) if scaling else dict(rope_type="default")


def _gpt_oss_config(kwargs: dict) -> dict:
    """GPT-OSS's config.json: its attention with sinks, every other layer or none sliding, YaRN or no scaling."""
    def fits(g):
        return g["attn_sinks"] and g["qk_norm"] == "none" and g["rope_layers"] is None and \
            len({w for w in g["windows"] or [] if w}) <= 1 and \
            (g["rope_scaling"] or {}).get("rope_type", "yarn") == "yarn"

    g, common = _newer_family(kwargs, "gpt_oss", {"attn_sinks", "attn_bias"}, fits,
                              "attn_sinks=true, one window on the sliding layers or none, yarn or no rope_scaling")
    windows = list(g["windows"] or [0] * g["n_layers"])
    sizes = sorted({w for w in windows if w})
    return dict(common, rope_parameters=dict(_rope_fields(g, "yarn"), rope_theta=g["rope_theta"]),
                layer_types=[config_in.LAYER_TYPES[bool(w)] for w in windows],
                sliding_window=sizes[0] if sizes else None, router_aux_loss_coef=float(g["aux_loss_weight"]),
                output_router_logits=g["balancing"] == "pooled" and g["aux_loss_weight"] > 0,
                swiglu_limit=float(g["swiglu_limit"]), swiglu_alpha=float(g["swiglu_alpha"]))


def _llama4_config(kwargs: dict) -> dict:
    """Llama 4's text config.json: its attention (interleaved RoPE, the weightless q/k norm, temperature tuning on the
    layers without RoPE, one chunk size on the chunked layers), every layer a mixture of experts with a shared one."""
    def fits(g):
        return g["rope_interleaved"] and g["qk_norm"] in ("l2", "none") and set(g["rope_layers"] or [1]) <= {0, 1} \
            and len({c for c in g["chunks"] or [] if c}) <= 1 and not any(g["windows"] or []) and \
            (g["rope_scaling"] or {}).get("rope_type", "llama3") == "llama3" and \
            g["shared_d_ff"] in (0, g["d_ff"]) and float(g["attn_temperature_floor"]).is_integer()

    g, common = _newer_family(kwargs, "llama4_text", {"attn_bias", "rope_interleaved", "attn_temperature_floor",
                                                      "chunks"}, fits,
                              "rope_interleaved=true, qk_norm l2 or none, rope_layers of 0 and 1, one chunk size, no "
                              "windows, Llama 3's or no rope_scaling, a whole attn_temperature_floor, shared_d_ff = "
                              "d_ff")
    chunks = list(g["chunks"] or [0] * g["n_layers"])
    sizes = sorted({c for c in chunks if c})
    floor = g["attn_temperature_floor"]
    return dict(common, intermediate_size_mlp=g["d_ff"],
                rope_parameters=dict(_rope_fields(g, "llama3"), rope_theta=g["rope_theta"]),
                no_rope_layers=list(g["rope_layers"] or [1] * g["n_layers"]), use_qk_norm=g["qk_norm"] == "l2",
                attn_temperature_tuning=bool(floor), floor_scale=int(floor or 8192),
                attn_scale=float(g["attn_temperature_scale"]), attention_chunk_size=sizes[0] if sizes else None,
                layer_types=["chunked_attention" if c else "full_attention" for c in chunks],
                moe_layers=list(range(g["n_layers"])), interleave_moe_layer_step=1, output_router_logits=False,
                router_aux_loss_coef=0.001)
