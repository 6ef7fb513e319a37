"""Qwen3.5's text model (`qwen3_5_text`, and a `qwen3_5` folder's text_config) <-> the GPT's arguments.

Its layers mix gated DeltaNet linear attention (linear_attention, models/deltanet.py) with full attention
(full_attention: the queries' projection doubled into a per-channel output gate, zero-centred norms on each head's
queries and keys, RoPE on the first partial_rotary_factor of each head's channels), by layer_types or by default
three linear layers to one full (full_attention_interval); its RMSNorms are zero-centred (x * (1 + w)), as Gemma's.
The GPT's `layer_types` scans one period of the pattern at a time. A text model's positions are the same on the three
axes of its multimodal RoPE (mrope_section), which is then plain RoPE. What this reader does not implement (biases
on the attention, another activation or RoPE) is refused in one line naming the field.
"""

from shard.errors import UserError
from shard.hf.config_in import typed
from shard.hf.typed_rope import is_number

KIND = "qwen3_5_text"
ARCHITECTURE = "Qwen3_5ForCausalLM"
# transformers 5's Qwen3_5TextConfig defaults for the fields read here
DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                num_attention_heads=16, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None, attention_bias=False, head_dim=256,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                linear_num_value_heads=32, layer_types=None, full_attention_interval=4, rope_theta=10000.0,
                partial_rotary_factor=0.25)
_TYPES = dict(hidden_act=str, rms_norm_eps=float, tie_word_embeddings=bool, rope_parameters=dict, attention_bias=bool,
              layer_types=list, rope_theta=float, partial_rotary_factor=float)
_NULLABLE = {"rope_parameters", "layer_types"}
TYPES = {"linear_attention": "deltanet", "full_attention": "attention"}  # theirs -> the GPT's layer_types


def to_gpt(c: dict, where: str, defaults: dict = DEFAULTS, kind: str = KIND) -> dict:
    """The GPT's arguments of a qwen3_5_text config.json (or of the layers of another family's, `kind`, whose config
    class has these `defaults`: shard/hf/qwen3_next.py's)."""
    get = typed(c, defaults, _TYPES, _NULLABLE, where)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"):
        if not get(name):
            raise UserError(f"{where}: config.json has {name}=0; it must be at least 1")
    if get("hidden_act") != "silu":
        raise UserError(f"{where}: config.json has hidden_act={get('hidden_act')!r}; {kind} is read with silu only")
    if get("attention_bias"):
        raise UserError(f"{where}: config.json has attention_bias=true, which is not implemented for {kind} "
                        "(supported: false)")
    heads, kv = get("num_attention_heads"), get("num_key_value_heads")
    if heads % kv:
        raise UserError(f"{where}: config.json has num_key_value_heads={kv}; num_attention_heads={heads} must be a "
                        "multiple of it")
    n = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:
        every = get("full_attention_interval")
        if not every:
            raise UserError(f"{where}: config.json has full_attention_interval=0; it must be at least 1")
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in TYPES for t in types):
        raise UserError(f"{where}: config.json has layer_types={types!r}; {kind} reads one of {', '.join(TYPES)} per "
                        f"layer, {n} in all")
    deltanet = dict(key_heads=get("linear_num_key_heads"), value_heads=get("linear_num_value_heads"),
                    key_dim=get("linear_key_head_dim"), value_dim=get("linear_value_head_dim"),
                    conv=get("linear_conv_kernel_dim"))
    _check_linear(deltanet, where)
    head_dim = get("head_dim")
    theta, rotary = _rope(c, get, where, head_dim, kind)
    out = dict(vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=n, n_heads=heads, n_kv_heads=kv,
               d_ff=get("intermediate_size"), head_dim=head_dim, max_len=get("max_position_embeddings"),
               position="rope", norm="rmsnorm+1", mlp="swiglu", norm_eps=float(get("rms_norm_eps")),
               tie_embeddings=get("tie_word_embeddings"), qk_norm="head", attn_gate=True, rope_theta=theta,
               layer_types=[TYPES[t] for t in types], deltanet=deltanet)
    if rotary != head_dim:
        out["rotary_dim"] = rotary
    return out


