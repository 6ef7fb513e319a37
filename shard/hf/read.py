"""Reading a Hugging Face folder into the GPT's parameters, lazily and sharded: each process reads only
the slices of each tensor its own devices hold (safetensors' slice reads, memory-mapped), straight into
the parameter's sharding, in the target's dtype. Nothing is read before every tensor's name and shape
have been checked against the model, and every tensor of the folder has a place in it: one left over is
refused, never dropped."""

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np

from shard.errors import UserError, warn
from shard.hf import INDEX, arch, config_only, deepseek, fp8, glm, mtp, mxfp4, tables


# The families whose checkpoints hold multi-token-prediction layers past num_hidden_layers (their config defaults)
MTP = {deepseek.KIND: deepseek.DEFAULTS, glm.KIND: glm.DEFAULTS}


class Folder:
    """A Hugging Face model folder: its config.json, its weight files and which tensor is in which."""

    def __init__(self, path: str, key: str = "train.init_from", weights: bool = True):
        """`weights=False`: a folder without weights is read for its config.json alone (a plan's; shard/hf/
        config_only.py), its tensors none."""
        self.path, self.key, self.where = Path(path).expanduser(), key, f"{key}={path!r}"
        if not (self.path / "config.json").is_file():
            raise UserError(f"{self.where}: no config.json in the folder (a Hugging Face model folder needs one)")
        try:
            self.config = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{self.where}: config.json is not readable JSON: {e}") from None
        outer = self.config.get("model_type")
        self.config, inner = text_config(self.config, self.where)
        self.kind = arch.model_type(self.config, self.where)
        whole = self._files() if weights or config_only.has_weights(self.path) else {}
        stored = text_tensors(whole, outer if inner else None, self.where)
        # A base model's folder (the Hub's gpt2) names its tensors without the causal LM's prefix: read as
        # transformers does, with it added.
        prefix = tables.PREFIX[self.kind]
        add = not any(name.startswith(prefix) for name in stored)
        ours = {n: prefix + n if add and not n.startswith("lm_head.") else n for n in stored}
        # (a multimodal folder's output layer may lie outside its language model's prefix: Qwen3.5's)
        self.names = {ours[n]: inner + n if inner + n in whole else n for n in stored}
        self.files = {ours[n]: file for n, file in stored.items()}  # our name -> its file
        # MXFP4 and FP8 weights: each read as one float tensor under its own name, from its codes and scales
        self.quantized = mxfp4.method(self.config, self.where)
        readers = {"mxfp4": mxfp4.packed, "fp8": fp8.packed}
        self.packed = readers[self.quantized](self.files) if self.quantized else {}
        self._stored_files = dict(self.files)
        for name, parts in self.packed.items():
            file = self.files[parts[0]]
            for part in parts:
                del self.files[part]
            self.files[name] = file
        self.table = tables.layout(self.kind, self.files)  # its experts one tensor each, or stacked
        # its multi-token-prediction layers (index -> tensors), read only by a model with model.mtp_depth (`plan`)
        self.mtp = mtp.held(self.files, self.config, MTP[self.kind]) if self.kind in MTP else {}

    def _files(self) -> dict[str, Path]:
        """tensor name -> its file (the index's map, or each .safetensors file's own list)."""
        from safetensors import safe_open

        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text()).get("weight_map", {})
            return {name: self.path / f for name, f in weight_map.items()}
        found = sorted(self.path.glob("*.safetensors"))
        if not found:
            extra = " (.bin weights are pickles, which are never loaded: save with safe_serialization)" \
                if any(self.path.glob("*.bin")) else ""
            raise UserError(config_only.refusal(self.where, self.path, extra))
        out = {}
        for f in found:
            with safe_open(f, framework="numpy") as st:
                out.update({name: f for name in st.keys()})
        return out

    def _file(self, name: str) -> Path:
        """The file holding a stored tensor (a packed weight's blocks and scales may lie in two)."""
        return self.files.get(name) or self._stored_files[name]

    def gpt_kwargs(self) -> dict:
        kwargs = arch.to_gpt(self.config, self.where)
        embed, head = tied_pair(self.kind)
        if kwargs["tie_embeddings"] and embed in self.files and head in self.files and not self.same(embed, head):
            # transformers ties them only where they are equal: a checkpoint's own output layer stays its own
            kwargs["tie_embeddings"] = False
        return kwargs

    def same(self, a: str, b: str) -> bool:
        """Whether two tensors hold the same values (read in blocks of rows, at most once per pair of files)."""
        files = (self.files[a], self.files[b])
        return _same(self, a, b, tuple((str(f), f.stat().st_mtime_ns) for f in files))

    def shape(self, name: str) -> tuple:
        from safetensors import safe_open

        if name in self.packed:
            codes, scales = (self._stored_shape(part) for part in self.packed[name])
            return (fp8 if self.quantized == "fp8" else mxfp4).shape(codes, scales, name, self.where)
        return self._stored_shape(name)

    def _stored_shape(self, name: str) -> tuple:
        from safetensors import safe_open

        with safe_open(self._file(name), framework="numpy") as st:
            return tuple(st.get_slice(self.names[name]).get_shape())


