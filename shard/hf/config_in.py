"""A dense family's config.json -> the library GPT's arguments (shard/hf/arch.py dispatches here).

Reading gives each field the meaning transformers 5 gives it: its defaults where a field is left out, its types
(a value transformers refuses is refused here, in one line naming the field), its legacy spellings. What the
GPT cannot do exactly (another activation, RoPE scaling other than Llama 3's, biases on attention alone) is
refused in one line rather than loaded approximately. Sliding windows are the GPT's per-layer `windows` (0 for a
global layer), as each family's config reads them (`_windows`). Dropout rates are training
settings of transformers' own loop, not of the model, and are not read.
"""

import math

from shard.errors import UserError
from shard.hf.typed_rope import LAYER_TYPES, is_number, typed_rope, yarn

DENSE = ("llama", "mistral", "qwen2", "gemma", "gpt2", "qwen3", "smollm3", "olmo2", "phi3", "gemma2", "gemma3_text",
         "olmo3")
DENSE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "gemma": "GemmaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM",
                       "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM",
                       "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "olmo3": "Olmo3ForCausalLM"}
SILU = ("silu", "swish")  # transformers' two names of one function
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh")  # one function: 0.5 x (1 + tanh(...))
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# transformers 5's defaults (configuration_<model_type>.py) for the fields read here, where config.json leaves
# them out. None: derived from other fields (kv heads = heads, head_dim = hidden_size / heads).
_ROPE = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_theta=10000.0)  # (Gemma 3's and OLMo 3's two bases: shard/hf/typed_rope.py)
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
                    layer_types=None, attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
                    rope_theta=2_000_000.0),
    "olmo2": dict(_ROPE, vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, attention_bias=False, rms_norm_eps=1e-5),
    "olmo3": dict(_ROPE, vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, attention_bias=False, rms_norm_eps=1e-5,
                  sliding_window=4096, layer_types=None, rope_theta=500_000.0),
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
    # GPT-OSS's attention, norms and RoPE (its experts: shard/hf/experts.py); its rope_parameters YaRN by default
    "gpt_oss": dict(_ROPE, vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, sliding_window=128, layer_types=None, attention_bias=True,
                    rope_theta=150000.0),
    # Llama 4's text model: its attention and RoPE (its experts and dense layers: shard/hf/experts.py)
    "llama4_text": dict(_ROPE, vocab_size=202048, hidden_size=5120, intermediate_size=8192, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, attention_bias=False, rope_theta=500000.0, no_rope_layers=None,
                        no_rope_layer_interval=4, layer_types=None, attention_chunk_size=8192, use_qk_norm=True,
                        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1),
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True),
}
# The RoPE a family's config class gives where config.json has none (GPT-OSS's: YaRN over a 4096-token original)
ROPE_DEFAULTS = {"gpt_oss": dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                 original_max_position_embeddings=4096)}
# The type each field must have (transformers checks them strictly: no int for a float, no 1 for true).
_FLOATS = {"rms_norm_eps", "layer_norm_epsilon", "final_logit_softcapping", "attn_logit_softcapping", "attn_scale"}
_TEXTS = {"hidden_act", "activation_function", "hidden_activation"}
_BOOLS = {"tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "scale_attn_weights",
          "scale_attn_by_inverse_layer_idx", "add_cross_attention", "use_bidirectional_attention", "use_qk_norm",
          "attn_temperature_tuning"}
_OPTIONAL = {"num_key_value_heads", "head_dim", "sliding_window", "n_inner", "layer_types",
             "use_bidirectional_attention", "no_rope_layers", "final_logit_softcapping", "attn_logit_softcapping",
             "attention_chunk_size"}
_LISTS = {"layer_types", "no_rope_layers"}
GPT2_NAMES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
              "num_hidden_layers": "n_layer"}  # GPT2Config's attribute_map: both spellings are read



def dense_to_gpt(kind: str, config: dict, where: str) -> dict:
    """The GPT's arguments (model.* keys) of a dense family's config.json."""
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


