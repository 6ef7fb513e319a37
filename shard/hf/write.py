"""A run's model as a Hugging Face folder: config.json, generation_config.json, safetensors shards (with
their index when there are several), the run's tokenizer files. Written from the sharded state without the
whole model on one host: the parameters that share a tensor (GPT-2's q and kv in c_attn; else one) are
gathered at a time, turned into their tensors, and written in files of at most `shard_bytes`; only process
0 writes. The tensors are in the source folder's dtype where the run started from one (train.init_from),
else in the parameters' own."""

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from shard.errors import UserError
from shard.hf import INDEX, arch, mtp, tables
from shard.hf.read import Folder, flat_paths

SHARD_BYTES = 2 * 1024**3
DTYPES = ("float32", "bfloat16", "float16", "float64")  # config.json's names; numpy's, bfloat16 from ml_dtypes
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION = "generation_config.json"


def families(rows: list[tables.Row]) -> list[list[tables.Row]]:
    """Rows grouped so that every tensor is made from one group's parameters (connected by shared tensors)."""
    groups: list[list[int]] = []
    for i, r in enumerate(rows):
        joined = [g for g in groups if any(rows[j].ours == r.ours or rows[j].theirs == r.theirs for j in g)]
        groups = [g for g in groups if g not in joined] + [sorted(sum(joined, [i]))]
    return [[rows[j] for j in g] for g in groups]


def their_tensors(rows: list[tables.Row], values: dict[str, np.ndarray], size: dict) -> dict:
    """The Hugging Face tensors `rows` make from our parameters' whole values (path -> array)."""
    out: dict[str, np.ndarray] = {}
    for r in rows:
        theirs = [l for g in r.groups() for l in g]
        for layer in (range(values[r.ours].shape[0]) if r.layered else [None]):  # (a stack's own layers)
            name = r.layer(layer) if r.layered else r.theirs
            full = out.setdefault(name, np.zeros(tables.their_shape(r, size), np.float32))
            v = values[r.ours] if layer is None else values[r.ours][layer]
            mine = list(r.letters())
            for l, at in r.at.items():  # letters only ours: this tensor takes one index of them
                if l in mine and l not in theirs:
                    v, mine = np.take(v, at, axis=mine.index(l)), [m for m in mine if m != l]
            v = v.transpose([mine.index(l) for l in theirs if l in mine])
            where = tuple(slice(r.at.get(l, 0), r.at.get(l, 0) + v.shape[[m for m in theirs if m in mine].index(l)])
                          if l in mine else r.at[l] for l in theirs)
            full.reshape(r.their_sizes(theirs, size))[where] = v
    return out


def host_value(x) -> np.ndarray:
    """One parameter whole on this host (all processes take part where it spans several)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x), np.float32)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float32)


def dtype_of(params, source: Folder | None) -> str:
    """The dtype to write: the source folder's config.json's (dtype, or torch_dtype as transformers 4 named
    it), else the parameters' own."""
    if source is not None:
        given = source.config.get("dtype") or source.config.get("torch_dtype")
        if given is not None:
            name = str(given).removeprefix("torch.")
            if name not in DTYPES:
                raise UserError(f"{source.where}: config.json has dtype={given!r}; transformers writes one of "
                                f"{', '.join(DTYPES)}")
            return name
    return str(np.dtype(jax.tree.leaves(params)[0].dtype))


def implied_zeros(kind: str, g: dict, size: dict) -> dict[str, np.ndarray]:
    """Tensors config.json implies that the model holds as zeros: a Llama whose linear layers all have biases
    (bias=true) has mlp_bias, so a gate bias, which the GPT's gate has only with mlp_bias."""
    if kind != "llama" or not g["bias"] or g["mlp_bias"] or g["mlp"] == "gelu":
        return {}
    return {f"model.layers.{i}.mlp.gate_proj.bias": np.zeros(size["f"], np.float32) for i in range(g["n_layers"])}