# Multimodal folders whose language model is read alone: model_type -> (the field holding its config, the prefix
# of its tensors, the towers' prefixes skipped)
MULTIMODAL = {"llama4": ("text_config", "language_model.", ("vision_model.", "multi_modal_projector.")),
              "gemma4": ("text_config", "model.language_model.", ("model.vision_tower.", "model.audio_tower.",
                                                                  "model.embed_vision.", "model.embed_audio.")),
              "qwen3_5": ("text_config", "model.language_model.", ("model.visual.", "mtp.")),
              "qwen3_5_moe": ("text_config", "model.language_model.", ("model.visual.", "mtp."))}


def text_config(config: dict, where: str) -> tuple[dict, str]:
    """A multimodal folder's language model's config (text_config) and its tensors' prefix; any other folder's config
    as it is, and no prefix."""
    if config.get("model_type") not in MULTIMODAL:
        return config, ""
    field, prefix, _ = MULTIMODAL[config["model_type"]]
    text = config.get(field)
    if not isinstance(text, dict):
        raise UserError(f"{where}: config.json of model_type {config['model_type']!r} has {field}={text!r}; its "
                        "language model's config is read from there (a mapping)")
    return text, prefix


def text_tensors(stored: dict, kind: str | None, where: str) -> dict:
    """The language model's tensors of a multimodal folder (of model_type `kind`), without their prefix, the towers'
    left out with one line saying so; any other folder's (kind None) as they are."""
    if kind is None:
        return stored
    _, prefix, towers = MULTIMODAL[kind]
    skipped = sorted({t.rstrip(".") for n in stored for t in towers if n.startswith(t)})
    unknown = sorted(n for n in stored if not n.startswith((prefix, "lm_head.")) and not n.startswith(towers))
    if unknown:
        raise UserError(f"{where}: tensor {unknown[0]} is neither the language model's ({prefix}...) nor a tower's")
    warn(f"{where}: a {kind} folder: its language model is read, {' and '.join(skipped) or 'no tower'} skipped "
         "(text only)")
    return {n.removeprefix(prefix): f for n, f in stored.items() if n.startswith((prefix, "lm_head."))}


_SAME: dict = {}
SAME_BLOCK = 64 * 1024**2  # bytes of each tensor compared at a time