def typed(c: dict, defaults: dict, types: dict, nullable: set, where: str):
    """A reader of config.json's fields for a family read apart from the dense ones (shard/hf/gemma4.py and
    deepseek.py): each field's value or transformers' default, checked for its type (`types`: name -> float, str,
    bool, list or dict; a non-negative int where not named), None where `nullable` names the field."""
    def get(name: str):
        value = c.get(name, defaults[name])
        if value is None and name in nullable:
            return None
        want = types.get(name, int)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else \
            isinstance(value, want) and not (want is int and (isinstance(value, bool) or value < 0))
        if not ok:
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
        theta, scaling, local_theta = typed_rope(kind, c, where, get)
        rotary_dim, extra = head_dim, _gemma(kind, get, where, local_theta)
    elif kind == "olmo3":
        theta, scaling, local_theta = typed_rope(kind, c, where, get)
        rotary_dim, extra = head_dim, _local_rope(kind, get, where, local_theta)
    else:
        theta, scaling, rotary_dim = _rope(kind, c, where, get, head_dim)
        extra = _gemma(kind, get, where) if kind == "gemma2" else {}
    return dict(**extra, vocab_size=get("vocab_size"), d_model=d, n_layers=get("num_hidden_layers"), n_heads=heads,
                n_kv_heads=kv_heads, d_ff=get("intermediate_size"), head_dim=head_dim,
                max_len=get("max_position_embeddings"), position="rope",
                norm="rmsnorm+1" if kind in GEMMAS else "rmsnorm",
                mlp=mlp, norm_eps=get("rms_norm_eps"), rope_theta=theta, rope_scaling=scaling,
                tie_embeddings=get("tie_word_embeddings"), embed_scale=kind in GEMMAS, **_biases(kind, get, where),
                **({"rotary_dim": rotary_dim} if rotary_dim != head_dim else {}), **_options(kind, get, where))


# The GPT's options each family sets beyond Llama's (its per-layer and norm settings; RoPE is _rope's).
FAMILY_OPTIONS = {"qwen3": dict(qk_norm="head"), "olmo2": dict(qk_norm="projection", norms="post"),
                  "olmo3": dict(qk_norm="projection", norms="post"),
                  "gemma2": dict(norms="both"), "gemma3_text": dict(norms="both", qk_norm="head"),
                  "gpt_oss": dict(attn_sinks=True)}
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
    return dict(out, **({} if local_theta is None else _local_rope(kind, get, where, local_theta)))


def _local_rope(kind: str, get, where: str, local_theta: float) -> dict:
    """Gemma 3's and OLMo 3's local layers' own RoPE (layer_types' sliding_attention layers rotate by it, unscaled);
    none where every layer is global (OLMo 3's)."""
    rotations = [2 if t == "sliding_attention" else 1 for t in _layer_types(kind, get, where)]
    if kind == "olmo3" and 2 not in rotations:
        return {}
    return dict(local_rope_theta=local_theta, rope_layers=rotations)


def _options(kind: str, get, where: str) -> dict:
    """FAMILY_OPTIONS, SmolLM3's rope-less layers, and the sliding windows (`_windows`)."""
    options = dict(FAMILY_OPTIONS.get(kind, {}))
    if kind in ("smollm3", "llama4_text"):
        n, every = get("num_hidden_layers"), get("no_rope_layer_interval")
        rotate = get("no_rope_layers")
        if kind == "llama4_text" and rotate == []:  # Llama 4's config class takes an empty list for its default
            rotate = None
        if rotate is None and not every:
            raise UserError(f"{where}: config.json has no_rope_layer_interval=0; it must be at least 1")
        rotate = [int((i + 1) % every != 0) for i in range(n)] if rotate is None else rotate
        if len(rotate) != n or any(r not in (0, 1) or isinstance(r, bool) for r in rotate):
            raise UserError(f"{where}: config.json has no_rope_layers={rotate!r}; transformers reads one 1 (rotary "
                            f"positions) or 0 (none) per layer, {n} in all")
        if 0 in rotate:
            options["rope_layers"] = rotate
    if kind == "llama4_text":
        options.update(_llama4(get, where, rotate))
    return dict(options, **_windows(kind, get, where, options.get("rope_layers")))


