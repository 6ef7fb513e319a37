"""Which Hugging Face tensor fills which part of which GPT parameter: one table per architecture, read
in both directions (import and export), and by whoever needs the Hugging Face module names (LoRA).

A row is (our parameter, Hugging Face tensor, its axes, our axes, offsets). Axes are written with one
letter per dimension of the model: e embed, h heads, k kv heads, d head_dim, f mlp, v vocab, p positions,
s the stacked parts of a fused tensor (our K/V pair, GPT-2's q/k/v). A parenthesised group is one
Hugging Face axis holding several of ours flattened, row-major: "(h d) e" is a (heads x head_dim, embed)
matrix. Our stacked block parameters have a leading layers axis that the tensor's `{i}` stands for.
Offsets: for a letter in both, Hugging Face index = ours + offset; only in theirs, the one index taken;
only in ours, the one index of ours this tensor fills (K is part 0 of our K/V pair, V part 1). An offset may be
a sum of letters' sizes ("h+k": after the query heads and the keys'), resolved by `rows` for a model's sizes.
Wide: a letter in both whose Hugging Face axis is longer than ours, named by the letter giving its size (j: the
query, key and value heads of Phi-3's fused qkv_proj, where the keys start at offset h).
Layers unlike the others (models/mixed.py's, stored per layer): a row whose parameter's path holds `{i}` too stands
for one row per layer the model has it in, each with that layer's sizes where they differ (`sizes`' "layers").
A period of a scanned pattern of unlike layers (models/mixed.py's Period): a parameter path holding `{p}` stands for
one row per place of the period the model has it at, the Hugging Face layer of the stack's entry i and place p being
i * period + p (`stride`, `offset`).
Experts: x is a mixture of experts' experts axis; a tensor named with `{x}` is one expert's (Mixtral's
experts.{x}.w1), standing for one row per expert, each filling that index of our experts axis.
"""

import re
from dataclasses import dataclass, field, replace

from shard.hf import deepseek, glm, mtp, qwen3_5, qwen3_next


@dataclass(frozen=True)
class Row:
    ours: str                 # our parameter's path, e.g. "blocks.attn.q"
    theirs: str               # the tensor's name, "{i}" for the layer
    their_axes: str           # e.g. "(h d) e"
    our_axes: str             # e.g. "e h d" (without the layers axis)
    at: dict = field(default_factory=dict)
    wide: dict = field(default_factory=dict)  # letter -> the letter whose size its axis has in their tensor
    size: dict = field(default_factory=dict)  # letter -> its size in this row's layer, where it differs (a wider one)
    offset: int = 0  # a stack's first layer's index among theirs (the experts' layers after the dense first ones)
    stride: int = 1  # their layers per entry of the stack (a scanned period's)

    @property
    def layered(self) -> bool:
        """A row of a stacked parameter, one layer of it a tensor (a row per unlike layer is not)."""
        return "{i}" in self.theirs and "{i}" not in self.ours

    def groups(self) -> list[tuple[str, ...]]:
        """Their axes as tuples of letters: "(h d) e" -> [("h", "d"), ("e",)]."""
        return [tuple(g.strip("()").split()) for g in re.findall(r"\([^)]*\)|\S+", self.their_axes)]

    def layer(self, i: int) -> str:
        """Their tensor's name for the stack's layer i."""
        return self.theirs.format(i=i * self.stride + self.offset)

    @property
    def fused(self) -> bool:
        """Whether its tensor holds other rows' parameters too (Phi-3's qkv_proj: a wide axis, or an offset along one
        of its axes), rather than one part of our parameter (a K/V pair's K)."""
        return bool(self.wide) or any(l in {x for g in self.groups() for x in g} for l in self.at)

    def letters(self) -> tuple[str, ...]:
        return tuple(self.our_axes.split())

    def their_sizes(self, group: tuple[str, ...], size: dict) -> list[int]:
        size = {**size, **self.size}
        return [size[self.wide.get(l, l)] for l in group]


LLAMA_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
OLMO2_NORMS = {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"}
GEMMA2_NORMS = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm",
                "ln2": "pre_feedforward_layernorm", "ln2_post": "post_feedforward_layernorm"}


