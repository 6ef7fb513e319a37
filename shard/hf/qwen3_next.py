"""The mixtures of experts among the gated DeltaNet families <-> the MoE's arguments: Qwen3.5-MoE's text model
(`qwen3_5_moe_text`, and a `qwen3_5_moe` folder's text_config) and Qwen3-Next (`qwen3_next`).

Their layers are Qwen3.5's (shard/hf/qwen3_5.py: linear and full layers by layer_types, gated attention,
zero-centred norms, partial RoPE), each with a mixture of experts for its MLP: a softmax router's top
num_experts_per_tok experts, their weights renormalised (Qwen3-Next: by norm_topk_prob), beside one shared expert whose
output is gated per token by sigmoid(x . w). Every token is computed by its experts (dropless), as transformers does.
Qwen3-Next holds its linear layers' projections fused per key head (in_proj_qkvz: each key head's query, key, its
value heads' values and gates; in_proj_ba: their betas and decays), read here into Qwen3.5's separate parameters.
"""

from shard.errors import UserError
from shard.hf import qwen3_5
from shard.hf.config_in import typed

NEXT, MOE = "qwen3_next", "qwen3_5_moe_text"
ARCHITECTURES = {NEXT: "Qwen3NextForCausalLM", MOE: "Qwen3_5MoeForCausalLM"}
# transformers 5's config defaults for the fields read here beyond Qwen3.5's
DEFAULTS = {
    MOE: dict(qwen3_5.DEFAULTS, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, intermediate_size=512,
              moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256,
              output_router_logits=False, router_aux_loss_coef=0.001, norm_topk_prob=True, mlp_only_layers=[],
              decoder_sparse_step=1),
    NEXT: dict(qwen3_5.DEFAULTS, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
               num_key_value_heads=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
               num_experts_per_tok=10, num_experts=512, output_router_logits=False, router_aux_loss_coef=0.001,
               norm_topk_prob=True, mlp_only_layers=None, decoder_sparse_step=1)}
_TYPES = dict(output_router_logits=bool, router_aux_loss_coef=float, norm_topk_prob=bool, mlp_only_layers=list)


def to_moe(kind: str, c: dict, where: str) -> dict:
    """The MoE's arguments of a qwen3_5_moe_text or qwen3_next config.json."""
    kwargs = qwen3_5.to_gpt(c, where, DEFAULTS[kind], kind)
    get = typed(c, DEFAULTS[kind], _TYPES, {"mlp_only_layers"}, where)
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if not get(name):
            raise UserError(f"{where}: config.json has {name}=0; it must be at least 1")
    n, k = get("num_experts"), get("num_experts_per_tok")
    if k > n:
        raise UserError(f"{where}: config.json has num_experts_per_tok={k}, more than num_experts={n}")
    if kind == NEXT and (get("mlp_only_layers") or get("decoder_sparse_step") != 1):
        raise UserError(f"{where}: config.json has mlp_only_layers={get('mlp_only_layers')!r}, decoder_sparse_step="
                        f"{get('decoder_sparse_step')}: only experts in every layer are supported ([] and 1)")
    coef = get("router_aux_loss_coef") if get("output_router_logits") else 0.0
    return dict(kwargs, n_experts=n, top_k=k, d_ff=get("moe_intermediate_size"), routing="dropless",
                balancing="pooled", norm_topk=get("norm_topk_prob") if kind == NEXT else True, shared_experts=1,
                shared_d_ff=get("shared_expert_intermediate_size"), shared_gate=True, aux_loss_weight=float(coef))


