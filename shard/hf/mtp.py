"""DeepSeek-V3's and GLM-4.5's multi-token-prediction layers (model.layers.{n} and on, n = num_hidden_layers;
num_nextn_predict_layers of them) <-> the model's `mtp` modules (models/mtp.py), read with model.mtp_depth > 0.

Such a layer holds one decoder layer of the experts' kind under the names of any layer (self_attn.*, mlp.*, its two
norms), and its own enorm, hnorm, eh_proj and shared_head.norm. Its embed_tokens and shared_head.head are the model's
own (shared, in DeepSeek-V3's report): they are not read, and written as copies of the model's. The layers a run does
not train (past model.mtp_depth) are skipped with one line."""

import re

from shard.errors import UserError, warn

LAYER = re.compile(r"model\.layers\.(\d+)\.")
# the tensors of such a layer that copy the model's own: name within the layer -> the model's tensor
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def held(names, config: dict, defaults: dict) -> dict[int, set]:
    """A folder's multi-token-prediction layers: their index -> their tensors' names (those past num_hidden_layers)."""
    n = config.get("num_hidden_layers", defaults["num_hidden_layers"])
    out: dict[int, set] = {}
    for name in names:
        if (m := LAYER.match(name)) and int(m[1]) >= n:
            out.setdefault(int(m[1]), set()).add(name)
    return out


def rows(table: tuple, row) -> tuple:
    """The rows of a family's table (`row` its Row) for the modules: the experts' layers' rows (blocks.*) under
    mtp.layers.block, and each module's own (me: eh_proj's input width, d_model, its embedding half first)."""
    L = "model.layers.{i}."
    block = tuple(row("mtp.layers.block." + r.ours[len("blocks."):], r.theirs, r.their_axes, r.our_axes, r.at)
                  for r in table if r.ours.startswith("blocks.") and "{i}" in r.theirs)
    return (*block, row("mtp.layers.enorm.scale", L + "enorm.weight", "e", "e"),
            row("mtp.layers.hnorm.scale", L + "hnorm.weight", "e", "e"),
            row("mtp.layers.proj", L + "eh_proj.weight", "e (s me)", "s me e"),
            row("mtp.layers.norm.scale", L + "shared_head.norm.weight", "e", "e"))


def unread(layers: dict[int, set], depth: int, config: dict, where: str) -> set:
    """The tensors of the folder's multi-token-prediction `layers` that a model of mtp_depth `depth` does not read:
    the layers past it (one line says so) and the copies of the model's own; one line where it has fewer."""
    nextn = config.get("num_nextn_predict_layers")
    if depth > len(layers):
        raise UserError(f"{where}: model.mtp_depth={depth} but the folder holds {len(layers)} multi-token-prediction "
                        f"layer{'s' * (len(layers) != 1)} (num_nextn_predict_layers={nextn}); give at most "
                        f"{len(layers)}")
    order = sorted(layers)
    skipped = order[depth:]
    if skipped:
        count = sum(len(layers[i]) for i in skipped)
        how = "; model.mtp_depth=1 trains the first as multi-token prediction" if not depth else ""
        warn(f"{where}: the multi-token-prediction layer{'s' * (len(skipped) > 1)} {', '.join(map(str, skipped))} "
             f"({count} tensors) past num_hidden_layers={order[0]} "
             f"{'are' if len(skipped) > 1 else 'is'} not read (model.mtp_depth={depth}){how}")
    out = {name for i in skipped for name in layers[i]}
    return out | {f"model.layers.{i}.{name}" for i in order[:depth] for name in SHARED}


def copies(tensors: dict, g: dict) -> dict:
    """For a model with mtp_depth modules, the copies of the model's embedding and output layer each module's layer of
    the folder holds, of those among `tensors` (name -> array) being written."""
    n, out = g["n_layers"], {}
    for k in range(g.get("mtp_depth", 0)):
        for name, source in SHARED.items():
            source = "model.embed_tokens.weight" if g["tie_embeddings"] else source
            if source in tensors:
                out[f"model.layers.{n + k}.{name}"] = tensors[source]
    return out