def _llama_like(norms: dict = LLAMA_NORMS, qk_norm: str | None = None, fused: bool = False) -> tuple[Row, ...]:
    """Llama's names, with the block's norms named `norms` (ours -> theirs), the query/key norms over each head
    ("head") or the whole projection ("projection"), and Phi-3's fused qkv_proj and gate_up_proj (`fused`)."""
    L = "model.layers.{i}."
    A = L + "self_attn."
    rows = [Row("tok", "model.embed_tokens.weight", "v e", "v e")]
    if fused:  # qkv_proj: queries, then keys, then values along its rows; gate_up_proj: gate, then up
        rows += [Row("blocks.attn.q", A + "qkv_proj.weight", "(h d) e", "e h d", wide={"h": "j"}),
                 Row("blocks.attn.kv", A + "qkv_proj.weight", "(k d) e", "e s k d", {"s": 0, "k": "h"}, {"k": "j"}),
                 Row("blocks.attn.kv", A + "qkv_proj.weight", "(k d) e", "e s k d", {"s": 1, "k": "h+k"}, {"k": "j"}),
                 Row("blocks.ffn.w_gate", L + "mlp.gate_up_proj.weight", "(s f) e", "e f", {"s": 0}),
                 Row("blocks.ffn.w_in", L + "mlp.gate_up_proj.weight", "(s f) e", "e f", {"s": 1})]
    else:
        rows += [Row("blocks.attn.q", A + "q_proj.weight", "(h d) e", "e h d"),
                 Row("blocks.attn.kv", A + "k_proj.weight", "(k d) e", "e s k d", {"s": 0}),
                 Row("blocks.attn.kv", A + "v_proj.weight", "(k d) e", "e s k d", {"s": 1}),
                 Row("blocks.ffn.w_gate", L + "mlp.gate_proj.weight", "f e", "e f"),
                 Row("blocks.ffn.w_in", L + "mlp.up_proj.weight", "f e", "e f")]
    rows += [
        Row("blocks.attn.out", A + "o_proj.weight", "e (h d)", "h d e"),
        Row("blocks.attn.q_bias", A + "q_proj.bias", "(h d)", "h d"),
        Row("blocks.attn.kv_bias", A + "k_proj.bias", "(k d)", "s k d", {"s": 0}),
        Row("blocks.attn.kv_bias", A + "v_proj.bias", "(k d)", "s k d", {"s": 1}),
        Row("blocks.attn.out_bias", A + "o_proj.bias", "e", "e"),
        Row("blocks.ffn.b_gate", L + "mlp.gate_proj.bias", "f", "f"),
        Row("blocks.ffn.w_out", L + "mlp.down_proj.weight", "e f", "f e"),
        Row("blocks.ffn.b_in", L + "mlp.up_proj.bias", "f", "f"),
        Row("blocks.ffn.b_out", L + "mlp.down_proj.bias", "e", "e"),
    ]
    if qk_norm == "head":
        rows += [Row("blocks.attn.q_norm.scale", A + "q_norm.weight", "d", "d"),
                 Row("blocks.attn.k_norm.scale", A + "k_norm.weight", "d", "d")]
    if qk_norm == "projection":
        rows += [Row("blocks.attn.q_norm.scale", A + "q_norm.weight", "(h d)", "h d"),
                 Row("blocks.attn.k_norm.scale", A + "k_norm.weight", "(k d)", "k d")]
    rows += [Row(f"blocks.{ours}.scale", f"{L}{theirs}.weight", "e", "e") for ours, theirs in norms.items()]
    rows += [Row("ln_f.scale", "model.norm.weight", "e", "e"), Row("head", "lm_head.weight", "v e", "e v")]
    return tuple(rows)


