"""config.json <-> the library GPT's arguments, for each supported architecture (`model_type`).

Reading gives each field the meaning transformers 5 gives it: its defaults where a field is left out, its types
(a value transformers refuses is refused here, in one line naming the field), its legacy spellings. What the
GPT cannot do exactly (another activation, RoPE scaling other than Llama 3's, biases on attention alone) is
refused in one line rather than loaded approximately. Sliding windows are the GPT's per-layer `windows` (0 for a
global layer), as each family's config reads them (`_windows`). Dropout rates are training
settings of transformers' own loop, not of the model, and are not read.
"""

import math

from shard.errors import UserError
from shard.hf import experts

SUPPORTED = ("llama", "mistral", "qwen2", "gemma", "gpt2", "qwen3", "smollm3", "olmo2", "phi3", "gemma2",
             "gemma3_text") + \
    tuple(experts.RELATIVE)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 **experts.ARCHITECTURES}
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
    "qwen3": dict(_ROPE, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  attention_bias=False, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  layer_types=None),
    "smollm3": dict(_ROPE, vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768,
                    use_sliding_window=False, sliding_window=None, no_rope_layers=None, no_rope_layer_interval=4,
                    layer_types=None, attention_bias=False, mlp_bias=False, tie_word_embeddings=True),
    "olmo2": dict(_ROPE, vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, attention_bias=False, rms_norm_eps=1e-5),
    "phi3": dict(_ROPE, vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=4096, original_max_position_embeddings=4096,
                 rms_norm_eps=1e-5, sliding_window=None),
    "gemma2": dict(_ROPE, vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                   query_pre_attn_scalar=256, sliding_window=4096, layer_types=None, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, use_bidirectional_attention=None),
    "gemma3_text": dict(_ROPE, vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                        tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
                        sliding_window=4096, layer_types=None, final_logit_softcapping=None,
                        attn_logit_softcapping=None, use_bidirectional_attention=False, sliding_window_pattern=6),
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True),
}
# The type each field must have (transformers checks them strictly: no int for a float, no 1 for true).
_FLOATS = {"rms_norm_eps", "layer_norm_epsilon", "final_logit_softcapping", "attn_logit_softcapping"}
_TEXTS = {"hidden_act", "activation_function", "hidden_activation"}
_BOOLS = {"tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "scale_attn_weights",
          "scale_attn_by_inverse_layer_idx", "add_cross_attention", "use_bidirectional_attention"}
_OPTIONAL = {"num_key_value_heads", "head_dim", "sliding_window", "n_inner", "layer_types",
             "use_bidirectional_attention", "no_rope_layers", "final_logit_softcapping", "attn_logit_softcapping"}
_LISTS = {"layer_types", "no_rope_layers"}
GPT2_NAMES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
              "num_hidden_layers": "n_layer"}  # GPT2Config's attribute_map: both spellings are read


