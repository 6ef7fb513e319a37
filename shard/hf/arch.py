"""config.json <-> the library model's name and arguments, for each supported architecture (`model_type`): the
dense families (shard/hf/config_in.py reads them into the GPT, shard/hf/config_out.py writes them back) and the
mixtures of experts (shard/hf/experts.py, into the library's moe)."""

from shard.errors import UserError
from shard.hf import experts
from shard.hf.config_in import DENSE, DENSE_ARCHITECTURES, dense_to_gpt
from shard.hf.config_out import dense_from_gpt, with_defaults  # noqa: F401  (with_defaults: the readers' and writers')

SUPPORTED = DENSE + tuple(experts.RELATIVE)
ARCHITECTURES = {**DENSE_ARCHITECTURES, **experts.ARCHITECTURES}


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
    return dense_to_gpt(kind, config, where)


def from_gpt(kwargs: dict, model_name: str) -> dict:
    """The config.json of a run's model (its model.name and arguments); UserError where it is none of SUPPORTED."""
    return experts.from_moe(kwargs) if model_name == "moe" else dense_from_gpt(kwargs, model_name)
