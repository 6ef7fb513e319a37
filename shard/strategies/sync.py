"""Training over slow links: replicas that meet every H steps (local SGD, DiLoCo, streaming DiLoCo).

The `replica` mesh axis holds R copies of the training job, typically across the slow network
(`mesh.dcn_replica`). With `train.sync=allreduce` (the default) it is one more data-parallel axis: the
gradients are averaged over it every step. With `local_sgd` or `diloco` each replica trains on its own share
of every batch, with its own optimizer, and the replicas meet only every `train.sync_every=H` steps:

- local_sgd: their parameters are averaged.
- diloco (Douillard et al., 2023): the outer gradient, the parameters of the last sync minus a replica's
  own, is averaged over the replicas and applied to the last sync's parameters by SGD with Nesterov momentum
  (`train.outer_lr`, `train.outer_momentum`; Optax's sgd); every replica goes on from the result, keeping its
  inner AdamW state.
- `train.sync_fragments=F` (streaming DiLoCo, Douillard et al., 2025): the parameters are cut, in the
  model's order, into F fragments of about equal bytes, each synced every H steps at its own offset
  (fragment f after steps s with s mod H = (f+1)H/F mod H), so one sync moves about 1/F of the model. A
  stacked (scanned) array is cut along its layers, so one large stacked array does not make one fragment.

It is one SPMD program, not processes around a server: the train state has a leading replica dimension
split over `replica` (every replica's parameters, optimizer state and other variables); the ordinary train
step runs under `jax.vmap` over it (`spmd_axis_name="replica"`, so no collective crosses replicas), and a
sync is a second compiled program whose collectives are the means over `replica`. The outer state (the last
sync's parameters; DiLoCo's momentum, one Optax state per parameter array, cut like it in fragments) lies
beside it, split like the parameters inside one replica; local SGD needs none. Evaluation, the end-of-run
sample, `shard.load_model` and export use the global view: DiLoCo's outer model (the anchor), local SGD's
replicas' mean (at a sync step: the synced model). `train.init_from`, `checkpoint.restore_from` and a
resume whose checkpoint has another layout (a plain one, or another mesh.replica) start every replica and
the anchor from that checkpoint's global view (shard/strategies/sync_io.py).
"""

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard.nn import partition
from shard.errors import UserError
from shard.core.state import TrainState

AXIS = "replica"
LOCAL = ("local_sgd", "diloco")


