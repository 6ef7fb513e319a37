"""Hugging Face causal-LM folders as another checkpoint format: read into the library's GPT (train.init_from,
shard.load_model) and written from a run (python -m shard.export RUN --format hf).

    arch.py        config.json <-> the library model's name and arguments, per architecture (model_type)
    config_in.py   a dense family's config.json -> the GPT's arguments (each field as transformers reads it)
    config_out.py  the GPT's arguments -> the dense family they make, as a config.json
    experts.py     the mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE) <-> the library's moe
    tables.py  per architecture, which Hugging Face tensor fills which part of which parameter (one table,
               read in both directions)
    read.py    the folder: its checks, and each process reading only its devices' slices (safetensors)
    config_only.py  a folder of config.json alone (no weights, no tokenizer): planned (--dry-run), never run
    write.py   a run's model as a folder, one parameter on the host at a time
    peft.py, peft_params.py  a LoRA run's adapters as PEFT's folder
"""

from pathlib import Path

INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> .safetensors file


def is_folder(path) -> bool:
    """Whether `path` is (meant as) a Hugging Face model folder: a local folder with a config.json or
    .safetensors files, and none of a run's or checkpoint's marks (config.yaml, checkpoints/, meta)."""
    if not path or "://" in str(path):
        return False
    p = Path(str(path)).expanduser()
    if not p.is_dir() or any((p / mark).exists() for mark in ("config.yaml", "checkpoints", "meta")):
        return False
    return (p / "config.json").is_file() or any(p.glob("*.safetensors"))