def _gpt2() -> tuple[Row, ...]:
    H = "transformer.h.{i}."
    # Conv1D layers store their weights (in, out), the transpose of a Linear's; c_attn holds q, k, v side by side.
    return (
        Row("tok", "transformer.wte.weight", "v e", "v e"),
        Row("pos", "transformer.wpe.weight", "p e", "p e"),
        Row("blocks.ln1.scale", H + "ln_1.weight", "e", "e"),
        Row("blocks.ln1.bias", H + "ln_1.bias", "e", "e"),
        Row("blocks.attn.q", H + "attn.c_attn.weight", "e (s h d)", "e h d", {"s": 0}),
        Row("blocks.attn.kv", H + "attn.c_attn.weight", "e (s h d)", "e s h d", {"s": 1}),
        Row("blocks.attn.q_bias", H + "attn.c_attn.bias", "(s h d)", "h d", {"s": 0}),
        Row("blocks.attn.kv_bias", H + "attn.c_attn.bias", "(s h d)", "s h d", {"s": 1}),
        Row("blocks.attn.out", H + "attn.c_proj.weight", "(h d) e", "h d e"),
        Row("blocks.attn.out_bias", H + "attn.c_proj.bias", "e", "e"),
        Row("blocks.ln2.scale", H + "ln_2.weight", "e", "e"),
        Row("blocks.ln2.bias", H + "ln_2.bias", "e", "e"),
        Row("blocks.ffn.w_in", H + "mlp.c_fc.weight", "e f", "e f"),
        Row("blocks.ffn.b_in", H + "mlp.c_fc.bias", "f", "f"),
        Row("blocks.ffn.w_out", H + "mlp.c_proj.weight", "f e", "f e"),
        Row("blocks.ffn.b_out", H + "mlp.c_proj.bias", "e", "e"),
        Row("ln_f.scale", "transformer.ln_f.weight", "e", "e"),
        Row("ln_f.bias", "transformer.ln_f.bias", "e", "e"),
        Row("head", "lm_head.weight", "v e", "e v"),
    )


_LLAMA = _llama_like()  # Mistral, Qwen2, Gemma and SmolLM3 name their tensors as Llama does
TABLES = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gemma": _LLAMA, "gpt2": _gpt2(),
          "qwen3": _llama_like(qk_norm="head"), "smollm3": _LLAMA,
          "olmo2": _llama_like(OLMO2_NORMS, qk_norm="projection"), "phi3": _llama_like(fused=True),
          "olmo3": _llama_like(OLMO2_NORMS, qk_norm="projection"),
          "gemma2": _llama_like(GEMMA2_NORMS), "gemma3_text": _llama_like(GEMMA2_NORMS, qk_norm="head")}


def _attention_rows(qk_norm: str | None) -> list[Row]:
    """A Llama's rows but its MLP's: the embeddings, attention, norms and output layer a mixture of experts keeps."""
    return [r for r in _llama_like(qk_norm=qk_norm) if not r.ours.startswith("blocks.ffn.")]


def _experts(qk_norm: str | None, block: str, gate: str, up: str, down: str) -> tuple[Row, ...]:
    """A mixture of experts' table: Llama's names for the rest, and for each block's router (`block`.gate) and
    experts (`block`.experts.{x}.`gate`, `up`, `down`)."""
    L, E = f"model.layers.{{i}}.{block}.", f"model.layers.{{i}}.{block}.experts.{{x}}."
    rest = _attention_rows(qk_norm)
    return tuple(rest + [Row("blocks.ffn.router", L + "gate.weight", "x e", "e x"),
                         Row("blocks.ffn.w_gate", E + gate + ".weight", "f e", "x e f"),
                         Row("blocks.ffn.w_in", E + up + ".weight", "f e", "x e f"),
                         Row("blocks.ffn.w_out", E + down + ".weight", "e f", "x f e")])


def _fused_experts(qk_norm: str | None) -> tuple[Row, ...]:
    """transformers 5's own modules of both families: every expert in one 3-D parameter per matrix (gate and up
    side by side in gate_up_proj), under mlp (Mixtral's block_sparse_moe renamed). Its save_pretrained writes the
    per-expert tensors back by default; with save_original_format=False it writes these."""
    L = "model.layers.{i}.mlp."
    rest = _attention_rows(qk_norm)
    return tuple(rest + [Row("blocks.ffn.router", L + "gate.weight", "x e", "e x"),
                         Row("blocks.ffn.w_gate", L + "experts.gate_up_proj", "x (s f) e", "x e f", {"s": 0}),
                         Row("blocks.ffn.w_in", L + "experts.gate_up_proj", "x (s f) e", "x e f", {"s": 1}),
                         Row("blocks.ffn.w_out", L + "experts.down_proj", "x e f", "x f e")])