def model_type(config: dict, where: str) -> str:
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise UserError(f"{where}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return kind


def model_name(kind: str) -> str:
    """The library model an architecture is read into: the MoE for the mixture-of-experts families, else the GPT."""
    return "moe" if kind in experts.RELATIVE else "gpt"


def to_gpt(config: dict, where: str) -> dict:
    """The arguments (model.* keys) of model_name's model for a Hugging Face config.json."""
    kind = model_type(config, where)
    if kind in experts.RELATIVE:
        return experts.to_moe(kind, config, where)
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
            list if name in _LISTS else int
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
    act = get("hidden_activation") if kind in GEMMAS[1:] else get("hidden_act")
    if kind == "gemma" and act == "gelu":
        # transformers reads Gemma's legacy "gelu" as the tanh approximation it was trained with (and reads
        # hidden_act alone: hidden_activation was transformers 4's field, for Gemma 2 onwards now)
        act = "gelu_pytorch_tanh"
    mlp = "swiglu" if act in SILU else "geglu" if act in TANH_GELU else None
    if mlp is None:
        raise UserError(f"{where}: config.json has {'hidden_activation' if kind in GEMMAS[1:] else 'hidden_act'}="
                        f"{act!r}, which is not supported for {kind} (supported: {', '.join(SILU + TANH_GELU)})")
    if kind in GEMMAS and get("use_bidirectional_attention"):
        raise UserError(f"{where}: config.json has use_bidirectional_attention=true; only causal attention is "
                        "supported")
    if kind == "gemma3_text":
        theta, scaling, local_theta = _gemma3_rope(c, where)
        rotary_dim, extra = head_dim, _gemma(kind, get, where, local_theta)
    else:
        theta, scaling, rotary_dim = _rope(kind, c, where, get, head_dim)
        extra = _gemma(kind, get, where) if kind == "gemma2" else {}
    return dict(**extra, vocab_size=get("vocab_size"), d_model=d, n_layers=get("num_hidden_layers"), n_heads=heads,
                n_kv_heads=kv_heads, d_ff=get("intermediate_size"), head_dim=head_dim, max_len=get("max_position_embeddings"),
                position="rope", norm="rmsnorm+1" if kind in GEMMAS else "rmsnorm",
                mlp=mlp, norm_eps=get("rms_norm_eps"), rope_theta=theta, rope_scaling=scaling,
                tie_embeddings=get("tie_word_embeddings"), embed_scale=kind in GEMMAS, **_biases(kind, get, where),
                **({"rotary_dim": rotary_dim} if rotary_dim != head_dim else {}), **_options(kind, get, where))


# The GPT's options each family sets beyond Llama's (its per-layer and norm settings; RoPE is _rope's).
FAMILY_OPTIONS = {"qwen3": dict(qk_norm="head"), "olmo2": dict(qk_norm="projection", norms="post"),
                  "gemma2": dict(norms="both"), "gemma3_text": dict(norms="both", qk_norm="head")}
GEMMAS = ("gemma", "gemma2", "gemma3_text")


def _gemma(kind: str, get, where: str, local_theta: float | None = None) -> dict:
    """Gemma 2's and 3's attention scale (query_pre_attn_scalar ** -0.5) and soft-caps; Gemma 3's local layers'
    own RoPE base (layer_types' sliding_attention layers rotate by it)."""
    scalar = get("query_pre_attn_scalar")
    if not scalar:
        raise UserError(f"{where}: config.json has query_pre_attn_scalar=0; it must be positive")
    out = dict(attn_scale=scalar ** -0.5)
    for name, option in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "logit_softcap")):
        cap = get(name)
        if cap is not None and cap <= 0:
            raise UserError(f"{where}: config.json has {name}={cap!r}; it must be positive (or null for none)")
        if cap:
            out[option] = cap
    if local_theta is not None:
        out.update(local_rope_theta=local_theta,
                   rope_layers=[2 if t == "sliding_attention" else 1 for t in _layer_types(kind, get, where)])
    return out