@dataclass(frozen=True)
class Sync:
    mode: str                 # local_sgd or diloco
    replicas: int             # R
    every: int                # H
    fragments: tuple          # per fragment, its pieces (parameter array index in tree order, rows or None)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    @property
    def outer_tx(self) -> optax.GradientTransformation:
        return optax.sgd(self.outer_lr, momentum=self.outer_momentum or None, nesterov=self.outer_momentum > 0)

    def due(self, done: int) -> list[int]:
        """The fragments to sync after step `done` (1-based)."""
        f, h = len(self.fragments), self.every
        return [i for i in range(f) if done % h == ((i + 1) * h // f) % h]


def settings(cfg, mesh_shape: dict, abstract_params) -> Sync | None:
    """The sync cfg asks for (None for allreduce), checked against the mesh and the other knobs."""
    mode, r = cfg.train.sync, mesh_shape[AXIS]
    if mode not in LOCAL:
        return None
    if r == 1:
        raise UserError(f"train.sync={mode} needs replicas to sync: set mesh.replica > 1 (e.g. mesh.replica=4)")
    variables = jax.tree.leaves(abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    units = _units(variables)
    f = cfg.train.sync_fragments
    if f > len(units) or f > cfg.train.sync_every:
        raise UserError(f"train.sync_fragments={f}: at most the {len(units)} parameter arrays and stacked layers "
                        f"and at most train.sync_every={cfg.train.sync_every} (one fragment per step)")
    return Sync(mode, r, cfg.train.sync_every, fragments(units, f), cfg.train.outer_lr, cfg.train.outer_momentum)


def _units(variables: list) -> list[tuple]:
    """The pieces a fragment is made of, in tree order, as (array index, rows, bytes): one layer of a stacked
    (scanned) array (rows (l, l + 1) of its leading `layers` dimension), else the whole array (rows None)."""
    units = []
    for i, var in enumerate(variables):
        value = jax.tree.leaves(var)[0]
        size = math.prod(value.shape) * value.dtype.itemsize
        names = partition.logical_names(var)
        if names and names[0] == "layers" and value.shape[0] > 1:
            units += [(i, (l, l + 1), size // value.shape[0]) for l in range(value.shape[0])]
        else:
            units.append((i, None, size))
    return units


def fragments(units: list[tuple], f: int) -> tuple:
    """F consecutive groups of units of about equal bytes (each at least one unit, each cut at the unit
    boundary nearest its share), each group as (array index, rows) pieces, a stacked array's adjacent layers
    merged into one row range."""
    total, cuts, done = sum(u[2] for u in units), [], 0
    for k in range(len(units) - 1):
        done += units[k][2]
        # the first boundary at least as near the next share as the one after it; or forced, to leave each
        # remaining group a unit
        if len(cuts) < f - 1 and (done + units[k + 1][2] / 2 >= total * (len(cuts) + 1) / f
                                  or len(units) - k - 1 == f - 1 - len(cuts)):
            cuts.append(k + 1)
    groups = []
    for lo, hi in zip([0, *cuts], [*cuts, len(units)]):
        pieces = []
        for i, rows, _ in units[lo:hi]:
            if pieces and rows and pieces[-1][0] == i and pieces[-1][1] and pieces[-1][1][1] == rows[0]:
                pieces[-1] = (i, (pieces[-1][1][0], rows[1]))
            else:
                pieces.append((i, rows))
        groups.append(tuple(pieces))
    return tuple(groups)


# ----------------------------------------------------------------------------- the state

def _stack(tree, r: int):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (r, *a.shape)), tree)


def stacked(abstract: TrainState, r: int) -> TrainState:
    """One replica's state shapes -> R replicas' (a leading dimension on everything but the step counter)."""
    return jax.eval_shape(lambda s: _stack(s, r), abstract.replace(step=None)).replace(step=abstract.step)


def over_replicas(one: TrainState, mesh, axis: str | None = AXIS) -> TrainState:
    """One replica's shardings -> the stacked state's: the leading dimension over `axis` (None: copied)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(axis, *s.spec)),
                        one.replace(step=None)).replace(step=one.step)


def _outer(sync: Sync, params):
    """DiLoCo's outer state: the last sync's parameters (the anchor) and one Optax state per parameter array.
    Local SGD has none: its sync is the replicas' mean, which needs no memory of the last one."""
    if sync.mode != "diloco":
        return None
    return {"anchor": params, "opt": [sync.outer_tx.init(a) for a in jax.tree.leaves(params)]}


def abstract_state(sync: Sync, abstract: TrainState) -> TrainState:
    """One replica's state shapes -> every replica's (a leading R dimension) plus the outer state."""
    return stacked(abstract, sync.replicas).replace(outer=jax.eval_shape(lambda p: _outer(sync, p), abstract.params))


def init(sync: Sync, init_one):
    """The initialiser of every replica's state: all start from the same parameters."""
    def build() -> TrainState:
        one = init_one()
        return _stack(one.replace(step=None), sync.replicas).replace(step=one.step, outer=_outer(sync, one.params))
    return build


def shardings(sync: Sync, one, mesh) -> TrainState:
    """One replica's shardings (`one`, from the rules) -> the stacked state's: the replica dimension over
    `replica`; DiLoCo's outer state laid out like the parameters (each array's momentum like the array)."""
    outer = None
    if sync.mode == "diloco":
        outer = {"anchor": one.params, "opt": [jax.tree.map(lambda _: s, sync.outer_tx.init(jnp.zeros(())))
                                               for s in jax.tree.leaves(one.params)]}
    return over_replicas(one, mesh).replace(outer=outer)


def from_model(sync: Sync, state: TrainState, one: TrainState, step=None) -> TrainState:
    """`state` (a fresh init) with every replica, and DiLoCo's anchor, set to one model's parameters and other
    variables (`one`: a plain checkpoint's, or a saved run's global view); the step counter too if given."""
    new = state.replace(params=_stack(one.params, sync.replicas), rest=_stack(one.rest, sync.replicas),
                        outer=_outer(sync, one.params))
    return new if step is None else new.replace(step=jnp.asarray(step, state.step.dtype))


# ----------------------------------------------------------------------------- the programs

def local_step(train_step, sync: Sync):
    """The ordinary train step, run by every replica on its share of the batch at once (a vmap over the
    replica dimension): nothing is exchanged between replicas. The outputs are their means (`finite`:
    all of them)."""
    def step(state: TrainState, batch: dict):
        mesh, rules = partition.active()
        inner_rules = partition.without_batch_axes(rules, (AXIS,))
        per = jax.tree.map(lambda a: a.reshape(sync.replicas, a.shape[0] // sync.replicas, *a.shape[1:]), batch)
        inner = state.replace(outer=None)
        axes = TrainState(step=None, params=0, rest=0, opt_state=0)
        with partition.activate(mesh, inner_rules):
            new, out = jax.vmap(train_step, in_axes=(axes, 0), out_axes=(axes.replace(step=0), 0),
                                spmd_axis_name=AXIS)(inner, per)
        out = {k: jnp.all(v) if k == "finite" else jnp.mean(v, axis=0) for k, v in out.items()}
        return new.replace(step=new.step[0], outer=state.outer), out
    return step


def global_view(state: TrainState) -> TrainState:
    """The model the replicas stand for: DiLoCo's outer model (the anchor), local SGD's replicas' mean (at a
    sync step, the synced model); the first replica's other variables."""
    params = state.outer["anchor"] if state.outer is not None else jax.tree.map(lambda a: jnp.mean(a, 0), state.params)
    return state.replace(params=params,
                         rest=jax.tree.map(lambda a: a[0], state.rest), opt_state=None, outer=None)


def sync_program(sync: Sync, fragment: int):
    """The sync of one fragment's pieces: the replicas' mean (local SGD), or DiLoCo's outer step."""
    chosen = sync.fragments[fragment]
    part = lambda tree, rows: tree if rows is None else jax.tree.map(lambda a: a[rows[0]:rows[1]], tree)
    put = lambda whole, new, rows: new if rows is None else jax.tree.map(
        lambda a, b: a.at[rows[0]:rows[1]].set(b), whole, new)

    def run(state: TrainState) -> TrainState:
        leaves, tree = jax.tree.flatten(state.params)
        diloco = sync.mode == "diloco"
        anchors = jax.tree.leaves(state.outer["anchor"]) if diloco else None
        opts = list(state.outer["opt"]) if diloco else None
        for i, rows in chosen:  # rows: a stacked array's layers (its leading dimension), or None: all of it
            replicas = leaves[i] if rows is None else leaves[i][:, rows[0]:rows[1]]
            mean = jnp.mean(replicas, axis=0)  # the one exchange: an all-reduce over `replica`
            if diloco:
                anchor, opt = part(anchors[i], rows), part(opts[i], rows)
                updates, opt = sync.outer_tx.update(anchor - mean, opt)  # the outer gradient
                mean = optax.apply_updates(anchor, updates)
                anchors[i], opts[i] = put(anchors[i], mean, rows), put(opts[i], opt, rows)
            new = jnp.broadcast_to(mean, replicas.shape).astype(leaves[i].dtype)
            leaves[i] = new if rows is None else leaves[i].at[:, rows[0]:rows[1]].set(new)
        params = jax.tree.unflatten(tree, leaves)
        if not diloco:
            return state.replace(params=params)
        outer = {"anchor": jax.tree.unflatten(jax.tree.structure(state.outer["anchor"]), anchors), "opt": opts}
        return state.replace(params=params, outer=outer)
    return run
