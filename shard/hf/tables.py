"""Which Hugging Face tensor fills which part of which GPT parameter: one table per architecture, read
in both directions (import and export), and by whoever needs the Hugging Face module names (LoRA).

A row is (our parameter, Hugging Face tensor, its axes, our axes, offsets). Axes are written with one
letter per dimension of the model: e embed, h heads, k kv heads, d head_dim, f mlp, v vocab, p positions,
s the stacked parts of a fused tensor (our K/V pair, GPT-2's q/k/v). A parenthesised group is one
Hugging Face axis holding several of ours flattened, row-major: "(h d) e" is a (heads x head_dim, embed)
matrix. Our stacked block parameters have a leading layers axis that the tensor's `{i}` stands for.
Offsets: for a letter in both, Hugging Face index = ours + offset; only in theirs, the one index taken;
only in ours, the one index of ours this tensor fills (K is part 0 of our K/V pair, V part 1).
"""

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    ours: str                 # our parameter's path, e.g. "blocks.attn.q"
    theirs: str               # the tensor's name, "{i}" for the layer
    their_axes: str           # e.g. "(h d) e"
    our_axes: str             # e.g. "e h d" (without the layers axis)
    at: dict = field(default_factory=dict)

    @property
    def layered(self) -> bool:
        return "{i}" in self.theirs

    def groups(self) -> list[tuple[str, ...]]:
        """Their axes as tuples of letters: "(h d) e" -> [("h", "d"), ("e",)]."""
        return [tuple(g.strip("()").split()) for g in re.findall(r"\([^)]*\)|\S+", self.their_axes)]

    def letters(self) -> tuple[str, ...]:
        return tuple(self.our_axes.split())


def _llama_like() -> tuple[Row, ...]:
    L = "model.layers.{i}."
    rows = [
        Row("tok", "model.embed_tokens.weight", "v e", "v e"),
        Row("blocks.attn.q", L + "self_attn.q_proj.weight", "(h d) e", "e h d"),
        Row("blocks.attn.kv", L + "self_attn.k_proj.weight", "(k d) e", "e s k d", {"s": 0}),
        Row("blocks.attn.kv", L + "self_attn.v_proj.weight", "(k d) e", "e s k d", {"s": 1}),
        Row("blocks.attn.out", L + "self_attn.o_proj.weight", "e (h d)", "h d e"),
        Row("blocks.attn.q_bias", L + "self_attn.q_proj.bias", "(h d)", "h d"),
        Row("blocks.attn.kv_bias", L + "self_attn.k_proj.bias", "(k d)", "s k d", {"s": 0}),
        Row("blocks.attn.kv_bias", L + "self_attn.v_proj.bias", "(k d)", "s k d", {"s": 1}),
        Row("blocks.attn.out_bias", L + "self_attn.o_proj.bias", "e", "e"),
        Row("blocks.ffn.w_gate", L + "mlp.gate_proj.weight", "f e", "e f"),
        Row("blocks.ffn.b_gate", L + "mlp.gate_proj.bias", "f", "f"),
        Row("blocks.ffn.w_in", L + "mlp.up_proj.weight", "f e", "e f"),
        Row("blocks.ffn.w_out", L + "mlp.down_proj.weight", "e f", "f e"),
        Row("blocks.ffn.b_in", L + "mlp.up_proj.bias", "f", "f"),
        Row("blocks.ffn.b_out", L + "mlp.down_proj.bias", "e", "e"),
        Row("blocks.ln1.scale", L + "input_layernorm.weight", "e", "e"),
        Row("blocks.ln2.scale", L + "post_attention_layernorm.weight", "e", "e"),
        Row("ln_f.scale", "model.norm.weight", "e", "e"),
        Row("head", "lm_head.weight", "v e", "e v"),
    ]
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


_LLAMA = _llama_like()  # Mistral, Qwen2 and Gemma name their tensors as Llama does
TABLES = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gemma": _LLAMA, "gpt2": _gpt2()}
# The base model's prefix: a folder saved from the base model alone (GPT2Model, LlamaModel: the Hub's gpt2)
# names its tensors without it, and transformers adds it when it reads them into the causal LM.
PREFIX = {"llama": "model.", "mistral": "model.", "qwen2": "model.", "gemma": "model.", "gpt2": "transformer."}
# Tensors older checkpoints hold that are no weights: rotary frequencies, derived from config.json (transformers
# drops them too), and GPT-2's causal mask and its fill value, which the attention builds itself.
DERIVED = {kind: r"\.rotary_emb\.inv_freq$" for kind in ("llama", "mistral", "qwen2", "gemma")}
DERIVED["gpt2"] = r"\.attn\.(masked_)?bias$"


def rows(kind: str, params: set[str]) -> list[Row]:
    """The rows of `kind`'s table whose parameter the model has (`params`: its parameters' paths)."""
    return [r for r in TABLES[kind] if r.ours in params]


def hf_names(kind: str) -> dict[str, list[str]]:
    """Per architecture, our parameter path -> the Hugging Face tensor names it is read from ("{i}" for the
    layer), e.g. "blocks.attn.kv" -> [".../k_proj.weight", ".../v_proj.weight"]."""
    out: dict[str, list[str]] = {}
    for r in TABLES[kind]:
        if r.theirs not in out.setdefault(r.ours, []):
            out[r.ours].append(r.theirs)
    return out


def sizes(g: dict, kind: str) -> dict[str, int]:
    """Each letter's size in the Hugging Face tensors, from the GPT's arguments (arch._with_defaults)."""
    return dict(e=g["d_model"], h=g["n_heads"], k=g["n_kv_heads"], d=g["head_dim"], f=g["d_ff"], v=g["vocab_size"],
                p=g["max_len"], s=3 if kind == "gpt2" else 2)


def their_shape(row: Row, size: dict) -> tuple[int, ...]:
    out = []
    for group in row.groups():
        n = 1
        for letter in group:
            n *= size[letter]
        out.append(n)
    return tuple(out)