def _gemma3_rope(c: dict, where: str) -> tuple[float, dict | None, float]:
    """(global theta, its scaling or None, the local layers' theta) as transformers 5 reads Gemma 3: rope_parameters
    by layer type, or the older rope_theta, rope_scaling (global layers) and rope_local_base_freq."""
    params = c.get("rope_parameters")
    if params is not None and not (isinstance(params, dict) and set(params) <= set(LAYER_TYPES)):
        raise UserError(f"{where}: config.json has rope_parameters={params!r}; gemma3_text reads one mapping per layer "
                        f"type ({', '.join(LAYER_TYPES)})")
    params = params or {}
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    full.update(c.get("rope_scaling") or {})  # the older name, for the global layers: over rope_parameters
    full.setdefault("rope_theta", c.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", c.get("rope_local_base_freq", 10_000.0))
    for name, p, allowed in (("full_attention", full, ("default", "linear")), ("sliding_attention", local, ("default",))):
        rope_type, theta = p.get("rope_type", p.get("type", "default")), p["rope_theta"]
        if rope_type not in allowed:
            raise UserError(f"{where}: config.json has {name} rope_type={rope_type!r}, which is not supported for "
                            f"gemma3_text (supported: {', '.join(allowed)})")
        if not _number(theta) or theta <= 0:
            raise UserError(f"{where}: config.json has {name} rope_theta={theta!r}; it must be a positive number")
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise UserError(f"{where}: config.json has partial_rotary_factor={p['partial_rotary_factor']!r}; only 1.0 "
                            "is supported for gemma3_text")
    scaling = None
    if full.get("rope_type", full.get("type", "default")) == "linear":
        if not _number(full.get("factor")) or full["factor"] <= 0:
            raise UserError(f"{where}: config.json has rope_scaling factor={full.get('factor')!r}; it must be a "
                            "positive number")
        scaling = dict(rope_type="linear", factor=float(full["factor"]))
    return float(full["rope_theta"]), scaling, float(local["rope_theta"])


def _options(kind: str, get, where: str) -> dict:
    """FAMILY_OPTIONS, SmolLM3's rope-less layers, and the sliding windows (`_windows`)."""
    options = dict(FAMILY_OPTIONS.get(kind, {}))
    if kind == "smollm3":
        n, every = get("num_hidden_layers"), get("no_rope_layer_interval")
        rotate = get("no_rope_layers")
        if rotate is None and not every:
            raise UserError(f"{where}: config.json has no_rope_layer_interval=0; it must be at least 1")
        rotate = [int((i + 1) % every != 0) for i in range(n)] if rotate is None else rotate
        if len(rotate) != n or any(r not in (0, 1) or isinstance(r, bool) for r in rotate):
            raise UserError(f"{where}: config.json has no_rope_layers={rotate!r}; transformers reads one 1 (rotary "
                            f"positions) or 0 (none) per layer, {n} in all")
        if 0 in rotate:
            options["rope_layers"] = rotate
    return dict(options, **_windows(kind, get, where, options.get("rope_layers")))


def _biases(kind: str, get, where: str) -> dict:
    """Which linear layers have biases, as each architecture's modeling file builds them: Qwen2's q, k and v
    always; Llama's attention and MLP by attention_bias and mlp_bias; Gemma's attention by attention_bias;
    Mistral's none (the fields are not read there)."""
    if kind == "qwen2":
        return dict(qkv_bias=True)
    attention = get("attention_bias") if kind in ("llama", "gemma", "qwen3", "smollm3", "olmo2") else False
    mlp = get("mlp_bias") if kind in ("llama", "smollm3") else False
    if attention and not mlp:
        raise UserError(f"{where}: config.json has attention_bias=true, and {kind}'s MLP then has no biases: biases on "
                        "the attention alone are not supported (the GPT's bias option puts them on the MLP too)")
    return dict(bias=attention, mlp_bias=mlp)


WINDOWED = ("mistral", "phi3")  # every layer slides where sliding_window is set
LAYER_TYPED = ("qwen2", "qwen3", "smollm3")  # with use_sliding_window, the layers layer_types names slide
PATTERNED = ("gemma2", "gemma3_text")  # the layers layer_types names slide, by default all but every n-th
LAYER_TYPES = ("full_attention", "sliding_attention")


def _windows(kind: str, get, where: str, rotate: list | None = None) -> dict:
    """The GPT's `windows` (one per layer, 0 = global) as transformers 5 reads them, or {} where no layer slides.
    Mistral and Phi-3: every layer, where sliding_window is set. Qwen2 and Qwen3: with use_sliding_window, the
    layers layer_types marks sliding_attention (`_layer_types`); SmolLM3 the same; Gemma 2 and 3 those layers."""
    if kind not in WINDOWED + LAYER_TYPED + PATTERNED or get("sliding_window") is None:
        return {}
    if kind in LAYER_TYPED and not get("use_sliding_window"):  # transformers drops the window then
        return {}
    window, n = get("sliding_window"), get("num_hidden_layers")
    if window < 1:
        raise UserError(f"{where}: config.json has sliding_window={window}; a window holds at least one token")
    if kind in WINDOWED:
        return dict(windows=[window] * n)
    windows = [window if t == "sliding_attention" else 0 for t in _layer_types(kind, get, where, rotate)]
    return dict(windows=windows) if any(windows) else {}


def _layer_types(kind: str, get, where: str, rotate: list | None = None) -> list[str]:
    """Each layer's kind: layer_types, or by default Qwen2's and Qwen3's sliding from max_window_layers on,
    SmolLM3's its rope-less layers (`rotate`, one 0 or 1 per layer), Gemma 2's every other layer and Gemma 3's all
    but every sliding_window_pattern-th."""
    n, types = get("num_hidden_layers"), get("layer_types")
    if types is None and kind in PATTERNED:
        every = 2 if kind == "gemma2" else get("sliding_window_pattern")
        if not every:
            raise UserError(f"{where}: config.json has sliding_window_pattern=0; it must be at least 1")
        types = [LAYER_TYPES[(i + 1) % every != 0] for i in range(n)]
    if types is None:
        slides = [i >= get("max_window_layers") for i in range(n)] if kind != "smollm3" else \
            [not r for r in (rotate or [1] * n)]
        types = [LAYER_TYPES[s] for s in slides]
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise UserError(f"{where}: config.json has layer_types={types!r}; {kind} reads one of "
                        f"{', '.join(LAYER_TYPES)} per layer, {n} in all")
    return types


def _rope(kind: str, c: dict, where: str, get, head_dim: int) -> tuple[float, dict | None, int]:
    """(theta, the GPT's rope_scaling or None, rotated channels per head), read as transformers 5 does:
    rope_scaling (the older name) over rope_parameters, the theta inside over rope_theta beside it. Phi-3 reads
    its partial rotary factor and LongRoPE (su and yarn its old names); the others default or Llama 3's."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UserError(f"{where}: config.json has rope_parameters={params!r}; transformers reads a mapping")
    params = dict(params)
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise UserError(f"{where}: config.json has rope_theta={theta!r}; it must be a positive number")
    rotary_dim = head_dim
    if kind == "phi3":
        rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type
        if not _number(partial) or not 0 < partial <= 1 or int(head_dim * partial) % 2:
            raise UserError(f"{where}: config.json has partial_rotary_factor={partial!r}; it must be in (0, 1] and "
                            f"rotate an even number of head_dim={head_dim}'s channels")
        rotary_dim = int(head_dim * partial)
    elif partial != 1.0:
        raise UserError(f"{where}: config.json has partial_rotary_factor={partial!r}; only 1.0 is supported for {kind}")
    allowed = ("default", "longrope") if kind == "phi3" else ("default", "llama3")
    if rope_type not in allowed:
        raise UserError(f"{where}: config.json has rope_type={rope_type!r}, which is not supported for {kind} "
                        f"(supported: {', '.join(allowed)})")
    if rope_type == "default":
        return float(theta), None, rotary_dim
    if rope_type == "longrope":
        return float(theta), _longrope(params, where, get, rotary_dim), rotary_dim
    # transformers takes original_max_position_embeddings from beside the parameters first, else max_len
    params["original_max_position_embeddings"] = c.get("original_max_position_embeddings", params.get(
        "original_max_position_embeddings", get("max_position_embeddings")))
    missing = [k for k in LLAMA3_KEYS if k not in params]
    if missing:
        raise UserError(f"{where}: config.json's llama3 rope_scaling lacks {', '.join(missing)}")
    bad = [k for k in LLAMA3_KEYS if not _number(params[k])]
    if bad:
        raise UserError(f"{where}: config.json has rope_scaling {bad[0]}={params[bad[0]]!r}; it must be a number")
    return float(theta), {k: float(params[k]) if k != LLAMA3_KEYS[-1] else int(params[k]) for k in LLAMA3_KEYS}, \
        rotary_dim


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _longrope(params: dict, where: str, get, rotary_dim: int) -> dict:
    """Phi-3's LongRoPE as the GPT's rope_scaling: a factor per frequency for short and for long calls, the
    original context (config.json's top-level field first: transformers gives it priority for Phi-3), and the
    attention factor transformers derives from the context's growth where none is given."""
    for name in ("short_factor", "long_factor"):
        f = params.get(name)
        if not isinstance(f, list) or len(f) != rotary_dim // 2 or not all(_number(x) for x in f):
            raise UserError(f"{where}: config.json has rope_scaling {name}={f!r}; transformers reads a list of "
                            f"{rotary_dim // 2} numbers (half the rotated channels)")
    original = get("original_max_position_embeddings")
    factor, attention = params.get("factor"), params.get("attention_factor")
    for name, value in (("factor", factor), ("attention_factor", attention)):
        if value is not None and not _number(value):
            raise UserError(f"{where}: config.json has rope_scaling {name}={value!r}; it must be a number")
    if not original:
        raise UserError(f"{where}: config.json has original_max_position_embeddings=0; it must be at least 1")
    factor = get("max_position_embeddings") / original if factor is None else factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(rope_type="longrope", short_factor=[float(x) for x in params["short_factor"]],
                long_factor=[float(x) for x in params["long_factor"]], original_max_position_embeddings=original,
                attention_factor=float(attention))


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
    if model_name == "moe":
        return experts.from_moe(kwargs)
    g = _with_defaults(kwargs)
    kind = _kind(g) if model_name == "gpt" else None
    if kind is None:
        raise UserError(f"--format hf: model {model_name!r} with these options is none of the architectures a "
                        f"Hugging Face folder can hold ({', '.join(SUPPORTED)}): GPT-2 needs position=learned, "
                        "norm=layernorm, mlp=gelu, bias=true; the others position=rope, mlp=swiglu or geglu, with "
                        "rmsnorm (Llama, Qwen2 with qkv_bias; Qwen3 with qk_norm=head, OLMo 2 with qk_norm=projection "
                        "and norms=post, SmolLM3 with rope_layers, Phi-3 with rotary_dim or longrope, each unbiased "
                        "but SmolLM3) or rmsnorm+1 and embed_scale (Gemma)")
    kind, windows = _window_fields(kind, g)
    common = dict(model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=g["vocab_size"],
                  tie_word_embeddings=g["tie_embeddings"], torch_dtype="float32",
                  **{k: None for k, v in ID_DEFAULTS.get(kind, {}).items() if v >= g["vocab_size"]})
    if kind == "gpt2":
        return dict(common, n_embd=g["d_model"], n_layer=g["n_layers"], n_head=g["n_heads"], n_inner=g["d_ff"],
                    n_positions=g["max_len"], layer_norm_epsilon=g["norm_eps"], activation_function="gelu_new")
    scaling = dict(g["rope_scaling"] or {})
    rope = {"rope_type": scaling.pop("rope_type", "llama3") if scaling else "default", **scaling,
            "rope_theta": g["rope_theta"]}
    extra = {}
    if kind == "phi3":
        rotary = g["rotary_dim"] or g["head_dim"]
        partial = rotary / g["head_dim"]
        while int(g["head_dim"] * partial) < rotary:  # a quotient rounded down would lose a channel
            partial = math.nextafter(partial, 2.0)
        rope["partial_rotary_factor"] = partial
        # Phi-3 reads its original context from beside the parameters first (4096 where absent)
        extra["original_max_position_embeddings"] = scaling.get("original_max_position_embeddings", g["max_len"])
    if kind == "smollm3":
        extra.update(no_rope_layers=list(g["rope_layers"]), use_sliding_window=False)
    extra.update(windows)
    biases = dict(attention_bias=g["bias"], mlp_bias=g["bias"] or g["mlp_bias"])
    biases = {k: v for k, v in biases.items() if k in DEFAULTS[kind] or kind in ("llama", "qwen2")}  # its fields
    out = dict(common, hidden_size=g["d_model"], num_hidden_layers=g["n_layers"], num_attention_heads=g["n_heads"],
               num_key_value_heads=g["n_kv_heads"], intermediate_size=g["d_ff"], head_dim=g["head_dim"],
               max_position_embeddings=g["max_len"], rms_norm_eps=g["norm_eps"], rope_theta=g["rope_theta"],
               rope_parameters=rope, rope_scaling=rope if scaling else None,
               hidden_act="silu" if g["mlp"] == "swiglu" else "gelu_pytorch_tanh", **biases)
    if kind in PATTERNED:  # Gemma 2 and 3 name their activation hidden_activation
        out["hidden_activation"] = out.pop("hidden_act")
    return dict(out, **extra)


def _window_fields(kind: str, g: dict) -> tuple[str, dict]:
    """The family and the config.json fields that hold the GPT's `windows`: an unbiased Llama whose layers all
    slide alike is a Mistral; Qwen2, Qwen3 and SmolLM3 name each layer's kind, with one window size."""
    if kind in PATTERNED:
        return kind, _gemma_fields(kind, g)
    windows = list(g.get("windows") or [])
    sizes = sorted({w for w in windows if w})
    if not sizes:
        return kind, {}
    if kind == "llama" and all(windows) and len(sizes) == 1 and not (g["bias"] or g["mlp_bias"]):
        kind = "mistral"
    if kind in WINDOWED and all(windows) and len(sizes) == 1:
        return kind, dict(sliding_window=sizes[0])
    if kind in LAYER_TYPED and len(sizes) == 1:
        return kind, dict(use_sliding_window=True, sliding_window=sizes[0], max_window_layers=len(windows),
                          layer_types=[LAYER_TYPES[bool(w)] for w in windows])
    raise UserError(f"--format hf: windows={windows} fits no {kind} config.json: Mistral's and Phi-3's hold one window "
                    "for every layer, Qwen2's, Qwen3's and SmolLM3's one window on the layers they name")


# transformers' default special token ids of the families that have them: written as null where past a model's
# vocabulary (transformers would index its embedding with them), unless the tokenizer or source folder gives them
ID_DEFAULTS = {"phi3": dict(bos_token_id=1, eos_token_id=32000, pad_token_id=32000),
               "olmo2": dict(pad_token_id=1, eos_token_id=50279),
               "smollm3": dict(pad_token_id=128004, bos_token_id=128000, eos_token_id=128001),
               "gemma2": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2),
               "gemma3_text": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)}


