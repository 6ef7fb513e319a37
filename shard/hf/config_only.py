"""A Hugging Face folder of config.json alone, planned: `python train.py train.init_from=FOLDER --dry-run` (or
--compare) answers whether a model fits before its weights are downloaded.

The model is read from config.json as a full folder's is (read.Folder, arch.to_gpt), and the plan builds its state
abstract (shapes, never arrays), so no weight is read or allocated. Where the folder has no tokenizer and the data
would take the folder's (data.name=documents without data.tokenizer), a plan reads that data as bytes: the
embedding and the logits are the model's vocabulary, and a compile does not depend on the tokens' values. Anything
that runs the model (training, generate, export, serve) is refused in one line by read.Folder (no weights); config
loading (shard/config/loading.py) says whether it plans.
"""

from pathlib import Path

from shard import hf
from shard.data import tokenizer_files


def has_weights(folder) -> bool:
    folder = Path(folder).expanduser()
    return (folder / hf.INDEX).is_file() or any(folder.glob("*.safetensors"))


def has_tokenizer(folder) -> bool:
    return tokenizer_files.present(Path(folder).expanduser())


def lacking(folder) -> list[str]:
    """What a run from the folder needs that it lacks: its weights, its tokenizer."""
    return [what for what, there in (("weights (.safetensors files)", has_weights(folder)),
                                     (f"tokenizer ({tokenizer_files.LOOKED_FOR})", has_tokenizer(folder))) if not there]


def refusal(where: str, folder, extra: str = "") -> str:
    """The one line for a folder without weights where the model is to run: what is missing, and what it allows."""
    missing = " and no ".join(lacking(folder)) or "weights (.safetensors files)"
    return (f"{where}: no {missing} in the folder{extra}; config.json alone only plans: python train.py "
            f"train.init_from={folder} --dry-run (training, generate, export and serve need the weights)")


def note(cfg) -> str | None:
    """The plan's line where train.init_from's folder lacked weights or (for data that wanted it) its tokenizer:
    what it was planned from and what the data's tokens are; None otherwise."""
    folder = cfg.train.init_from
    if not hf.is_folder(folder):
        return None
    tokenless = not has_tokenizer(folder)
    lm = cfg.data.name in ("text", "documents")
    tokens = "bytes" if cfg.data.name == "text" or cfg.data.tokenizer == "bytes" else f"{cfg.data.tokenizer}'s"
    data = f"; the data {cfg.data.name}, its tokens {tokens} (their values do not change a compile)" if lm else ""
    if not has_weights(folder):
        return (f"planned from config.json alone (no weights{', no tokenizer' * tokenless}): {folder}'s model at "
                f"its real size, its state abstract (nothing read or allocated){data}")
    if tokenless and cfg.data.name == "documents" and cfg.data.tokenizer == "bytes":
        return f"planned without a tokenizer (none in {folder}){data}"
    return None