def _llama4(get, where: str, rotate: list) -> dict:
    """Llama 4's attention: RoPE on adjacent channel pairs; a weightless norm of the queries and keys of the layers
    that rotate (use_qk_norm); the queries of those that do not scaled up with the position (attn_temperature_tuning:
    floor_scale, attn_scale); chunked attention on the layers layer_types names (by default those that rotate)."""
    out = dict(rope_interleaved=True, **({"qk_norm": "l2"} if get("use_qk_norm") else {}))
    if get("attn_temperature_tuning") and 0 in rotate:
        if not get("floor_scale"):
            raise UserError(f"{where}: config.json has floor_scale=0; attention temperature tuning divides by it")
        out.update(attn_temperature_floor=float(get("floor_scale")), attn_temperature_scale=get("attn_scale"))
    size, types = get("attention_chunk_size"), get("layer_types")
    types = types or ["chunked_attention" if r and size is not None else "full_attention" for r in rotate]
    if len(types) != len(rotate) or any(t not in LLAMA4_TYPES for t in types):
        raise UserError(f"{where}: config.json has layer_types={types!r}; llama4_text reads one of "
                        f"{', '.join(LLAMA4_TYPES)} per layer, {len(rotate)} in all")
    if "chunked_attention" in types:
        if not size:
            raise UserError(f"{where}: config.json has attention_chunk_size={size!r} with chunked_attention layers; "
                            "it must be at least 1")
        out["chunks"] = [size if t == "chunked_attention" else 0 for t in types]
    return out


LLAMA4_TYPES = ("full_attention", "chunked_attention")


def _biases(kind: str, get, where: str) -> dict:
    """Which linear layers have biases, as each architecture's modeling file builds them: Qwen2's q, k and v
    always; Llama's attention and MLP by attention_bias and mlp_bias; Gemma's attention by attention_bias;
    Mistral's none (the fields are not read there)."""
    if kind == "qwen2":
        return dict(qkv_bias=True)
    if kind in ("gpt_oss", "llama4_text"):  # on q, k, v and o; GPT-OSS's experts' own are the MoE's
        return dict(attn_bias=get("attention_bias"))
    attention = get("attention_bias") if kind in ("llama", "gemma", "qwen3", "smollm3", "olmo2", "olmo3") else False
    mlp = get("mlp_bias") if kind in ("llama", "smollm3") else False
    if attention and not mlp:
        raise UserError(f"{where}: config.json has attention_bias=true, and {kind}'s MLP then has no biases: biases on "
                        "the attention alone are not supported (the GPT's bias option puts them on the MLP too)")
    return dict(bias=attention, mlp_bias=mlp)


WINDOWED = ("mistral", "phi3")  # every layer slides where sliding_window is set
LAYER_TYPED = ("qwen2", "qwen3", "smollm3")  # with use_sliding_window, the layers layer_types names slide
PATTERNED = ("gemma2", "gemma3_text", "olmo3", "gpt_oss")  # layer_types' sliding layers; by default all but every n-th