def _gemma_fields(kind: str, g: dict) -> dict:
    """Gemma 2's and 3's fields: each layer's kind (sliding where it has a window, or for Gemma 3 where it rotates by
    the local base), one window, the attention scale and soft-caps, Gemma 3's RoPE per layer kind."""
    n = g["n_layers"]
    windows, rotations = list(g["windows"] or [0] * n), list(g["rope_layers"] or [1] * n)
    sliding = [r == 2 for r in rotations] if 2 in rotations else [bool(w) for w in windows]
    sizes = sorted({w for w in windows if w})
    if len(sizes) > 1 or (sizes and sliding != [bool(w) for w in windows]):
        raise UserError(f"--format hf: windows={windows} with rope_layers={g['rope_layers']} fits no {kind} "
                        "config.json: one window, on the layers that rotate by the local base where any does")
    scalar = round(g["attn_scale"] ** -2) if g["attn_scale"] else g["head_dim"]
    if g["attn_scale"] and abs(scalar ** -0.5 - g["attn_scale"]) > 1e-12 * g["attn_scale"]:
        raise UserError(f"--format hf: attn_scale={g['attn_scale']} is no query_pre_attn_scalar ** -0.5 of a whole "
                        f"number, which {kind}'s config.json holds")
    out = dict(layer_types=[LAYER_TYPES[s] for s in sliding], sliding_window=sizes[0] if sizes else None,
               query_pre_attn_scalar=scalar, attn_logit_softcapping=g["attn_softcap"] or None,
               final_logit_softcapping=g["logit_softcap"] or None)
    if kind == "gemma3_text":
        full = dict(g["rope_scaling"] or {"rope_type": "default"}, rope_theta=g["rope_theta"])
        local = dict(rope_type="default", rope_theta=g["local_rope_theta"] or g["rope_theta"])
        if any(sliding) and 2 not in rotations and (g["rope_scaling"] or local["rope_theta"] != g["rope_theta"]):
            raise UserError(f"--format hf: Gemma 3's local layers rotate by rope_local_base_freq, unscaled: give them "
                            f"rope_layers value 2 (here {g['rope_layers']}) or the global RoPE unscaled")
        out.update(rope_parameters={"full_attention": full, "sliding_attention": local}, rope_scaling=None,
                   rope_local_base_freq=local["rope_theta"])
    return out


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
    scaling = (g["rope_scaling"] or {}).get("rope_type", "llama3") if g["rope_scaling"] else None
    partial = g["rotary_dim"] not in (0, g["head_dim"])
    # (qk_norm, norms, rope_layers given, Phi-3's RoPE) beyond Llama's options
    shape = (g["qk_norm"], g["norms"], g["rope_layers"] is not None, scaling == "longrope" or partial)
    plain = shape == ("none", "pre", False, False) and scaling in (None, "llama3")
    if (g["position"], g["norm"], g["mlp"]) == ("learned", "layernorm", "gelu"):
        return "gpt2" if g["bias"] and not g["embed_scale"] and g["n_kv_heads"] == g["n_heads"] \
            and g["head_dim"] * g["n_heads"] == g["d_model"] and plain and not g["rope_scaling"] else None
    if g["position"] != "rope" or g["mlp"] == "gelu" or g["embed_scale"] != (g["norm"] == "rmsnorm+1"):
        return None
    unbiased = not (g["qkv_bias"] or g["bias"] or g["mlp_bias"])
    gemma_only = bool(g["attn_softcap"] or g["logit_softcap"] or g["attn_scale"] or g["local_rope_theta"])
    if g["norm"] == "rmsnorm+1":
        return _gemma_kind(g, unbiased, plain, scaling)
    if gemma_only:
        return None
    if g["norm"] != "rmsnorm":
        return None
    if g["qkv_bias"] and not g["bias"]:  # q, k and v alone: Qwen2's
        return "qwen2" if not g["mlp_bias"] and plain else None
    family = {("none", "pre", False, False): "llama", ("head", "pre", False, False): "qwen3",
              ("projection", "post", False, False): "olmo2", ("none", "pre", True, False): "smollm3",
              ("none", "pre", False, True): "phi3"}.get(shape)
    if family == "phi3":
        return family if unbiased and scaling in (None, "longrope") else None
    if family in ("qwen3", "olmo2") and not unbiased or scaling not in (None, "llama3"):
        return None
    return family


def _gemma_kind(g: dict, unbiased: bool, plain: bool, scaling: str | None) -> str | None:
    """Gemma (pre-norms alone, no soft-caps), Gemma 2 (norms both sides) or Gemma 3 (and per-head q/k norms, its local
    layers' own RoPE base, linear scaling on the others), each unbiased."""
    if not unbiased or g["rotary_dim"] not in (0, g["head_dim"]):
        return None
    if plain and not (g["attn_softcap"] or g["logit_softcap"] or g["attn_scale"] or g["local_rope_theta"]):
        return "gemma"
    if g["norms"] != "both":
        return None
    if g["qk_norm"] == "none" and g["rope_layers"] is None and not g["local_rope_theta"] and scaling is None:
        return "gemma2"
    rotations = set(g["rope_layers"] or [1])
    if g["qk_norm"] == "head" and rotations <= {1, 2} and scaling in (None, "linear"):
        return "gemma3_text"
    return None
