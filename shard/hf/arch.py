"""config.json <-> the library GPT's arguments, for each supported architecture (`model_type`).

Reading gives each field the meaning transformers 5 gives it: its defaults where a field is left out, its types
(a value transformers refuses is refused here, in one line naming the field), its legacy spellings. What the
GPT cannot do exactly (another activation, RoPE scaling other than Llama 3's, biases on attention alone) is
refused in one line rather than loaded approximately. Mistral's and Qwen2's sliding window is honoured by
capping max_len at it: within the window the attention is the full causal one. Dropout rates are training
settings of transformers' own loop, not of the model, and are not read.
"""

from shard.errors import UserError

SUPPORTED = ("llama", "mistral", "qwen2", "gemma", "gpt2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gpt2": "GPT2LMHeadModel"}
SILU = ("silu", "swish")  # transformers' two names of one function
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh")  # one function: 0.5 x (1 + tanh(...))
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# transformers 5's defaults (configuration_<model_type>.py) for the fields read here, where config.json leaves
# them out. None: derived from other fields (kv heads = heads, head_dim = hidden_size / heads).
_ROPE = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False)
DEFAULTS = {
    "llama": dict(_ROPE, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, attention_bias=False, mlp_bias=False),
    "mistral": dict(_ROPE, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    sliding_window=4096),
    "qwen2": dict(_ROPE, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None),
    "gemma": dict(_ROPE, vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                  use_bidirectional_attention=None),
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True),
}
# The type each field must have (transformers checks them strictly: no int for a float, no 1 for true).
_FLOATS = {"rms_norm_eps", "layer_norm_epsilon"}
_TEXTS = {"hidden_act", "activation_function"}
_BOOLS = {"tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "scale_attn_weights",
          "scale_attn_by_inverse_layer_idx", "add_cross_attention", "use_bidirectional_attention"}
_OPTIONAL = {"num_key_value_heads", "head_dim", "sliding_window", "n_inner", "layer_types",
             "use_bidirectional_attention"}
GPT2_NAMES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
              "num_hidden_layers": "n_layer"}  # GPT2Config's attribute_map: both spellings are read