def _gpt_oss() -> tuple[Row, ...]:
    """GPT-OSS: Llama's attention with its biases and sinks; the router a Linear with a bias; the experts stacked
    (experts, in, out), gate and up interleaved along gate_up_proj's last axis (gate at the even columns), with
    their biases. A checkpoint's MXFP4 experts (`_blocks`, `_scales`) are read as these (shard/hf/mxfp4.py)."""
    L = "model.layers.{i}.mlp."
    rest = _attention_rows(None)
    return tuple(rest + [Row("blocks.attn.sinks", "model.layers.{i}.self_attn.sinks", "h", "h"),
                         Row("blocks.ffn.router", L + "router.weight", "x e", "e x"),
                         Row("blocks.ffn.router_bias", L + "router.bias", "x", "x"),
                         Row("blocks.ffn.w_gate", L + "experts.gate_up_proj", "x e (f s)", "x e f", {"s": 0}),
                         Row("blocks.ffn.w_in", L + "experts.gate_up_proj", "x e (f s)", "x e f", {"s": 1}),
                         Row("blocks.ffn.b_gate", L + "experts.gate_up_proj_bias", "x (f s)", "x f", {"s": 0}),
                         Row("blocks.ffn.b_in", L + "experts.gate_up_proj_bias", "x (f s)", "x f", {"s": 1}),
                         Row("blocks.ffn.w_out", L + "experts.down_proj", "x f e", "x f e"),
                         Row("blocks.ffn.b_out", L + "experts.down_proj_bias", "x e", "x e")])


TABLES["gpt_oss"] = _gpt_oss()


def _llama4() -> tuple[Row, ...]:
    """Llama 4's text model: Llama's attention and norms; per layer a router (a Linear), the experts stacked (experts,
    in, out) with gate and up side by side in gate_up_proj, a shared expert (a Llama MLP), all under feed_forward."""
    L = "model.layers.{i}.feed_forward."
    return tuple(_attention_rows(None) + [
        Row("blocks.ffn.router", L + "router.weight", "x e", "e x"),
        Row("blocks.ffn.w_gate", L + "experts.gate_up_proj", "x e (s f)", "x e f", {"s": 0}),
        Row("blocks.ffn.w_in", L + "experts.gate_up_proj", "x e (s f)", "x e f", {"s": 1}),
        Row("blocks.ffn.w_out", L + "experts.down_proj", "x f e", "x f e"),
        Row("blocks.ffn.shared.w_gate", L + "shared_expert.gate_proj.weight", "f e", "e f"),
        Row("blocks.ffn.shared.w_in", L + "shared_expert.up_proj.weight", "f e", "e f"),
        Row("blocks.ffn.shared.w_out", L + "shared_expert.down_proj.weight", "e f", "f e")])


TABLES["llama4_text"] = _llama4()


GEMMA4_MOE_NORMS = {"ln_dense": "pre_feedforward_layernorm", "ln_dense_post": "post_feedforward_layernorm_1",
                    "ln_experts": "pre_feedforward_layernorm_2", "ln_experts_post": "post_feedforward_layernorm_2"}


