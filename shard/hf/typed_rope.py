"""RoPE by layer type (shard/hf/config_in.py's Gemma 3 and OLMo 3): config.json's rope_parameters, one mapping per
layer type, read as transformers 5 reads each family, into the GPT's global RoPE (its scaling) and the local
(sliding_attention) layers' own base, which the GPT rotates unscaled (`rope_layers` value 2)."""

import math

from shard.errors import UserError

LAYER_TYPES = ("full_attention", "sliding_attention")
# The full_attention layers' scalings each family reads here (the local layers: none)
SCALINGS = {"gemma3_text": ("default", "linear"), "olmo3": ("default", "yarn")}


def typed_rope(kind: str, c: dict, where: str, get) -> tuple[float, dict | None, float]:
    """(global theta, its scaling or None, the local layers' theta): rope_parameters by layer type, with rope_scaling
    (the older name, for the global layers) over it. The bases where a type's mapping gives none: Gemma 3's
    rope_theta (1e6) and rope_local_base_freq (1e4); OLMo 3's rope_theta for the global layers and 500000 for the
    local ones, whatever rope_theta says (its config class spends rope_theta on the first)."""
    params = c.get("rope_parameters")
    if params is not None and not (isinstance(params, dict) and set(params) <= set(LAYER_TYPES)):
        raise UserError(f"{where}: config.json has rope_parameters={params!r}; {kind} reads one mapping per layer "
                        f"type ({', '.join(LAYER_TYPES)})")
    params = params or {}
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    full.update(c.get("rope_scaling") or {})
    if kind == "gemma3_text":
        full.setdefault("rope_theta", c.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", c.get("rope_local_base_freq", 10_000.0))
    else:
        full.setdefault("rope_theta", c.get("rope_theta", 500_000.0))
        local.setdefault("rope_theta", 500_000.0)
    for name, p, allowed in (("full_attention", full, SCALINGS[kind]), ("sliding_attention", local, ("default",))):
        rope_type, theta = p.get("rope_type", p.get("type", "default")), p["rope_theta"]
        if rope_type not in allowed:
            raise UserError(f"{where}: config.json has {name} rope_type={rope_type!r}, which is not supported for "
                            f"{kind} (supported: {', '.join(allowed)})")
        if not is_number(theta) or theta <= 0:
            raise UserError(f"{where}: config.json has {name} rope_theta={theta!r}; it must be a positive number")
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise UserError(f"{where}: config.json has partial_rotary_factor={p['partial_rotary_factor']!r}; only 1.0 "
                            f"is supported for {kind}")
    rope_type = full.get("rope_type", full.get("type", "default"))
    scaling = None
    if rope_type != "default" and (not is_number(full.get("factor")) or full["factor"] <= 0):
        raise UserError(f"{where}: config.json has rope_scaling factor={full.get('factor')!r}; it must be a "
                        "positive number")
    if rope_type == "linear":
        scaling = dict(rope_type="linear", factor=float(full["factor"]))
    if rope_type == "yarn":
        scaling = yarn(full, where, get)
    return float(full["rope_theta"]), scaling, float(local["rope_theta"])


def yarn(p: dict, where: str, get) -> dict:
    """YaRN's settings, resolved as transformers' do: the original context max_position_embeddings where none is
    given, beta_fast and beta_slow 32 and 1 where absent or 0, the attention factor 0.1 ln(factor) + 1 where
    none is given (the ratio of two such by mscale and mscale_all_dim where both are set), the ramp's ends rounded
    unless truncate is false (GPT-OSS's)."""
    original = p.get("original_max_position_embeddings", get("max_position_embeddings"))
    for name in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if p.get(name) is not None and not is_number(p[name]):
            raise UserError(f"{where}: config.json has rope_scaling {name}={p[name]!r}; it must be a number")
    if not is_number(original) or original < 1:
        raise UserError(f"{where}: config.json has rope_scaling original_max_position_embeddings={original!r}; it "
                        "must be a positive number")
    if not is_number(p.get("factor")) or p["factor"] <= 0:
        raise UserError(f"{where}: config.json has rope_scaling factor={p.get('factor')!r}; it must be a positive "
                        "number")
    if not isinstance(p.get("truncate", True), bool):
        raise UserError(f"{where}: config.json has rope_scaling truncate={p['truncate']!r}; it must be true or false")
    factor, attention = float(p["factor"]), p.get("attention_factor")
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
    if attention is None:
        both = p.get("mscale") and p.get("mscale_all_dim")
        attention = mscale(p["mscale"]) / mscale(p["mscale_all_dim"]) if both else mscale(1)
    return dict(rope_type="yarn", factor=factor, original_max_position_embeddings=int(original),
                beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                attention_factor=float(attention), **({} if p.get("truncate", True) else {"truncate": False}))


def is_number(x) -> bool:
    """An int or float of config.json (JSON's true and false are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