def model_type(config: dict, where: str) -> str:
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise UserError(f"{where}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return kind


def to_gpt(config: dict, where: str) -> dict:
    """The GPT arguments (model.* keys) of a Hugging Face config.json."""
    kind = model_type(config, where)
    if kind == "gpt2":
        config = {GPT2_NAMES.get(k, k): v for k, v in config.items()}
    get = _fields(kind, config, where)
    return _gpt2(get, where) if kind == "gpt2" else _rope_model(kind, get, config, where)


def _fields(kind: str, c: dict, where: str):
    """A reader of config.json's fields: each one's value or transformers' default, checked for its type."""
    def get(name: str):
        value = c.get(name, DEFAULTS[kind][name])
        if value is None and name in _OPTIONAL:
            return None
        want = float if name in _FLOATS else str if name in _TEXTS else bool if name in _BOOLS else \
            list if name == "layer_types" else int
        if not isinstance(value, want) or (want is int and (isinstance(value, bool) or value < 0)):
            raise UserError(f"{where}: config.json has {name}={value!r}; transformers reads {name} as "
                            f"{'a non-negative int' if want is int else 'a ' + want.__name__}")
        return value
    return get


def _rope_model(kind: str, get, c: dict, where: str) -> dict:
    d, heads = get("hidden_size"), get("num_attention_heads")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not get(name):
            raise UserError(f"{where}: config.json has {name}=0; it must be at least 1")
    if kind == "llama" and d % heads:  # transformers' LlamaConfig refuses it, head_dim or not
        raise UserError(f"{where}: config.json has hidden_size={d}, not a multiple of num_attention_heads={heads}")
    head_dim = get("head_dim") or d // heads
    kv_heads = get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UserError(f"{where}: config.json has num_attention_heads={heads}, not a multiple of "
                        f"num_key_value_heads={kv_heads}")
    act = get("hidden_act")
    if kind == "gemma" and act == "gelu":
        # transformers reads Gemma's legacy "gelu" as the tanh approximation it was trained with (and reads
        # hidden_act alone: hidden_activation was transformers 4's field, for Gemma 2 onwards now)
        act = "gelu_pytorch_tanh"
    mlp = "swiglu" if act in SILU else "geglu" if act in TANH_GELU else None
    if mlp is None:
        raise UserError(f"{where}: config.json has hidden_act={act!r}, which is not supported for {kind} (supported: "
                        f"{', '.join(SILU + TANH_GELU)})")
    if kind == "gemma" and get("use_bidirectional_attention"):
        raise UserError(f"{where}: config.json has use_bidirectional_attention=true; only causal attention is "
                        "supported")
    theta, scaling = _rope(c, where, get("max_position_embeddings"))
    return dict(vocab_size=get("vocab_size"), d_model=d, n_layers=get("num_hidden_layers"), n_heads=heads,
                n_kv_heads=kv_heads, d_ff=get("intermediate_size"), head_dim=head_dim,
                max_len=_max_len(kind, get), position="rope", norm="rmsnorm+1" if kind == "gemma" else "rmsnorm",
                mlp=mlp, norm_eps=get("rms_norm_eps"), rope_theta=theta, rope_scaling=scaling,
                tie_embeddings=get("tie_word_embeddings"), embed_scale=kind == "gemma", **_biases(kind, get, where))


def _biases(kind: str, get, where: str) -> dict:
    """Which linear layers have biases, as each architecture's modeling file builds them: Qwen2's q, k and v
    always; Llama's attention and MLP by attention_bias and mlp_bias; Gemma's attention by attention_bias;
    Mistral's none (the fields are not read there)."""
    if kind == "qwen2":
        return dict(qkv_bias=True)
    attention = get("attention_bias") if kind in ("llama", "gemma") else False
    mlp = get("mlp_bias") if kind == "llama" else False
    if attention and not mlp:
        raise UserError(f"{where}: config.json has attention_bias=true, and {kind}'s MLP then has no biases: biases on "
                        "the attention alone are not supported (the GPT's bias option puts them on the MLP too)")
    return dict(bias=attention, mlp_bias=mlp)


def _max_len(kind: str, get) -> int:
    """max_position_embeddings, capped at the sliding window where a layer slides (Mistral: every layer where
    sliding_window is set; Qwen2: with use_sliding_window, the layers layer_types says, by default those from
    max_window_layers on)."""
    max_len = get("max_position_embeddings")
    window = get("sliding_window") if kind == "mistral" else None
    if kind == "qwen2" and get("use_sliding_window") and get("sliding_window") is not None:
        n, first = get("num_hidden_layers"), get("max_window_layers")
        types = get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        window = get("sliding_window") if "sliding_attention" in types else None
    return min(max_len, window) if window else max_len


def _rope(c: dict, where: str, max_len: int) -> tuple[float, dict | None]:
    """(theta, Llama 3 scaling or None), read as transformers 5 does: rope_scaling (the older name) over
    rope_parameters, the theta inside over rope_theta beside it."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UserError(f"{where}: config.json has rope_parameters={params!r}; transformers reads a mapping")
    params = dict(params)
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise UserError(f"{where}: config.json has rope_theta={theta!r}; it must be a positive number")
    if partial != 1.0:
        raise UserError(f"{where}: config.json has partial_rotary_factor={partial!r}; only 1.0 is supported")
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise UserError(f"{where}: config.json has rope_type={kind!r}, which is not supported (supported: default, "
                        "llama3)")
    # transformers takes original_max_position_embeddings from beside the parameters first, else max_len
    params["original_max_position_embeddings"] = c.get("original_max_position_embeddings",
                                                       params.get("original_max_position_embeddings", max_len))
    missing = [k for k in LLAMA3_KEYS if k not in params]
    if missing:
        raise UserError(f"{where}: config.json's llama3 rope_scaling lacks {', '.join(missing)}")
    bad = [k for k in LLAMA3_KEYS if not isinstance(params[k], (int, float)) or isinstance(params[k], bool)]
    if bad:
        raise UserError(f"{where}: config.json has rope_scaling {bad[0]}={params[bad[0]]!r}; it must be a number")
    return float(theta), {k: float(params[k]) if k != LLAMA3_KEYS[-1] else int(params[k]) for k in LLAMA3_KEYS}


def _gpt2(get, where: str) -> dict:
    act = get("activation_function")
    if act not in TANH_GELU:
        raise UserError(f"{where}: config.json has activation_function={act!r}, which is not supported for gpt2 "
                        f"(supported: {', '.join(TANH_GELU)})")
    for flag, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False)):
        if get(flag) != want:
            raise UserError(f"{where}: config.json has {flag}={str(get(flag)).lower()}; only {str(want).lower()} "
                            "is supported for gpt2")
    d, heads = get("n_embd"), get("n_head")
    if not heads or d % heads:
        raise UserError(f"{where}: config.json has n_embd={d}, not a multiple of n_head={heads}")
    return dict(vocab_size=get("vocab_size"), d_model=d, n_layers=get("n_layer"), n_heads=heads,
                d_ff=get("n_inner") or 4 * d, max_len=get("n_positions"), position="learned", norm="layernorm",
                mlp="gelu", bias=True, norm_eps=get("layer_norm_epsilon"), tie_embeddings=get("tie_word_embeddings"))


# ----------------------------------------------------------------------------- the other way

def from_gpt(kwargs: dict, model_name: str) -> dict:
    """The config.json of a run's model (its model.name and arguments); UserError where it is none of SUPPORTED."""
    g = _with_defaults(kwargs)
    kind = _kind(g) if model_name == "gpt" else None
    if kind is None:
        raise UserError(f"--format hf: model {model_name!r} with these options is none of the architectures a "
                        f"Hugging Face folder can hold ({', '.join(SUPPORTED)}): GPT-2 needs position=learned, "
                        "norm=layernorm, mlp=gelu, bias=true; the others position=rope, mlp=swiglu or geglu, with "
                        "rmsnorm (Llama, Qwen2 with qkv_bias) or rmsnorm+1 and embed_scale (Gemma)")
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
                hidden_act="silu" if g["mlp"] == "swiglu" else "gelu_pytorch_tanh",
                attention_bias=g["bias"], mlp_bias=g["bias"] or g["mlp_bias"])


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
    if g["position"] != "rope" or g["mlp"] == "gelu" or g["embed_scale"] != (g["norm"] == "rmsnorm+1"):
        return None
    if g["norm"] == "rmsnorm+1":
        return "gemma" if not (g["qkv_bias"] or g["bias"] or g["mlp_bias"]) else None
    if g["norm"] == "rmsnorm":
        if g["qkv_bias"] and not g["bias"]:  # q, k and v alone: Qwen2's
            return "qwen2" if not g["mlp_bias"] else None
        return "llama"
    return None