def _gemma4() -> tuple[Row, ...]:
    """Gemma 4's text model, one GPT layer (models/mixed.py) per Hugging Face layer: Gemma 2's four norms, Qwen3's
    head norms, the keys' projection alone on the layers whose values are their keys (attention_k_eq_v) and none on
    the layers reusing an earlier one's; per layer its per-layer input's gate, projection and norm and its scalar;
    the per-layer embeddings (n x u wide: w) and their projection and norm."""
    L, O = "model.layers.{i}.", "layers.{i}."
    A, B = L + "self_attn.", O + "block."
    return (Row("tok", "model.embed_tokens.weight", "v e", "v e"),
            Row(B + "attn.q", A + "q_proj.weight", "(h d) e", "e h d"),
            Row(B + "attn.kv", A + "k_proj.weight", "(k d) e", "e s k d", {"s": 0}),
            Row(B + "attn.kv", A + "v_proj.weight", "(k d) e", "e s k d", {"s": 1}),
            Row(B + "attn.k", A + "k_proj.weight", "(k d) e", "e k d"),
            Row(B + "attn.out", A + "o_proj.weight", "e (h d)", "h d e"),
            Row(B + "attn.q_bias", A + "q_proj.bias", "(h d)", "h d"),
            Row(B + "attn.kv_bias", A + "k_proj.bias", "(k d)", "s k d", {"s": 0}),
            Row(B + "attn.kv_bias", A + "v_proj.bias", "(k d)", "s k d", {"s": 1}),
            Row(B + "attn.out_bias", A + "o_proj.bias", "e", "e"),
            Row(B + "attn.q_norm.scale", A + "q_norm.weight", "d", "d"),
            Row(B + "attn.k_norm.scale", A + "k_norm.weight", "d", "d"),
            *_gated_mlp(B + "ffn.", L + "mlp.", "f"),
            *(Row(f"{B}{ours}.scale", f"{L}{theirs}.weight", "e", "e") for ours, theirs in GEMMA2_NORMS.items()),
            Row(O + "gate", L + "per_layer_input_gate.weight", "u e", "e u"),
            Row(O + "proj", L + "per_layer_projection.weight", "e u", "u e"),
            Row(O + "ln_per_layer.scale", L + "post_per_layer_input_norm.weight", "e", "e"),
            Row(O + "scalar", L + "layer_scalar", "o", "o"),
            # the MoE block (enable_moe_block): the dense MLP (b wide) and the experts (f wide) side by side, each
            # with its norms; the router's projection, input scale and per-expert scale
            *_gated_mlp(B + "ffn.dense.", L + "mlp.", "b"),
            *(Row(f"{B}ffn.{ours}.scale", f"{L}{norm}.weight", "e", "e") for ours, norm in GEMMA4_MOE_NORMS.items()),
            Row(B + "ffn.experts.router", L + "router.proj.weight", "x e", "e x"),
            Row(B + "ffn.experts.router_scale", L + "router.scale", "e", "e"),
            Row(B + "ffn.experts.expert_scale", L + "router.per_expert_scale", "x", "x"),
            Row(B + "ffn.experts.w_gate", L + "experts.gate_up_proj", "x (s f) e", "x e f", {"s": 0}),
            Row(B + "ffn.experts.w_in", L + "experts.gate_up_proj", "x (s f) e", "x e f", {"s": 1}),
            Row(B + "ffn.experts.w_out", L + "experts.down_proj", "x e f", "x f e"),
            Row("per_layer.tok", "model.embed_tokens_per_layer.weight", "q w", "q w"),
            Row("per_layer.proj", "model.per_layer_model_projection.weight", "w e", "e w"),
            Row("per_layer.ln.scale", "model.per_layer_projection_norm.weight", "u", "u"),
            Row("ln_f.scale", "model.norm.weight", "e", "e"), Row("head", "lm_head.weight", "v e", "e v"))


def _gated_mlp(ours: str, theirs: str, wide: str) -> tuple[Row, ...]:
    """A gated MLP's three matrices (our w_gate, w_in, w_out under `ours`; their gate, up and down projections under
    `theirs`), its width the letter `wide`."""
    return (Row(ours + "w_gate", theirs + "gate_proj.weight", f"{wide} e", f"e {wide}"),
            Row(ours + "w_in", theirs + "up_proj.weight", f"{wide} e", f"e {wide}"),
            Row(ours + "w_out", theirs + "down_proj.weight", f"e {wide}", f"{wide} e"))


TABLES["gemma4_text"] = _gemma4()
# Gemma 4's layers scanned a period of their pattern at a time (models/mixed.py's layers, where none shares keys)
TABLES["gemma4_text"] += tuple(replace(r, ours=r.ours.replace("layers.{i}.", "blocks.layers.{p}.", 1))
                               for r in TABLES["gemma4_text"] if r.ours.startswith("layers.{i}."))
# The tables whose bare expert stacks are held (experts, in, out), the transpose of the others' (transformers'
# is_transposed): PEFT's adapters on them take their in and out features from those axes (shard/hf/peft_params.py)
EXPERTS_IN_OUT = {"gpt_oss"}
# Llama 4's stacks are (experts, in, out) too, but its module does not say so: PEFT takes their in axis for its out
EXPERTS_FLIPPED = {"llama4_text"}
TABLES["deepseek_v3"] = deepseek.rows(Row)


def _glm4_moe() -> tuple[Row, ...]:
    """GLM-4.5's table: Qwen3's attention rows (Llama's, its biases, per-head q/k norms) in both of the MoE's stacks,
    the dense first layers' and the experts' layers', then DeepSeek-V3's MLPs, experts and router."""
    attention = [r for r in _llama_like(qk_norm="head") if r.ours.startswith(("blocks.attn.", "blocks.ln"))]
    stacks = [replace(r, ours=stack + r.ours[len("blocks."):]) for stack in ("dense_blocks.", "blocks.")
              for r in attention]
    return (Row("tok", "model.embed_tokens.weight", "v e", "v e"), *stacks, *deepseek.expert_rows(Row))