def _windows(kind: str, get, where: str, rotate: list | None = None) -> dict:
    """The GPT's `windows` (one per layer, 0 = global) as transformers 5 reads them, or {} where no layer slides.
    Mistral and Phi-3: every layer, where sliding_window is set. Qwen2 and Qwen3: with use_sliding_window, the
    layers layer_types marks sliding_attention (`_layer_types`); SmolLM3 the same; Gemma 2 and 3 and OLMo 3
    those layers."""
    if kind == "olmo3" and get("sliding_window") is None:  # transformers' OLMo 3 makes a sliding mask in any case
        raise UserError(f"{where}: config.json has sliding_window=null; olmo3 needs a window (a number of tokens)")
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
    SmolLM3's its rope-less layers (`rotate`, one 0 or 1 per layer), Gemma 2's and GPT-OSS's every other layer (the
    first sliding), OLMo 3's all but
    every 4th and Gemma 3's all but every sliding_window_pattern-th."""
    n, types = get("num_hidden_layers"), get("layer_types")
    if types is None and kind in PATTERNED:
        every = {"gemma2": 2, "gpt_oss": 2, "olmo3": 4}.get(kind) or get("sliding_window_pattern")
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
    params = c.get("rope_scaling") or c.get("rope_parameters") or ROPE_DEFAULTS.get(kind, {})
    if not isinstance(params, dict):
        raise UserError(f"{where}: config.json has rope_parameters={params!r}; transformers reads a mapping")
    params = dict(params)
    theta = params.get("rope_theta", c.get("rope_theta", DEFAULTS[kind]["rope_theta"]))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if not is_number(theta) or theta <= 0:
        raise UserError(f"{where}: config.json has rope_theta={theta!r}; it must be a positive number")
    rotary_dim = head_dim
    if kind == "phi3":
        rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type
        if not is_number(partial) or not 0 < partial <= 1 or int(head_dim * partial) % 2:
            raise UserError(f"{where}: config.json has partial_rotary_factor={partial!r}; it must be in (0, 1] and "
                            f"rotate an even number of head_dim={head_dim}'s channels")
        rotary_dim = int(head_dim * partial)
    elif partial != 1.0:
        raise UserError(f"{where}: config.json has partial_rotary_factor={partial!r}; only 1.0 is supported for {kind}")
    allowed = {"phi3": ("default", "longrope"), "gpt_oss": ("default", "yarn")}.get(kind, ("default", "llama3"))
    if rope_type not in allowed:
        raise UserError(f"{where}: config.json has rope_type={rope_type!r}, which is not supported for {kind} "
                        f"(supported: {', '.join(allowed)})")
    if rope_type == "default":
        return float(theta), None, rotary_dim
    if rope_type == "longrope":
        return float(theta), _longrope(params, where, get, rotary_dim), rotary_dim
    if rope_type == "yarn":
        return float(theta), yarn(params, where, get), rotary_dim
    # transformers takes original_max_position_embeddings from beside the parameters first, else max_len
    params["original_max_position_embeddings"] = c.get("original_max_position_embeddings", params.get(
        "original_max_position_embeddings", get("max_position_embeddings")))
    missing = [k for k in LLAMA3_KEYS if k not in params]
    if missing:
        raise UserError(f"{where}: config.json's llama3 rope_scaling lacks {', '.join(missing)}")
    bad = [k for k in LLAMA3_KEYS if not is_number(params[k])]
    if bad:
        raise UserError(f"{where}: config.json has rope_scaling {bad[0]}={params[bad[0]]!r}; it must be a number")
    return float(theta), {k: float(params[k]) if k != LLAMA3_KEYS[-1] else int(params[k]) for k in LLAMA3_KEYS}, \
        rotary_dim


def _longrope(params: dict, where: str, get, rotary_dim: int) -> dict:
    """Phi-3's LongRoPE as the GPT's rope_scaling: a factor per frequency for short and for long calls, the
    original context (config.json's top-level field first: transformers gives it priority for Phi-3), and the
    attention factor transformers derives from the context's growth where none is given."""
    for name in ("short_factor", "long_factor"):
        f = params.get(name)
        if not isinstance(f, list) or len(f) != rotary_dim // 2 or not all(is_number(x) for x in f):
            raise UserError(f"{where}: config.json has rope_scaling {name}={f!r}; transformers reads a list of "
                            f"{rotary_dim // 2} numbers (half the rotated channels)")
    original = get("original_max_position_embeddings")
    factor, attention = params.get("factor"), params.get("attention_factor")
    for name, value in (("factor", factor), ("attention_factor", attention)):
        if value is not None and not is_number(value):
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