def _same(folder: Folder, a: str, b: str, stamp: tuple) -> bool:
    key = (a, b, stamp)
    if key not in _SAME:
        shape = folder.shape(a)
        equal = shape == folder.shape(b)
        rows = max(1, SAME_BLOCK // max(1, 4 * int(np.prod(shape[1:]))))
        for start in range(0, shape[0] if equal and shape else 0, rows):
            block = (slice(start, min(start + rows, shape[0])),)
            equal = np.array_equal(_read(folder, a, block), _read(folder, b, block))
            if not equal:
                break
        _SAME[key] = equal
    return _SAME[key]


def tied_pair(kind: str) -> tuple[str, str]:
    """The names of the token embedding and the output layer, which tie_word_embeddings makes one."""
    names = tables.hf_names(kind)
    return names["tok"][0], names["head"][0]


def dotted(path) -> str:
    """A parameter's tree path as its dotted name: "blocks.attn.q"."""
    return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def flat_paths(params) -> dict[str, object]:
    """Our parameters by dotted path -> the leaf (an array or its abstract)."""
    return {dotted(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def plan(folder: Folder, params, kwargs: dict, rest=None) -> list[tables.Row]:
    """The rows that fill `params` (and those of `rest`'s variables a folder holds: a router's correction bias), each
    tensor checked present with its shape, and every tensor of the folder read by one of them; one line for the first
    that is not so."""
    ours = flat_paths(params)
    extra = flat_paths(rest) if rest is not None else {}
    g = arch.with_defaults(kwargs)
    size = tables.sizes(g, folder.kind)
    rows = tables.rows(folder.table, set(ours) | set(extra), size)
    skipped = mtp.unread(folder.mtp, g["mtp_depth"], folder.config, folder.where) \
        if folder.mtp or g["mtp_depth"] else set()
    embed, head = tied_pair(folder.kind)
    if "head" not in ours and embed not in folder.files and head in folder.files:
        # tied, and the checkpoint holds the pair under the output layer's name: transformers ties to that one
        rows = [dataclasses.replace(r, theirs=head) if r.ours == "tok" else r for r in rows]
    read = set()
    for r in rows:
        want = tables.their_shape(r, size)
        stacked = {**ours, **extra}[r.ours].shape[0] if r.layered else 0
        for name in ([r.layer(i) for i in range(stacked)] if r.layered else [r.theirs]):
            if name not in folder.files:
                why = " (the model's output layer is not tied to its embeddings, so it is a tensor of its own)" \
                    if name == head else ""
                raise UserError(f"{folder.where}: tensor {name} is missing (the {folder.kind} model of config.json "
                                f"needs it){why}")
            got = folder.shape(name)
            if got != want:
                raise UserError(f"{folder.where}: tensor {name} has shape {list(got)}, expected {list(want)} "
                                "from config.json")
            read.add(name)
    missing = sorted(set(ours) - {r.ours for r in rows})
    if missing:
        raise UserError(f"{folder.where}: no tensor of a {folder.kind} folder fills parameter {missing[0]}")
    _check_all_read(folder, read | skipped, "head" not in ours)
    return rows


def _check_all_read(folder: Folder, read: set, tied: bool) -> None:
    """One line naming the folder's tensors no rule read (bar the buffers tables.DERIVED names)."""
    embed, head = tied_pair(folder.kind)
    unread = sorted(n for n in folder.files if n not in read and not re.search(tables.DERIVED[folder.kind], n))
    if tied and head in unread and embed in read and folder.same(embed, head):
        unread.remove(head)  # the same values twice: the one tied pair (transformers reads it so too)
    if not unread:
        return
    why = f" ({head} differs from {embed}, and the model ties them: set model.tie_embeddings=false)" \
        if tied and head in unread else ""
    raise UserError(f"{folder.where}: {len(unread)} tensor{'s' * (len(unread) > 1)} of the folder would be read by "
                    f"nothing (the {folder.kind} model of config.json has no place for "
                    f"{'them' if len(unread) > 1 else 'it'}): "
                    f"{', '.join(unread[:3])}{', ...' * (len(unread) > 3)}{why}")


def check(path: str, params, kwargs: dict, rest=None) -> None:
    """Before the run folder is touched: every tensor present with its shape. A tokenizer with more tokens than
    the embedding has rows is the folder's to have (gemma-3's image tokens), as transformers allows: the job
    refuses instead a token id of the data past the embedding (shard/run/job.py, embedded_classes)."""
    plan(Folder(path), params, kwargs, rest)


# ----------------------------------------------------------------------------- index arithmetic

def their_slices(r: tables.Row, our: dict[str, range], size: dict) -> list | None:
    """For our index ranges (letter -> range), what to read from their tensor: per axis (lo, hi, the picked
    offsets within lo:hi or None for all of them, each letter's length), or None where this tensor fills none
    of them. The read is the smallest contiguous range holding the picks: exactly them unless a sliced letter
    is not its group's first (head_dim, which no rule splits)."""
    mine, theirs = set(r.letters()), set(_their_letters(r))
    if any(l in mine and l not in theirs and at not in our[l] for l, at in r.at.items()):
        return None
    axes = []
    for group in r.groups():
        ranges = [range(our[l].start + r.at.get(l, 0), our[l].stop + r.at.get(l, 0)) if l in mine
                  else range(r.at[l], r.at[l] + 1) for l in group]
        lengths = [len(x) for x in ranges]
        if len(group) == 1:  # one letter: a plain range, nothing to pick
            axes.append((ranges[0].start, ranges[0].stop, None, lengths))
            continue
        grids = np.meshgrid(*[np.arange(x.start, x.stop) for x in ranges], indexing="ij")  # a few heads x head_dim
        flat = np.ravel_multi_index(grids, r.their_sizes(group, size)).ravel()
        lo, hi = int(flat.min()), int(flat.max()) + 1
        axes.append((lo, hi, None if hi - lo == len(flat) else flat - lo, lengths))
    return axes


def _their_letters(r: tables.Row) -> list[str]:
    return [l for g in r.groups() for l in g]


def to_ours(r: tables.Row, block: np.ndarray, axes: list) -> np.ndarray:
    """Their block (as read) -> our letters' order; letters only in ours get a length-1 axis."""
    for i, (_, _, picks, _) in enumerate(axes):
        if picks is not None:
            block = np.take(block, picks, axis=i)
    theirs, mine = _their_letters(r), r.letters()
    lengths = [n for a in axes for n in a[3]]
    kept = [l for l in theirs if l in mine]  # their-only letters have length 1: dropped
    block = block.reshape([n for n, l in zip(lengths, theirs) if l in mine])
    block = block.transpose([kept.index(l) for l in mine if l in kept])
    return np.expand_dims(block, [i for i, l in enumerate(mine) if l not in kept])


def read_slice(folder: Folder, rows: list[tables.Row], shape: tuple, index: tuple, size: dict, layered: bool,
               dtype) -> np.ndarray:
    """Our parameter's block at `index` (a tuple of slices, the layers axis first where stacked)."""
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    layer_range = range(index[0].start, index[0].stop) if layered else [None]
    inner = index[1:] if layered else index
    out = np.zeros([s.stop - s.start for s in index], dtype)
    for r in rows:
        our = {l: range(s.start, s.stop) for l, s in zip(r.letters(), inner)}
        axes = their_slices(r, our, size)
        if axes is None:
            continue
        # where this tensor lands in our block: the whole block, but one place along letters only ours
        place = tuple(slice(r.at[l] - our[l].start, r.at[l] - our[l].start + 1)
                      if l in r.at and l not in _their_letters(r) else slice(None) for l in r.letters())
        for j, layer in enumerate(layer_range):
            name = r.layer(layer) if layered else r.theirs
            block = _read(folder, name, tuple(slice(a[0], a[1]) for a in axes))
            values = to_ours(r, block, axes).astype(dtype)
            out[(j, *place) if layered else place] = values
    return out


def _read(folder: Folder, name: str, index: tuple) -> np.ndarray:
    """One block of a tensor. The file is opened for this read alone: safetensors memory-maps it, and the
    pages a read touches (all of them, for a slice across rows) stay resident while it is open, so keeping
    files open would hold the whole checkpoint in memory by the end. bfloat16 (which numpy lacks) is read
    through JAX's reader."""
    from safetensors import safe_open

    if name in folder.packed:
        parts, stored = folder.packed[name], lambda part, at: _read_stored(folder, part, at)
        if folder.quantized == "fp8":
            return fp8.read(stored, parts, index, folder.shape(name), folder._stored_shape(parts[1]))
        return mxfp4.read(stored, parts, index, folder.shape(name))
    return _read_stored(folder, name, index)


def _read_stored(folder: Folder, name: str, index: tuple) -> np.ndarray:
    """One block of a tensor as the folder stores it."""
    from safetensors import safe_open

    stored, file = folder.names[name], folder._file(name)
    with safe_open(file, framework="numpy") as st:
        view = st.get_slice(stored)
        kind = view.get_dtype()
        if kind not in ("BF16", "F8_E4M3"):  # (which numpy lacks)
            return np.asarray(view[index])
    if kind == "F8_E4M3":
        return fp8.read_codes(file, stored, index)
    with safe_open(file, framework="flax") as st:
        return np.asarray(st.get_slice(stored)[index])


def load_params(folder: Folder, target_params, kwargs: dict, rest=None):
    """`target_params` (abstract arrays with shardings) read from the folder: every array built from the slices
    this process's devices hold, each read on its own (nothing whole on the host unless a device holds it). With
    `rest` (the model's other variables, arrays), (params, rest): rest's variables the folder holds read too."""
    rows = plan(folder, target_params, kwargs, rest)
    g = arch.with_defaults(kwargs)
    size = tables.sizes(g, folder.kind)

    def build(path, leaf):
        name = dotted(path)
        mine = [r for r in rows if r.ours == name]
        if not mine:  # (rest's: a variable no folder holds, kept as built)
            return leaf
        layered = mine[0].layered
        want = ((leaf.shape[0],) if layered else ()) + tuple({**size, **mine[0].size, "s": 2}[l]
                                                             for l in mine[0].letters())
        if tuple(leaf.shape) != want:
            raise UserError(f"{folder.where}: parameter {name} is {list(leaf.shape)} here, but the folder fills "
                            f"{list(want)}: read it into the model's own layout")
        dtype = np.dtype(leaf.dtype)
        return jax.make_array_from_callback(
            leaf.shape, leaf.sharding,
            lambda index: read_slice(folder, mine, leaf.shape, index, size, layered, dtype))

    params = jax.tree_util.tree_map_with_path(build, target_params)
    return params if rest is None else (params, jax.tree_util.tree_map_with_path(build, rest))