def rows(row, kind: str) -> tuple:
    """The family's tensor table: Qwen3.5's without its MLP, each layer's router, experts (one tensor per expert and
    matrix, as save_pretrained writes them), shared expert (gz wide) and its gate; Qwen3-Next's linear projections
    fused per key head (gh: a key head's rows of in_proj_qkvz, in value widths gy; gf the values' first; g2 the betas'
    and decays' of in_proj_ba)."""
    L, B = "model.layers.{i}.", "blocks.layers.{p}."
    M, E, N = L + "mlp.", L + "mlp.experts.{x}.", L + "linear_attn."
    out = [r for r in qwen3_5.rows(row) if ".ffn." not in r.ours]
    if kind == NEXT:
        fused = {"query", "key", "value", "z", "b", "a"}
        out = [r for r in out if r.ours.rsplit(".", 1)[-1] not in fused]
        at, qkvz, lin = B + "attn.", N + "in_proj_qkvz.weight", "(gn gg gd) e"
        out += [row(at + "query", qkvz, "(gn gk) e", "e gn gk", wide={"gk": "gh"}),
                row(at + "key", qkvz, "(gn gk) e", "e gn gk", {"gk": "gk"}, {"gk": "gh"}),
                row(at + "value", qkvz, lin, "e gn gg gd", {"gg": "gf"}, {"gg": "gy"}),
                row(at + "z", qkvz, lin, "e gn gg gd", {"gg": "gf+gg"}, {"gg": "gy"}),
                row(at + "b", N + "in_proj_ba.weight", "(gn gg) e", "e gn gg", wide={"gg": "g2"}),
                row(at + "a", N + "in_proj_ba.weight", "(gn gg) e", "e gn gg", {"gg": "gg"}, {"gg": "g2"})]
    return tuple(out + [row(B + "ffn.router", M + "gate.weight", "x e", "e x"),
                        row(B + "ffn.w_gate", E + "gate_proj.weight", "f e", "x e f"),
                        row(B + "ffn.w_in", E + "up_proj.weight", "f e", "x e f"),
                        row(B + "ffn.w_out", E + "down_proj.weight", "e f", "x f e"),
                        row(B + "ffn.shared.w_gate", M + "shared_expert.gate_proj.weight", "gz e", "e gz"),
                        row(B + "ffn.shared.w_in", M + "shared_expert.up_proj.weight", "gz e", "e gz"),
                        row(B + "ffn.shared.w_out", M + "shared_expert.down_proj.weight", "e gz", "gz e"),
                        row(B + "ffn.shared_gate", M + "shared_expert_gate.weight", "o e", "e o")])


def sizes(g: dict) -> dict:
    """The letters of `rows` beyond Qwen3.5's, for an MoE's arguments (with every default)."""
    d = g.get("deltanet")
    if not d or not g.get("n_experts"):
        return {}
    group, dk, dv = d["value_heads"] // d["key_heads"], d["key_dim"], d["value_dim"]
    return dict(gz=g.get("shared_d_ff") or g["d_ff"], gh=2 * dk + 2 * group * dv, gy=(2 * dk + 2 * group * dv) // dv,
                gf=2 * dk // dv, g2=2 * group)


def from_moe(g: dict) -> dict:
    """The qwen3_5_moe_text config.json of an MoE's arguments (with every default), or qwen3_next's where its
    router does not renormalise; one line naming what neither holds."""
    want = dict(routing="dropless", router="softmax_topk", shared_experts=1, shared_gate=True, router_bias=False,
                router_norm=False, n_group=1, topk_group=1, routed_scaling=1.0, score_correction=False,
                expert_scale=False, weigh_inputs=False, dense_layers=0, expert_bias=False, swiglu_limit=0.0,
                beside_d_ff=0)
    wrong = {k: g.get(k) for k, v in want.items() if g.get(k, v) != v}
    if wrong:
        raise UserError(f"--format hf: {', '.join(f'{k}={v!r}' for k, v in wrong.items())} fits no {MOE} or {NEXT} "
                        "config.json: their experts have "
                        f"{', '.join(f'{k}={v!r}' for k, v in want.items() if k in wrong)}")
    kind = MOE if g.get("norm_topk", True) else NEXT
    out = qwen3_5.from_gpt(g)
    del out["intermediate_size"]
    return dict(out, model_type=kind, architectures=[ARCHITECTURES[kind]], num_experts=g.get("n_experts", 8),
                num_experts_per_tok=g.get("top_k", 2), moe_intermediate_size=g["d_ff"],
                shared_expert_intermediate_size=g.get("shared_d_ff") or g["d_ff"], norm_topk_prob=kind == MOE,
                output_router_logits=bool(g.get("aux_loss_weight")),
                router_aux_loss_coef=float(g.get("aux_loss_weight") or 0.001))
