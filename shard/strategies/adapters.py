"""Low-rank adapters on any model's weights, without the model knowing (the math behind shard/strategies/lora.py).

A target is a short name (`q`, `mlp`) standing for one or more weights of the model, found by the last part of
their path. For each targeted weight W the adapters are A (its input dimensions, r) and B (r, its output
dimensions), and the model runs with W + (alpha / r) * A @ B (Flax's `nnx.LoRA` math, applied to the weight
instead of the activations, so that the model's own code runs unchanged). Dimensions before the input ones (a
stack's `layers`, experts) stay on both, so every layer (expert) has its own pair. A carries W's logical names
for its input dimensions and B for its output ones, so the rules shard them like W.

The table below covers the library's transformers (models/layers.py); a model of one's own may declare its own
names with a class attribute `adapter_targets = {name: (Weight(...), ...)}`, and any weight can be named by the
last part of its path (one input dimension, one output dimension: `x @ W`).
"""

import math
import string
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from shard.errors import UserError
from shard.nn.partition import logical_names, path_keys


@dataclass(frozen=True)
class Weight:
    """Where a target sits in a weight named `name` (its path's last part): the last `out_dims` dimensions are
    its outputs, the `in_dims` before them (or before the `pick` dimension) its inputs; `pick`: the index on a
    dimension between the two that selects this target's half of a fused weight (kv's k and v)."""
    name: str
    in_dims: int = 1
    out_dims: int = 1
    pick: int | None = None


# The library's transformers: attention's q (embed -> heads, head_dim), the fused kv's halves, the output
# projection (heads, head_dim -> embed) and the feed-forward block's weights.
TARGETS = {
    "q": (Weight("q", 1, 2),),
    "k": (Weight("kv", 1, 2, pick=0),),
    "v": (Weight("kv", 1, 2, pick=1),),
    "o": (Weight("out", 2, 1),),
    "mlp": (Weight("w_in"), Weight("w_gate"), Weight("w_out")),
    # multi-head latent attention's up-projections (models/latent.py): a latent -> heads, each head's width
    "q_b": (Weight("q_b", 1, 2),),
    "kv_b": (Weight("kv_b", 1, 2),),
    # gated DeltaNet's projections (models/deltanet.py): queries and keys (embed -> key heads, key_dim), values and
    # the output gate (embed -> key heads, their value heads, value_dim), the output (those -> embed)
    "linear": (Weight("query", 1, 2), Weight("key", 1, 2), Weight("value", 1, 3), Weight("z", 1, 3),
               Weight("proj", 3, 1)),
}


@dataclass(frozen=True)
class Site:
    """One adapted weight: its path in the parameters, where its adapters sit in the adapters' tree, its layout."""
    path: tuple      # the parameter's path (strings)
    key: tuple       # the adapters' path: the parameter's, plus the target for a fused weight's half
    target: str      # the target name that chose it
    weight: Weight
    shape: tuple     # W's shape
    names: tuple     # W's logical names (None each where it has none)

    @property
    def split(self) -> tuple[int, int, int]:
        """(leading, input, output) dimension counts (the picked dimension, if any, between input and output)."""
        n = len(self.shape) - (self.weight.pick is not None)
        return n - self.weight.in_dims - self.weight.out_dims, self.weight.in_dims, self.weight.out_dims

    def parts(self) -> tuple[tuple, tuple, tuple]:
        """W's shape cut into (leading, input, output) dimensions."""
        lead, n_in, n_out = self.split
        pick = self.weight.pick is not None
        return self.shape[:lead], self.shape[lead:lead + n_in], self.shape[lead + n_in + pick:]

    def part_names(self) -> tuple[tuple, tuple, tuple]:
        lead, n_in, _ = self.split
        pick = self.weight.pick is not None
        return self.names[:lead], self.names[lead:lead + n_in], self.names[lead + n_in + pick:]


def _weights(params) -> list[tuple[tuple, jax.ShapeDtypeStruct, tuple]]:
    """(path, value, logical names) of every parameter."""
    out = []
    for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        value = jax.tree.leaves(var)[0]
        names = logical_names(var) or (None,) * value.ndim
        out.append((path_keys(path), value, tuple(names)))
    return out


def table(model_cls) -> dict:
    """Target names -> weights, the model's own declarations over the library's."""
    return {**TARGETS, **(getattr(model_cls, "adapter_targets", None) or {})}