def write_folder(params, model_name: str, kwargs: dict, out: Path, tokenizer_dir: Path | None,
                 shard_bytes: int | None = None, source: Folder | None = None, rest=None) -> tuple[int, int]:
    """Write the folder (into a scratch folder beside `out`, renamed when complete): (files, bytes). `source`:
    the Hugging Face folder the run started from, whose dtype, special token ids and generation_config.json
    the folder takes. `rest`: the model's other variables, those a folder holds written too (a router's correction
    bias)."""
    import ml_dtypes

    config, shard_bytes = arch.from_gpt(kwargs, model_name), shard_bytes or SHARD_BYTES
    config["torch_dtype"] = config["dtype"] = dtype_of(params, source)  # each transformers version's name
    cast = ml_dtypes.bfloat16 if config["dtype"] == "bfloat16" else np.dtype(config["dtype"])
    kind, g = config["model_type"], arch.with_defaults(kwargs)
    ours = {**flat_paths(rest if rest is not None else {}), **flat_paths(params)}
    size, main = tables.sizes(g, kind), jax.process_index() == 0
    rows = tables.rows(kind, set(ours), size)
    tokenizer = _tokenizer_files(tokenizer_dir, config)  # a tokenizer it cannot hold is refused before any file
    scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.")) if main else None
    files, pending, total, weight_map = [], {}, 0, {}

    def flush():
        nonlocal pending
        if pending and main:
            from safetensors.numpy import save_file

            name = f"part-{len(files):05d}.safetensors"
            save_file(pending, str(scratch / name), metadata={"format": "pt"})
            files.append((name, list(pending)))
        pending = {}

    def add(tensors: dict):
        nonlocal total
        for name, tensor in tensors.items():
            tensor = tensor.astype(cast, copy=False)
            if pending and sum(t.nbytes for t in pending.values()) + tensor.nbytes > shard_bytes:
                flush()
            pending[name] = tensor
            total += tensor.nbytes

    try:
        for family in families(rows):
            values = {r.ours: host_value(ours[r.ours]) for r in family}
            tensors = their_tensors(family, values, size)
            add({**tensors, **mtp.copies(tensors, g)})  # (a multi-token-prediction layer's copy of the model's own)
            del values
        add(implied_zeros(kind, g, size))
        flush()
        if main:
            _finish(scratch, out, files, total, config, tokenizer, source)
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    return len(files), total


