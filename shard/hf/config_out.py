"""The library GPT's arguments -> a dense family's config.json (the other way of shard/hf/config_in.py; shard/hf/arch.py
dispatches here): the family a GPT's options make, refused in one line where none does."""

import math

from shard.errors import UserError
from shard.hf.config_in import (DEFAULTS, DENSE, DENSE_ARCHITECTURES, LAYER_TYPED, LAYER_TYPES,
                                 PATTERNED, WINDOWED)


def dense_from_gpt(kwargs: dict, model_name: str) -> dict:
    """The config.json of a GPT's arguments; UserError where it is none of the dense families."""
    g = with_defaults(kwargs)
    kind = _kind(g) if model_name == "gpt" else None
    if kind is None:
        raise UserError(f"--format hf: model {model_name!r} with these options is none of the architectures a "
                        f"Hugging Face folder can hold ({', '.join(DENSE)}): GPT-2 needs position=learned, "
                        "norm=layernorm, mlp=gelu, bias=true; the others position=rope, mlp=swiglu or geglu, with "
                        "rmsnorm (Llama, Qwen2 with qkv_bias; Qwen3 with qk_norm=head, OLMo 2 with qk_norm=projection "
                        "and norms=post, OLMo 3 with those and windows or yarn, SmolLM3 with rope_layers, Phi-3 with "
                        "rotary_dim or longrope, each unbiased but SmolLM3) or rmsnorm+1 and embed_scale (Gemma)")
    kind, windows = _window_fields(kind, g)
    common = dict(model_type=kind, architectures=[DENSE_ARCHITECTURES[kind]], vocab_size=g["vocab_size"],
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
    if kind in ("gemma2", "gemma3_text"):  # Gemma 2 and 3 name their activation hidden_activation
        out["hidden_activation"] = out.pop("hidden_act")
    return dict(out, **extra)


def _window_fields(kind: str, g: dict) -> tuple[str, dict]:
    """The family and the config.json fields that hold the GPT's `windows`: an unbiased Llama whose layers all
    slide alike is a Mistral; Qwen2, Qwen3 and SmolLM3 name each layer's kind, with one window size."""
    if kind == "olmo3":
        return kind, _olmo3_fields(g)
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
               "olmo2": dict(pad_token_id=1, eos_token_id=50279), "olmo3": dict(pad_token_id=1, eos_token_id=50279),
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


def _olmo3_fields(g: dict) -> dict:
    """OLMo 3's fields: each layer's kind (sliding where it rotates by the local base, or where it has a window), one
    window on exactly those layers, the RoPE per layer kind (any scaling on the global layers alone)."""
    n = g["n_layers"]
    windows, rotations = list(g["windows"] or [0] * n), list(g["rope_layers"] or [1] * n)
    sliding = [r == 2 for r in rotations] if 2 in rotations else [bool(w) for w in windows]
    sizes = sorted({w for w in windows if w})
    if len(sizes) > 1 or sliding != [bool(w) for w in windows]:
        raise UserError(f"--format hf: windows={windows} with rope_layers={g['rope_layers']} fits no olmo3 "
                        "config.json: one window, on exactly the layers that rotate by the local base where any does")
    local = g["local_rope_theta"] if 2 in rotations else g["rope_theta"]
    if any(sliding) and 2 not in rotations and g["rope_scaling"]:
        raise UserError("--format hf: OLMo 3's sliding layers rotate unscaled: give them rope_layers value 2 with "
                        f"local_rope_theta (here {g['rope_layers']}) or the global RoPE unscaled")
    full = dict(g["rope_scaling"] or {"rope_type": "default"}, rope_theta=g["rope_theta"])
    return dict(layer_types=[LAYER_TYPES[s] for s in sliding], sliding_window=sizes[0] if sizes else
                DEFAULTS["olmo3"]["sliding_window"], rope_scaling=None,
                rope_parameters={"full_attention": full, "sliding_attention": dict(rope_type="default",
                                                                                   rope_theta=local)})


def with_defaults(kwargs: dict) -> dict:
    import inspect

    from shard.models.gpt import GPT

    defaults = {k: p.default for k, p in inspect.signature(GPT.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    g = {**defaults, **kwargs}
    g["n_kv_heads"] = g["n_kv_heads"] or g["n_heads"]
    g["head_dim"] = g["head_dim"] or g["d_model"] // g["n_heads"]
    g["d_ff"] = g["d_ff"] or (4 * g["d_model"] if g["mlp"] == "gelu" else 8 * g["d_model"] // 3)
    return g


def newer_attention(g: dict) -> set[str]:
    """The GPT options (with_defaults') only GPT-OSS's or Llama 4's attention has, set here: no dense family's
    config.json holds them, and an MoE family's holds only its own."""
    return {k for k in ("attn_sinks", "attn_bias", "rope_interleaved", "attn_temperature_floor") if g[k]} | \
        ({"chunks"} if any(g["chunks"] or []) else set())


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
    if newer_attention(g):  # GPT-OSS's and Llama 4's attention: MoE families' (shard/hf/experts.py)
        return None
    unbiased = not (g["qkv_bias"] or g["bias"] or g["mlp_bias"])
    gemma_only = bool(g["attn_softcap"] or g["logit_softcap"] or g["attn_scale"])
    if g["norm"] == "rmsnorm+1":
        return _gemma_kind(g, unbiased, plain, scaling)
    if gemma_only:
        return None
    if g["norm"] != "rmsnorm":
        return None
    olmo = (g["qk_norm"], g["norms"], partial) == ("projection", "post", False)
    if olmo and (g["rope_layers"] is not None or g["windows"] and any(g["windows"]) or scaling == "yarn"):
        # OLMo 3: sliding layers (rotating by the local base), any scaling on the global ones but Llama 3's
        return "olmo3" if unbiased and set(g["rope_layers"] or [1]) <= {1, 2} and scaling in (None, "yarn") else None
    if g["local_rope_theta"] or scaling == "yarn":
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
