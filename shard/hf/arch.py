"""config.json <-> the library GPT's arguments, for each supported architecture (`model_type`).

Reading keeps what changes the numbers exact; what the GPT cannot do (another activation, RoPE scaling
other than Llama 3's, biases on some layers only) is refused in one line rather than loaded approximately.
Mistral's and Qwen2's sliding window is honoured by capping max_len at it: within the window the
attention is the full causal one.
"""

from shard.errors import UserError

SUPPORTED = ("llama", "mistral", "qwen2", "gemma", "gpt2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gpt2": "GPT2LMHeadModel"}
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # one function: 0.5 x (1 + tanh(...))
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def model_type(config: dict, where: str) -> str:
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise UserError(f"{where}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return kind


def to_gpt(config: dict, where: str) -> dict:
    """The GPT arguments (model.* keys) of a Hugging Face config.json."""
    kind = model_type(config, where)
    try:
        return _GPT2(config, where) if kind == "gpt2" else _rope_model(kind, config, where)
    except KeyError as e:
        raise UserError(f"{where}: config.json lacks {e.args[0]!r}, which a {kind} model needs") from None


def _rope_model(kind: str, c: dict, where: str) -> dict:
    heads = c["num_attention_heads"]
    act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
    gated = {"silu": "swiglu", **{a: "geglu" for a in TANH_GELU}}.get(act)
    if gated is None or (kind == "gemma") != (gated == "geglu"):
        raise UserError(f"{where}: hidden_act {act!r} is not supported for {kind} "
                        f"(supported: {'gelu_pytorch_tanh' if kind == 'gemma' else 'silu'})")
    attention_bias, mlp_bias = bool(c.get("attention_bias")), bool(c.get("mlp_bias"))
    if attention_bias != mlp_bias:
        raise UserError(f"{where}: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported "
                        "(biases on every linear layer or on none)")
    max_len = c.get("max_position_embeddings", 2048)
    window = c.get("sliding_window") if kind == "mistral" or c.get("use_sliding_window") else None
    theta, scaling = _rope(c, where)
    return dict(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads, d_ff=c["intermediate_size"],
                head_dim=c.get("head_dim") or c["hidden_size"] // heads, max_len=min(max_len, window or max_len),
                position="rope", norm="rmsnorm+1" if kind == "gemma" else "rmsnorm", mlp=gated,
                norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                tie_embeddings=bool(c.get("tie_word_embeddings", kind == "gemma")),
                qkv_bias=kind == "qwen2", bias=attention_bias, embed_scale=kind == "gemma")


def _rope(c: dict, where: str) -> tuple[float, dict | None]:
    """(theta, Llama 3 scaling or None) from rope_parameters (transformers 5) or rope_theta + rope_scaling."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UserError(f"{where}: RoPE scaling {kind!r} is not supported (supported: none, llama3)")
    return theta, {k: float(params[k]) if k != LLAMA3_KEYS[-1] else int(params[k]) for k in LLAMA3_KEYS}


def _GPT2(c: dict, where: str) -> dict:
    act = c.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        raise UserError(f"{where}: activation_function {act!r} is not supported for gpt2 (supported: gelu_new)")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if c.get(flag):
            raise UserError(f"{where}: {flag}=true is not supported for gpt2")
    d = c["n_embd"]
    return dict(vocab_size=c["vocab_size"], d_model=d, n_layers=c["n_layer"], n_heads=c["n_head"],
                d_ff=c.get("n_inner") or 4 * d, max_len=c["n_positions"], position="learned", norm="layernorm",
                mlp="gelu", bias=True, norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
                tie_embeddings=bool(c.get("tie_word_embeddings", True)))


# ----------------------------------------------------------------------------- the other way

def from_gpt(kwargs: dict, model_name: str) -> dict:
    """The config.json of a run's model (its model.name and arguments); UserError where it is none of SUPPORTED."""
    g = _with_defaults(kwargs)
    kind = _kind(g) if model_name == "gpt" else None
    if kind is None:
        raise UserError(f"--format hf: model {model_name!r} with these options is none of the architectures a "
                        f"Hugging Face folder can hold ({', '.join(SUPPORTED)}): GPT-2 needs position=learned, "
                        "norm=layernorm, mlp=gelu, bias=true; the others position=rope with rmsnorm and swiglu "
                        "(Llama, Qwen2 with qkv_bias) or rmsnorm+1, geglu and embed_scale (Gemma)")
    common = dict(model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=g["vocab_size"],
                  tie_word_embeddings=g["tie_embeddings"], torch_dtype="float32")
    if kind == "gpt2":
        return dict(common, n_embd=g["d_model"], n_layer=g["n_layers"], n_head=g["n_heads"], n_inner=g["d_ff"],
                    n_positions=g["max_len"], layer_norm_epsilon=g["norm_eps"], activation_function="gelu_new")
    rope = {"rope_type": "default", "rope_theta": g["rope_theta"]}
    if g["rope_scaling"]:
        rope = dict(g["rope_scaling"], rope_type="llama3", rope_theta=g["rope_theta"])
    return dict(common, hidden_size=g["d_model"], num_hidden_layers=g["n_layers"], num_attention_heads=g["n_heads"],
                num_key_value_heads=g["n_kv_heads"], intermediate_size=g["d_ff"], head_dim=g["head_dim"],
                max_position_embeddings=g["max_len"], rms_norm_eps=g["norm_eps"], rope_theta=g["rope_theta"],
                rope_parameters=rope, rope_scaling=rope if g["rope_scaling"] else None,
                hidden_act="gelu_pytorch_tanh" if kind == "gemma" else "silu",
                attention_bias=g["bias"], mlp_bias=g["bias"])


def _with_defaults(kwargs: dict) -> dict:
    import inspect

    from shard.models.gpt import GPT

    defaults = {k: p.default for k, p in inspect.signature(GPT.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    g = {**defaults, **kwargs}
    g["n_kv_heads"] = g["n_kv_heads"] or g["n_heads"]
    g["head_dim"] = g["head_dim"] or g["d_model"] // g["n_heads"]
    g["d_ff"] = g["d_ff"] or (4 * g["d_model"] if g["mlp"] == "gelu" else 8 * g["d_model"] // 3)
    return g


def _kind(g: dict) -> str | None:
    if (g["position"], g["norm"], g["mlp"]) == ("learned", "layernorm", "gelu"):
        return "gpt2" if g["bias"] and not g["embed_scale"] and g["n_kv_heads"] == g["n_heads"] \
            and g["head_dim"] * g["n_heads"] == g["d_model"] else None
    if g["position"] != "rope" or g["embed_scale"] != (g["norm"] == "rmsnorm+1"):
        return None
    if (g["norm"], g["mlp"]) == ("rmsnorm+1", "geglu"):
        return "gemma" if not (g["qkv_bias"] or g["bias"] or g["rope_scaling"]) else None
    if (g["norm"], g["mlp"]) == ("rmsnorm", "swiglu"):
        if g["qkv_bias"] and not g["bias"]:
            return "qwen2" if not g["rope_scaling"] else None
        return "llama"
    return None