def _finish(scratch: Path, out: Path, files: list, total: int, config: dict, tokenizer: dict[str, bytes],
            source: Folder | None = None) -> None:
    """Name the shards as transformers does, write the index, the tokenizer's files (`_tokenizer_files`), config,
    generation config, and move into place."""
    weight_map = {}
    for i, (name, tensors) in enumerate(files):
        final = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(scratch / name, scratch / final)
        weight_map.update({t: final for t in tensors})
    if len(files) > 1:
        (scratch / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
    for name, content in tokenizer.items():
        (scratch / name).write_bytes(content)
    for k in SPECIAL_IDS if source is not None else ():  # the source model's ids where the tokenizer gave none
        if config.get(k) is None and k in source.config:  # null too: a family's default may be past the vocabulary
            config[k] = source.config[k]
    (scratch / "config.json").write_text(json.dumps(config, indent=2))
    given = source.path / GENERATION if source is not None else None
    if given is not None and given.is_file():
        shutil.copyfile(given, scratch / GENERATION)
    elif not (scratch / GENERATION).is_file():  # else the run's tokenizer copy's; else what transformers derives
        # from config.json where a folder has none
        ids = {k: config[k] for k in SPECIAL_IDS if config.get(k) is not None}
        (scratch / GENERATION).write_text(json.dumps({"_from_model_config": True, **ids}, indent=2))
    if out.exists():  # an empty folder (checked by the caller) gives way
        out.rmdir()
    os.replace(scratch, out)


def _tokenizer_files(tokenizer_dir: Path | None, config: dict) -> dict[str, bytes]:
    """The run's tokenizer files (name -> content) as the folder is to hold them, read by transformers as the run
    reads them under config.json's model_type (`_keep_class`); `config` takes their special ids. {} where the run
    has none."""
    if tokenizer_dir is None or not tokenizer_dir.is_dir():
        return {}
    files = {f.name: f.read_bytes() for f in tokenizer_dir.iterdir()}
    kept = _tokenizer_in(tokenizer_dir)
    if kept is not None:
        config.update(_special_ids(kept))
        _keep_class(files, kept, config)
    return files


def _tokenizer_in(folder: Path):
    """The tokenizer in the run's copy `folder`, as the run reads it (its config.json the source's MODEL_KEYS), or
    None where there is none."""
    from shard.data import tokenizer, tokenizer_files

    return tokenizer.load(str(folder)) if tokenizer_files.present(folder) else None


def _special_ids(t) -> dict:
    """BOS and EOS ids of the run's tokenizer, for config.json (generate stops at EOS)."""
    return {k: v for k, v in (("bos_token_id", t.bos), ("eos_token_id", t.eos)) if v is not None}


def _keep_class(files: dict[str, bytes], t, config: dict) -> None:
    """Make transformers read the tokenizer `t` (its files `files`, changed in place) as the run read it.
    config.json's model_type picks the class for some families (shard/data/auto_class.py), and a model may be
    written as another family than its tokenizer's source (Phi-3's files name LlamaTokenizer, are read as written
    for model_type phi3, and a Phi-3 without longrope or partial rotary is written as llama): where the classes
    differ, tokenizer_config.json names the run's. Where no name wins over the written model_type: one registered to
    the file as written (a windowed Llama is written as mistral) gets the run's own pipeline as its tokenizer.json;
    one whose registered class overrides any named one (qwen2: a Llama with qkv_bias) is refused."""
    from shard.data import auto_class

    model = {k: config[k] for k in auto_class.MODEL_KEYS if isinstance(config.get(k), str)}
    read = t.read_as(t.found.config, model)[0]
    if read == t.cls:
        return
    named = "TokenizersBackend" if t.cls == auto_class.GENERIC else t.cls  # transformers 5's name of the file as is
    if t.read_as({**t.found.config, "tokenizer_class": named}, model)[0] == t.cls:
        given = files.get("tokenizer_config.json")
        text = given.decode("utf-8") if given is not None else None  # from bytes: its line ends kept
        files["tokenizer_config.json"] = _with_class(text, named).encode("utf-8")
    elif read == auto_class.GENERIC:
        files["tokenizer.json"] = _as_file(t)
    else:
        raise UserError(f"--format hf: the model is written as model_type {config['model_type']}, whose tokenizer "
                        f"transformers builds as {read} whatever the files name, but the run read its tokenizer as "
                        f"{t.cls}: the folder would not tokenize text as training did (export a run whose tokenizer "
                        f"is read as {read})")


def _as_file(t) -> bytes:
    """The run's tokenizer `t` as a tokenizer.json that transformers reads as written: the pipeline the run built
    (its class's, not the file's), and the special ids it puts around a text as the post-processor (a .model's or
    vocab.json's come from tokenizer_config.json's flags, which transformers ignores beside a tokenizer.json)."""
    spec = json.loads(t.tok.to_str())
    if t.found.kind != "json" and (t.head or t.tail):
        spec["post_processor"] = _around(t)
    return (json.dumps(spec, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _around(t) -> dict:
    """A TemplateProcessing that puts `t`'s special ids before and after a text (a pair's: around each text, as
    LlamaTokenizer's update_post_processor lays them out)."""
    def part(seq: str, type_id: int) -> list:
        special = lambda ids: [{"SpecialToken": {"id": t.tok.id_to_token(i), "type_id": type_id}} for i in ids]
        return [*special(t.head), {"Sequence": {"id": seq, "type_id": type_id}}, *special(t.tail)]
    names = {t.tok.id_to_token(i): i for i in (*t.head, *t.tail)}
    return {"type": "TemplateProcessing", "single": part("A", 0), "pair": part("A", 0) + part("B", 1),
            "special_tokens": {k: {"id": k, "ids": [i], "tokens": [k]} for k, i in names.items()}}


def _with_class(text: str | None, cls: str) -> str:
    """tokenizer_config.json's text (None: none) with "tokenizer_class" set to `cls`, every other byte as it was."""
    if text is None:
        return json.dumps({"tokenizer_class": cls}, indent=2) + "\n"
    want = {**json.loads(text), "tokenizer_class": cls}
    value = json.dumps(cls, ensure_ascii=False)
    edits = [text[:m.start(2)] + value + text[m.end(2):]
             for m in re.finditer(r'("tokenizer_class"\s*:\s*)("(?:[^"\\]|\\.)*"|null)', text)]
    if "tokenizer_class" not in json.loads(text):  # a new last key, before the closing brace
        end = text.rindex("}")
        head, nl = text[:end].rstrip(), "\r\n" if "\r\n" in text else "\n"
        edits.append(f'{head}{"," if head != "{" else ""}{nl}  "tokenizer_class": {value}{nl}{text[end:]}')
    # a match inside a string or a nested object leaves another object: only the top-level key's edit is kept
    return next((e for e in edits if json.loads(e) == want), json.dumps(want, indent=2, ensure_ascii=False))


def check_model(model_name: str, kwargs: dict) -> None:
    """One line where the model is none of the architectures a folder can hold."""
    arch.from_gpt(kwargs, model_name)


def check_out(out: Path) -> None:
    """A new or empty folder, whose missing parents can be made (made when it is written)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; nothing is overwritten: name a new folder")
    check_parents(out)


def check_parents(out: Path) -> None:
    """One line where `out`'s nearest existing folder above it is a file or cannot be written in."""
    above = next(p for p in out.parents if p.exists())
    if not above.is_dir():
        raise UserError(f"--out {out}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: no permission to write in {above}")