TABLES[glm.KIND] = _glm4_moe()
for _kind in (deepseek.KIND, glm.KIND):  # their multi-token-prediction layers' rows, past the model's own
    TABLES[_kind] += mtp.rows(TABLES[_kind], Row)
TABLES[qwen3_5.KIND] = qwen3_5.rows(Row)
TABLES.update({kind: qwen3_next.rows(Row, kind) for kind in qwen3_next.ARCHITECTURES})
TABLES["mixtral"] = _experts(None, "block_sparse_moe", "w1", "w3", "w2")
TABLES["qwen3_moe"] = _experts("head", "mlp", "gate_proj", "up_proj", "down_proj")
TABLES["olmoe"] = _experts("projection", "mlp", "gate_proj", "up_proj", "down_proj")
# The fused layout of a family (a table of its own, chosen by what a folder holds: `layout`). Its bare parameters
# (the router's weight, the experts' stacks) are no Linear's weight: PEFT adapts them as target_parameters.
QK_NORMS = {"mixtral": None, "qwen3_moe": "head", "olmoe": "projection"}
FUSED = {kind: f"{kind}:fused" for kind in QK_NORMS}
TABLES.update({FUSED[kind]: _fused_experts(qk_norm) for kind, qk_norm in QK_NORMS.items()})


def _stacked_experts(table: tuple[Row, ...]) -> tuple[Row, ...]:
    """DeepSeek-V3's or GLM-4.5's table with each expert's three tensors as transformers 5's modules hold them, every
    expert in one 3-D parameter per matrix (gate and up side by side in gate_up_proj), as _fused_experts' families."""
    fused = {"w_gate": ("gate_up_proj", "x (s f) e", {"s": 0}), "w_in": ("gate_up_proj", "x (s f) e", {"s": 1}),
             "w_out": ("down_proj", "x e f", {})}
    out = []
    for r in table:
        if ".experts.{x}." not in r.theirs:
            out.append(r)
            continue
        name, axes, at = fused[r.ours.rsplit(".", 1)[-1]]
        out.append(replace(r, theirs=r.theirs.split("{x}.")[0] + name, their_axes=axes, at=at))
    return tuple(out)


for _kind in (deepseek.KIND, glm.KIND):
    FUSED[_kind] = f"{_kind}:fused"
    TABLES[FUSED[_kind]] = _stacked_experts(TABLES[_kind])
# (GPT-OSS's router is no Linear either; Llama 4's is one, its experts under feed_forward)
BARE = r"\.mlp\.((gate|router)\.weight|experts\.(gate_up|down)_proj)$|\.feed_forward\.experts\.(gate_up|down)_proj$"
# The base model's prefix: a folder saved from the base model alone (GPT2Model, LlamaModel: the Hub's gpt2)
# names its tensors without it, and transformers adds it when it reads them into the causal LM.
PREFIX = {kind: "model." for kind in TABLES}
PREFIX["gpt2"] = "transformer."
# Tensors older checkpoints hold that are no weights: rotary frequencies, derived from config.json (transformers
# drops them too), and GPT-2's causal mask and its fill value, which the attention builds itself.
DERIVED = {kind: r"\.rotary_emb\.inv_freq$" for kind in TABLES}
DERIVED["gpt2"] = r"\.attn\.(masked_)?bias$"


def layout(kind: str, names) -> str:
    """The table of a folder of `kind` holding tensors `names`: its fused layout where it has one and the folder
    holds a fused tensor."""
    fused = FUSED.get(kind)
    return fused if fused and any(n.endswith(".experts.down_proj") for n in names) else kind


def rows(kind: str, params: set[str], size: dict | None = None) -> list[Row]:
    """The rows of `kind`'s table whose parameter the model has (`params`: its parameters' paths), their offsets
    resolved for the letters' sizes `size` where given, an expert's row made one per expert."""
    found = offset([one for r in TABLES[kind] for one in _each_layer(r, params, size)], size)
    if size is None:
        return found
    found = [replace(r, theirs=r.theirs.replace("{x}", str(x)), at={**r.at, "x": x}) if "{x}" in r.theirs else r
             for r in found for x in (range(size["x"]) if "{x}" in r.theirs else [0])]
    return [resolved(r, size) for r in found]