def targetable(model_cls, params) -> list[str]:
    """The target names that match something in this model: the table's, then each matrix's own name."""
    weights, known = _weights(params), table(model_cls)
    leaf_names = {p[-1] for p, v, _ in weights}
    named = [t for t, ws in known.items() if any(w.name in leaf_names for w in ws)]
    covered = {w.name for t in named for w in known[t]}
    matrices = {p[-1] for p, v, n in weights if sum(1 for x in n if x != "layers") >= 2}  # not a stacked vector
    return named + sorted(matrices - covered - set(named))


def sites(model_cls, params, targets, model_name: str) -> tuple[Site, ...]:
    """The weights `targets` adapt in this model (checked: each target matches something, one line if not)."""
    weights, known = _weights(params), table(model_cls)
    found = []
    for target in targets:
        rules = known.get(target, (Weight(target),))
        hits = [(p, v, n, w) for w in rules for p, v, n in weights if p[-1] == w.name]
        ok = [h for h in hits if len(h[1].shape) >= h[3].in_dims + h[3].out_dims + (h[3].pick is not None)]
        if not ok:
            raise UserError(f"train.lora.targets: {target!r} matches no weight of model {model_name!r}; "
                            f"its targets are: {', '.join(targetable(model_cls, params))}")
        for p, v, n, w in ok:
            key = p + ((target,) if w.pick is not None else ())
            found.append(Site(p, key, target, w, tuple(v.shape), n))
    keys = [s.key for s in found]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup:
        raise UserError(f"train.lora.targets names weight {'/'.join(dup)} twice; list each target once")
    return tuple(found)


def _set(tree: dict, keys: tuple, value) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def pair(tree, site: Site) -> dict:
    """A site's {"lora_a": A, "lora_b": B} in an adapters' tree."""
    for k in site.key:
        tree = tree[k]
    return tree


def create(site_list, rank: int, seed: int) -> dict:
    """Fresh adapters: A uniform in +-1/sqrt(fan in) (the bound of PyTorch's kaiming-uniform with a=sqrt(5),
    which PEFT uses), B zero, so that the adapted model starts as the base model. A nested dict of
    `nnx.LoRAParam`s: {path..: {"lora_a": A, "lora_b": B}}."""
    out: dict = {}
    key = jax.random.key(seed)
    with nnx.use_eager_sharding(False):  # the names are logical ones, mapped by the rules (as for the model's)
        for i, s in enumerate(site_list):
            _create_one(out, s, jax.random.fold_in(key, i), rank)
    return out


def _create_one(out: dict, s: Site, key, rank: int) -> None:
    (lead, ins, outs), (lead_n, in_n, out_n) = s.parts(), s.part_names()
    bound = 1 / math.sqrt(math.prod(ins))
    a = jax.random.uniform(key, (*lead, *ins, rank), jnp.float32, -bound, bound)
    b = jnp.zeros((*lead, rank, *outs), jnp.float32)
    _set(out, s.key, {"lora_a": nnx.LoRAParam(a, out_sharding=(*lead_n, *in_n, None)),
                      "lora_b": nnx.LoRAParam(b, out_sharding=(*lead_n, None, *out_n))})


def delta(site: Site, a, b, scale: float):
    """scale * A @ B in W's (leading, input, output) layout: one einsum over the rank."""
    lead, n_in, n_out = site.split
    letters = iter(string.ascii_letters.replace("z", ""))
    L, I, O = ("".join(next(letters) for _ in range(n)) for n in (lead, n_in, n_out))
    return jnp.einsum(f"{L}{I}z,{L}z{O}->{L}{I}{O}", a, b) * scale


def merged(params, adapters: dict, site_list, scale: float):
    """The parameters with every adapted weight replaced by W + scale * A @ B (float32, as the weights)."""
    by_path: dict = {}
    for s in site_list:
        by_path.setdefault(s.path, []).append(s)

    def one(path, var):
        here = by_path.get(path_keys(path))
        if not here or not isinstance(var, nnx.Variable):
            return var
        return var.replace(adapted(var[...], pairs(adapters, here), here, scale))

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def pairs(adapters: dict, site_list) -> tuple:
    """The (A, B) arrays of these sites, in their order."""
    return tuple((pair(adapters, s)["lora_a"][...], pair(adapters, s)["lora_b"][...]) for s in site_list)


def adapted(w, ab: tuple, site_list, scale: float):
    """One weight W plus scale * A @ B for each of its sites (ab: their (A, B), in order), in W's dtype."""
    for s, (a, b) in zip(site_list, ab):
        d = delta(s, a, b, scale).astype(w.dtype)
        if s.weight.pick is None:
            w = w + d
        else:
            lead, n_in, _ = s.split
            w = w.at[(slice(None),) * (lead + n_in) + (s.weight.pick,)].add(d)
    return w


def count(adapters) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))