def _check_linear(d: dict, where: str) -> None:
    """The linear layers' heads: value heads in groups per key head, and the values' place in the fused qkv tensor a
    whole number of value groups (so that it reads as rows of whole heads)."""
    nk, nv, dk, dv = d["key_heads"], d["value_heads"], d["key_dim"], d["value_dim"]
    if nv % nk:
        raise UserError(f"{where}: config.json has linear_num_value_heads={nv}; it must be a multiple of "
                        f"linear_num_key_heads={nk}")
    if 2 * nk * dk % (nv // nk * dv) or nv * dv % dk:
        raise UserError(f"{where}: config.json has linear_key_head_dim={dk}, linear_value_head_dim={dv}: the values "
                        "must start at a whole number of value groups in the fused qkv projection, and fill whole key "
                        "heads' rows (equal sizes do)")


def _rope(c: dict, get, where: str, head_dim: int, kind: str) -> tuple[float, int]:
    """(theta, the rotated channels of each head): rope_parameters, or rope_theta and partial_rotary_factor beside
    it; plain RoPE only (a text model's multimodal sections turn alike)."""
    params = dict(get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise UserError(f"{where}: config.json has rope_type={kind!r}, which is not supported for {kind} "
                        "(supported: default)")
    theta = params.get("rope_theta", get("rope_theta"))
    fraction = params.get("partial_rotary_factor", get("partial_rotary_factor"))
    if not is_number(theta) or theta <= 0:
        raise UserError(f"{where}: config.json has rope_theta={theta!r}; it must be a positive number")
    if not is_number(fraction) or not 0 < fraction <= 1 or int(head_dim * fraction) % 2:
        raise UserError(f"{where}: config.json has partial_rotary_factor={fraction!r}; it must be in (0, 1] and "
                        f"rotate an even number of head_dim={head_dim}'s channels")
    return float(theta), int(head_dim * fraction)


def rows(row) -> tuple:
    """Qwen3.5's tensor table (shard/hf/tables.py's rows, `row` its Row): per place {p} of the scanned period
    (blocks.layers.{p}, the Hugging Face layer i * period + p) a full layer's attention (q_proj holding each head's
    query and gate side by side) or a linear layer's (in_proj_qkv: the queries, the keys, then the values, the
    convolution's taps in the same order), its MLP and norms. Letters: gn the linear key heads, gg the value heads of
    each, gk and gd the key and value widths, gc the convolution's taps; the fused qkv axis is gq key heads' rows long,
    or gw value groups', the values starting at group go."""
    L = "model.layers.{i}."
    A, N, B = L + "self_attn.", L + "linear_attn.", "blocks.layers.{p}."
    at, lin = B + "attn.", "(gn gg gd)"
    keys, values = {"gn": "gq"}, {"gn": "gw"}  # the fused qkv axis: so many key heads' rows, or value groups' rows
    parts = (("query", "conv_q", "(gn gk)", "gn gk", {}, keys),
             ("key", "conv_k", "(gn gk)", "gn gk", {"gn": "gn"}, keys),
             ("value", "conv_v", lin, "gn gg gd", {"gn": "go"}, values))
    return (row("tok", "model.embed_tokens.weight", "v e", "v e"),
            row(at + "q", A + "q_proj.weight", "(h s d) e", "e h d", {"s": 0}),
            row(at + "gate", A + "q_proj.weight", "(h s d) e", "e h d", {"s": 1}),
            row(at + "kv", A + "k_proj.weight", "(k d) e", "e s k d", {"s": 0}),
            row(at + "kv", A + "v_proj.weight", "(k d) e", "e s k d", {"s": 1}),
            row(at + "out", A + "o_proj.weight", "e (h d)", "h d e"),
            row(at + "q_norm.scale", A + "q_norm.weight", "d", "d"),
            row(at + "k_norm.scale", A + "k_norm.weight", "d", "d"),
            *(one for ours, conv, axes, letters, place, wide in parts for one in (
                row(at + ours, N + "in_proj_qkv.weight", f"{axes} e", f"e {letters}", place, wide),
                row(at + conv, N + "conv1d.weight", f"{axes} o gc", f"gc {letters}", {"o": 0, **place}, wide))),
            *(row(at + ours, N + theirs, their_axes, our_axes) for ours, theirs, their_axes, our_axes in (
                ("z", "in_proj_z.weight", f"{lin} e", "e gn gg gd"), ("b", "in_proj_b.weight", "(gn gg) e", "e gn gg"),
                ("a", "in_proj_a.weight", "(gn gg) e", "e gn gg"), ("A_log", "A_log", "(gn gg)", "gn gg"),
                ("dt_bias", "dt_bias", "(gn gg)", "gn gg"), ("norm", "norm.weight", "gd", "gd"),
                ("proj", "out_proj.weight", f"e {lin}", "gn gg gd e"))),
            *(row(B + ours, L + theirs, their_axes, our_axes) for ours, theirs, their_axes, our_axes in (
                ("ffn.w_gate", "mlp.gate_proj.weight", "f e", "e f"), ("ffn.w_in", "mlp.up_proj.weight", "f e", "e f"),
                ("ffn.w_out", "mlp.down_proj.weight", "e f", "f e"), ("ln1.scale", "input_layernorm.weight", "e", "e"),
                ("ln2.scale", "post_attention_layernorm.weight", "e", "e"))),
            row("ln_f.scale", "model.norm.weight", "e", "e"), row("head", "lm_head.weight", "v e", "e v"))


def sizes(g: dict) -> dict:
    """The letters of `rows` for a GPT's arguments (with every default)."""
    d = g.get("deltanet")
    if not d:
        return {}
    group, keys = d["value_heads"] // d["key_heads"], d["key_heads"] * d["key_dim"]
    fused, width = 2 * keys + d["value_heads"] * d["value_dim"], group * d["value_dim"]
    types = g["layer_types"]
    period = next(p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types)))
    return dict(gn=d["key_heads"], gg=group, gk=d["key_dim"], gd=d["value_dim"], gc=d["conv"],
                go=2 * keys // width, gq=fused // d["key_dim"], gw=fused // width, period=period)


def is_qwen3_5(g: dict) -> bool:
    """A GPT with linear layers or gated attention: written as qwen3_5_text, and only so."""
    return bool(g.get("layer_types") or g.get("attn_gate"))


def from_gpt(g: dict) -> dict:
    """The qwen3_5_text config.json of a GPT's arguments (with_defaults'); one line naming what Qwen3.5 cannot
    hold."""
    want = dict(position="rope", norm="rmsnorm+1", mlp="swiglu", qk_norm="head", attn_gate=True, norms="pre",
                qkv_bias=False, bias=False, mlp_bias=False, attn_bias=False, attn_sinks=False, embed_scale=False,
                rope_interleaved=False, rope_scaling=None, windows=None, chunks=None, rope_layers=None,
                attn_softcap=0.0, attn_scale=0.0, logit_softcap=0.0)
    wrong = {k: g.get(k) for k, v in want.items() if (g.get(k) or None) != (v or None)}
    if not g.get("layer_types"):
        wrong["layer_types"] = g.get("layer_types")
    if wrong:
        raise UserError(f"--format hf: {', '.join(f'{k}={v!r}' for k, v in wrong.items())} fits no {KIND} config.json:"
                        f" Qwen3.5 has {', '.join(f'{k}={v!r}' for k, v in want.items() if k in wrong)}"
                        f"{' and layer_types' if 'layer_types' in wrong else ''}")
    d = g["deltanet"] or {}
    rotary = g["rotary_dim"] or g["head_dim"]
    theirs = {v: k for k, v in TYPES.items()}
    return dict(model_type=KIND, architectures=[ARCHITECTURE], vocab_size=g["vocab_size"], hidden_size=g["d_model"],
                intermediate_size=g["d_ff"], num_hidden_layers=g["n_layers"], num_attention_heads=g["n_heads"],
                num_key_value_heads=g["n_kv_heads"], head_dim=g["head_dim"], hidden_act="silu",
                max_position_embeddings=g["max_len"], rms_norm_eps=g["norm_eps"],
                tie_word_embeddings=g["tie_embeddings"], attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": g["rope_theta"],
                                 "partial_rotary_factor": rotary / g["head_dim"]},
                layer_types=[theirs[t] for t in g["layer_types"]],
                linear_conv_kernel_dim=d.get("conv", 4), linear_key_head_dim=d.get("key_dim", 128),
                linear_value_head_dim=d.get("value_dim", 128), linear_num_key_heads=d.get("key_heads", 16),
                linear_num_value_heads=d.get("value_heads", 32), torch_dtype="float32", pad_token_id=None,
                bos_token_id=None, eos_token_id=None)
