"""config.json <-> the library model's name and arguments, for each supported architecture (`model_type`): the
dense families (shard/hf/config_in.py reads them into the GPT, shard/hf/config_out.py writes them back) and the
mixtures of experts (shard/hf/experts.py, into the library's moe; DeepSeek-V3's shard/hf/deepseek.py, GLM-4.5's
glm.py); Gemma 4
(shard/hf/gemma4.py, into the GPT's layers of models/mixed.py); Qwen3.5's linear and full layers
(shard/hf/qwen3_5.py and, with experts, qwen3_next.py)."""

from shard.errors import UserError
from shard.hf import deepseek, experts, gemma4, glm, qwen3_5, qwen3_next
from shard.hf.config_in import DENSE, DENSE_ARCHITECTURES, dense_to_gpt
from shard.hf.config_out import dense_from_gpt, with_defaults  # noqa: F401  (with_defaults: the readers' and writers')

SUPPORTED = DENSE + (gemma4.KIND,) + tuple(experts.RELATIVE) + (deepseek.KIND, glm.KIND, qwen3_5.KIND,
                                                                 *qwen3_next.ARCHITECTURES)
ARCHITECTURES = {**DENSE_ARCHITECTURES, gemma4.KIND: gemma4.ARCHITECTURE, **experts.ARCHITECTURES,
                 deepseek.KIND: deepseek.ARCHITECTURE, glm.KIND: glm.ARCHITECTURE, qwen3_5.KIND: qwen3_5.ARCHITECTURE,
                 **qwen3_next.ARCHITECTURES}


# Folders whose model_type names a model of another's architecture, read as that one (no code of theirs runs): Kimi-K2's
# (`kimi_k2`, its architectures DeepseekV3ForCausalLM and its modeling file DeepSeek-V3's)
ALIASES = {"kimi_k2": ("DeepseekV3ForCausalLM", deepseek.KIND)}


def model_type(config: dict, where: str) -> str:
    kind = config.get("model_type")
    if kind in ALIASES and config.get("architectures") == [ALIASES[kind][0]]:
        return ALIASES[kind][1]
    if kind not in SUPPORTED:
        raise UserError(f"{where}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return kind


def model_name(kind: str, kwargs: dict | None = None) -> str:
    """The library model an architecture is read into (its arguments `kwargs`, where they decide): the MoE for the
    mixture-of-experts families and a Gemma 4 with its MoE block, else the GPT."""
    sparse = kind in experts.RELATIVE or kind in (deepseek.KIND, glm.KIND) or "n_experts" in (kwargs or {})
    return "moe" if sparse else "gpt"


def to_gpt(config: dict, where: str) -> dict:
    """The arguments (model.* keys) of model_name's model for a Hugging Face config.json."""
    kind = model_type(config, where)
    if kind in experts.RELATIVE:
        return experts.to_moe(kind, config, where)
    if kind == gemma4.KIND:
        return gemma4.to_gpt(config, where)
    if kind == deepseek.KIND:
        return deepseek.to_moe(config, where)
    if kind == glm.KIND:
        return glm.to_moe(config, where)
    if kind == qwen3_5.KIND:
        return qwen3_5.to_gpt(config, where)
    if kind in qwen3_next.ARCHITECTURES:
        return qwen3_next.to_moe(kind, config, where)
    return dense_to_gpt(kind, config, where)


def from_gpt(kwargs: dict, model_name: str) -> dict:
    """The config.json of a run's model (its model.name and arguments); UserError where it is none of SUPPORTED."""
    g = with_defaults(kwargs)
    if g["mtp_depth"] and not (model_name == "moe" and (deepseek.is_deepseek(g) or glm.is_glm(g))):
        raise UserError(f"--format hf: model.mtp_depth={g['mtp_depth']}: only DeepSeek-V3's and GLM-4.5's folders "
                        "hold multi-token-prediction layers, and this model is written as neither")
    if model_name in ("gpt", "moe") and gemma4.is_gemma4(g):
        return gemma4.from_gpt(g, kwargs if model_name == "moe" else None)
    if model_name == "gpt" and qwen3_5.is_qwen3_5(g):
        return qwen3_5.from_gpt(g)
    if model_name == "moe" and qwen3_5.is_qwen3_5(g):
        return qwen3_next.from_moe(g)
    if model_name == "moe":
        return experts.from_moe(kwargs)
    return dense_from_gpt(kwargs, model_name)