def offset(found: list[Row], size: dict | None) -> list[Row]:
    """The rows of stacks whose first layer is not theirs' first, offset by the sizes `size` (None: as they are): the
    experts' stack counts on from the dense first layers', the multi-token-prediction modules from the model's last."""
    if size and size.get("dense_layers"):
        found = [replace(r, offset=size["dense_layers"]) if r.layered and r.ours.startswith("blocks.") else r
                 for r in found]
    if size and "mtp_at" in size:
        found = [replace(r, offset=size["mtp_at"]) if r.layered and r.ours.startswith("mtp.") else r for r in found]
    return found


def _each_layer(r: Row, params: set[str], size: dict | None) -> list[Row]:
    """`r` if the model has its parameter; a row of unlike layers ({i} in its path) once for each layer that has it,
    with that layer's sizes; a row of a period ({p} in its path) once for each place of the period that has it."""
    if "{p}" in r.ours:
        places = {int(m[1]) for p in params if (m := re.match(r"blocks\.layers\.(\d+)\.", p))}
        period = (size or {}).get("period") or max(places, default=0) + 1
        return [replace(r, ours=r.ours.replace("{p}", str(p)), offset=p, stride=period,
                        size=(size or {}).get("layers", {}).get(p, {}))  # (a place's sizes: its first layer's)
                for p in sorted(places) if r.ours.replace("{p}", str(p)) in params]
    if "{i}" not in r.ours:
        return [r] if r.ours in params else []
    pattern = re.compile(re.escape(r.ours).replace(re.escape("{i}"), r"(\d+)") + "$")
    layers = sorted(int(m[1]) for p in params if (m := pattern.match(p)))
    return [replace(r, ours=r.ours.replace("{i}", str(i)), theirs=r.theirs.replace("{i}", str(i)),
                    size=(size or {}).get("layers", {}).get(i, {})) for i in layers]


def resolved(r: Row, size: dict) -> Row:
    """`r` with its offsets that are sums of letters' sizes ("h+k") as numbers."""
    at = lambda v: v if isinstance(v, int) else sum(size[l] for l in v.split("+"))  # noqa: E731
    return replace(r, at={l: at(v) for l, v in r.at.items()})


def hf_names(kind: str) -> dict[str, list[str]]:
    """Per architecture, our parameter path -> the Hugging Face tensor names it is read from ("{i}" for the
    layer), e.g. "blocks.attn.kv" -> [".../k_proj.weight", ".../v_proj.weight"]."""
    out: dict[str, list[str]] = {}
    for r in TABLES[kind]:
        if r.theirs not in out.setdefault(r.ours, []):
            out[r.ours].append(r.theirs)
    return out


def sizes(g: dict, kind: str) -> dict[str, int]:
    """Each letter's size in the Hugging Face tensors, from the GPT's arguments (arch.with_defaults)."""
    n, u = g["n_layers"], g.get("per_layer_dim", 0)
    return dict(e=g["d_model"], h=g["n_heads"], k=g["n_kv_heads"], d=g["head_dim"], f=g["d_ff"], v=g["vocab_size"],
                p=g["max_len"], s=3 if kind == "gpt2" else 2, j=g["n_heads"] + 2 * g["n_kv_heads"],
                x=g.get("n_experts", 0), b=g.get("beside_d_ff", 0), u=u, w=n * u,
                q=g.get("per_layer_vocab") or g["vocab_size"], o=1,
                layers=unlike_sizes(g), dense_layers=g.get("dense_layers", 0), me=g["d_model"], mtp_at=n,
                **deepseek.sizes(g),
                **qwen3_5.sizes(g), **qwen3_next.sizes(g))


def unlike_sizes(g: dict) -> dict[int, dict]:
    """Layer -> the sizes in which it differs from the GPT's others (models/mixed.py): a global layer's head size and
    key/value heads, a layer reusing keys and values with a twice as wide MLP."""
    n, out = g["n_layers"], {}
    windows = g.get("windows") or [0] * n
    for i in range(n):
        mine = {}
        if not windows[i] and g.get("global_head_dim"):
            mine["d"] = g["global_head_dim"]
        if not windows[i] and g.get("global_kv_heads"):
            mine["k"] = g["global_kv_heads"]
        if g.get("wide_shared_mlp") and i >= n - g.get("shared_kv_layers", 0):
            mine["f"] = 2 * g["d_ff"]
        if mine:
            out[i] = mine
    return out


def their_shape(row: Row, size: dict) -> tuple[int, ...]:
    out = []
    for group in row.groups():
        n = 1
        for length in row.their_sizes(group, size):
            n *= length
        out.append(n)
    return tuple(out)
