"""Adapters on bare parameters in PEFT's layout (its `target_parameters`, `lora.ParamWrapper`): a mixture of
experts' router weight and its experts' 3-D stacks, as transformers 5's modules hold them (tables.FUSED).

PEFT adapts a parameter (experts, out, in), or (experts, in, out) where the module says so (GPT-OSS's), with lora_A
(experts x R, in), expert-major rows, and lora_B (out, R x experts), expert-minor columns: every expert its own
rank-R pair, as ours. Several of our weights may fill one parameter (the gate and up projections in gate_up_proj):
their pairs go side by side along the rank, each B placed at its part's rows, so the parameter's rank is R = parts x
r (`rank_pattern`) and its scale alpha / r kept (`alpha_pattern`): B A sums our deltas exactly. Several parameters
of one module are wrapped nested, the first in the module's order innermost (named `base_layer.` once per wrapper
around it).
"""

import re

import numpy as np

from shard.hf import tables


def row(table: str, site) -> tables.Row | None:
    """The bare parameter's row this adapted weight fills, or None where it is a Linear's weight."""
    ours = ".".join(site.path)
    return next((r for r in tables.TABLES[table] if r.ours == ours and re.search(tables.BARE, r.theirs)), None)


def _pair(r: tables.Row, site, a: np.ndarray, b: np.ndarray, table: str) -> tuple[np.ndarray, np.ndarray]:
    """One layer and expert: A (r, in) and B (their whole out, r), B's rows at this part's place in them."""
    letters = r.letters()[len(r.groups()) == 3:]  # without the experts axis
    size = {"s": 2, **dict(zip(letters, site.shape[len(site.shape) - len(letters):]))}
    their_out, their_in = r.groups()[-2:]
    stacked = len(r.groups()) == 3
    flipped = stacked and table in tables.EXPERTS_FLIPPED
    if stacked and (table in tables.EXPERTS_IN_OUT or flipped):  # (experts, in, out)
        their_out, their_in = their_in, their_out
    ins, outs = letters[:site.split[1]], letters[site.split[1]:]
    a = a.transpose([ins.index(l) for l in their_in] + [len(ins)]).reshape(-1, a.shape[-1])
    kept = [l for l in their_out if l in outs]
    b = b.transpose([0] + [1 + outs.index(l) for l in kept])
    full = np.zeros((b.shape[0], *(size[l] for l in their_out)), b.dtype)
    full[(slice(None), *(slice(r.at.get(l, 0), r.at.get(l, 0) + size[l]) if l in outs else r.at[l]
                         for l in their_out))] = b
    if flipped:  # PEFT takes the stack's in axis for its out: its A is our B, its B our A
        return full.reshape(b.shape[0], -1), a
    return a.T, full.reshape(b.shape[0], -1).T


def _layer(r: tables.Row, site, values: dict, i: int, table: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Layer i's (A, B) per expert (one pair where the parameter has no experts axis)."""
    a, b = (np.asarray(values[site.key][k][i]) for k in ("lora_a", "lora_b"))
    return [_pair(r, site, *ab, table) for ab in zip(a, b)] if len(r.groups()) == 3 else [_pair(r, site, a, b, table)]


def tensors(table: str, site_list, values: dict, size: dict | None = None) -> tuple[dict, list[str], dict]:
    """{PEFT tensor name: array} of the sites on bare parameters, the target_parameters, and {parameter: parts}
    for those several of ours fill (`size`: the letters' sizes, which place a stack after the dense first layers)."""
    parts: dict[str, list] = {}
    for s in site_list:
        r = row(table, s)
        parts.setdefault(r.theirs, []).append((r, s))
    names = [n for n in dict.fromkeys(r.theirs for r in tables.TABLES[table]) if n in parts]  # the modules' order
    out = {}
    for theirs, pairs in parts.items():
        module = theirs.rsplit(".", 1)[0]
        around = [n for n in names if n.rsplit(".", 1)[0] == module]
        nested = "base_layer." * (len(around) - 1 - around.index(theirs))
        first = tables.offset([pairs[0][0]], size)[0]
        for i in range(values[pairs[0][1].key]["lora_a"].shape[0]):  # the stack's layers
            each = [_layer(r, s, values, i, table) for r, s in pairs]
            a = [np.concatenate([p[x][0] for p in each]) for x in range(len(each[0]))]      # (R, in) per expert
            b = [np.concatenate([p[x][1] for p in each], axis=1) for x in range(len(each[0]))]  # (out, R)
            name = f"base_model.model.{module.format(i=i + first.offset)}.{nested}"
            out[name + "lora_A.weight"] = np.ascontiguousarray(np.concatenate(a))  # safetensors writes the memory
            out[name + "lora_B.weight"] = np.ascontiguousarray(np.stack(b, axis=-1).reshape(b[0].shape[0], -1))
    local = lambda n: n.split("{i}.", 1)[-1]  # noqa: E731  # "mlp.experts.gate_up_proj"
    return out, sorted(local(n) for n in names), {local(n): len(p) for n, p in parts.items() if len(p) > 1}
