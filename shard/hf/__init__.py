"""Hugging Face causal-LM folders as another checkpoint format: read into the library's GPT (train.init_from,
shard.load_model) and written from a run (python -m shard.export RUN --format hf).

    arch.py    config.json <-> the GPT's arguments, per architecture (model_type)
    tables.py  per architecture, which Hugging Face tensor fills which part of which parameter (one table,
               read in both directions)
    read.py    the folder: its checks, and each process reading only its devices' slices (safetensors)
    write.py   a run's model as a folder, one parameter on the host at a time
"""

from pathlib import Path


def is_folder(path) -> bool:
    """Whether `path` is (meant as) a Hugging Face model folder: a local folder with a config.json or
    .safetensors files, and none of a run's or checkpoint's marks (config.yaml, checkpoints/, meta)."""
    if not path or "://" in str(path):
        return False
    p = Path(str(path)).expanduser()
    if not p.is_dir() or any((p / mark).exists() for mark in ("config.yaml", "checkpoints", "meta")):
        return False
    return (p / "config.json").is_file() or any(p.glob("*.safetensors"))
