"""Checkpoints in and out of the replica layout of train.sync=local_sgd/diloco (shard/strategies/sync.py).

A checkpoint holds either one model (an ordinary run's: "plain") or R replicas' (a leading R dimension on the
model and optimizer state). What a run can take from one that does not match its own layout is the saved
run's *global view*: the model the replicas stand for, which is DiLoCo's anchor (the outer model, saved
with the optimizer) and local SGD's replicas' mean; it is read into one replica's shardings and broadcast to
every replica (and DiLoCo's anchor). Orbax's partial restore reads only the arrays asked for.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shard.run import checkpoint as ckpt_lib
from shard.core import state as state_lib
from shard.strategies import sync as sync_lib
from shard.errors import warn
from shard.core.state import TrainState


def _copied(tree, r: int):
    """`tree`'s target with a leading dimension of R, copied to every device that holds a part."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        (r, *a.shape), a.dtype, sharding=NamedSharding(a.sharding.mesh, PartitionSpec(None, *a.sharding.spec))), tree)


def has_anchor_momentum(manager, step: int) -> bool:
    """A DiLoCo checkpoint: its optimizer item holds the outer momentum (local SGD's, none)."""
    outer = manager.item_metadata(step)["optimizer"].tree.get("outer") or {}
    return bool(jax.tree.leaves(outer.get("opt")))


def read_global(directory, step: int, one: TrainState) -> tuple[TrainState, dict]:
    """The saved run's global view (params and rest, in `one`'s shardings) and its meta."""
    manager = ckpt_lib.tree_manager(directory)
    try:
        r = ckpt_lib.layout(manager, step, one)
        if r is None:
            ckpt_lib.check_shapes(manager, step, one)  # names what differs
        if r == 0:
            got = ckpt_lib.restore_parts(manager, step, {"model": {"params": one.params, "rest": one.rest}})
            return one.replace(params=got["model"]["params"], rest=got["model"]["rest"]), dict(got["meta"])
        if has_anchor_momentum(manager, step):  # DiLoCo: the anchor, and the first replica's other variables
            got = ckpt_lib.restore_parts(manager, step, {"model": {"rest": _copied(one.rest, r)},
                                           "optimizer": {"outer": {"anchor": one.params}}})
            params = got["optimizer"]["outer"]["anchor"]
        else:  # local SGD: the replicas' mean
            got = ckpt_lib.restore_parts(manager, step, {"model": {"params": _copied(one.params, r),
                                                                   "rest": _copied(one.rest, r)}})
            params = jax.tree.map(lambda a, s: jax.device_put(jnp.mean(a, axis=0), s.sharding),
                                  got["model"]["params"], one.params)
        rest = jax.tree.map(lambda a, s: jax.device_put(a[0], s.sharding), got["model"]["rest"], one.rest)
        return one.replace(params=params, rest=rest), dict(got["meta"])
    finally:
        manager.close()


def restore_without_anchor(directory, step: int, target: TrainState) -> tuple[TrainState, dict]:
    """A local-SGD checkpoint saved before local SGD dropped its unused anchor: all but the anchor, as saved."""
    manager = ckpt_lib.tree_manager(directory)
    try:
        items = ckpt_lib._items(target)
        got = ckpt_lib.restore_parts(manager, step, items)
        model, opt = got["model"], got["optimizer"]
        return target.replace(params=model["params"], rest=model["rest"], opt_state=opt["opt_state"],
                              step=opt["step"]), dict(got["meta"])
    finally:
        manager.close()


def take(sync, directory, step: int, init, shardings, target: TrainState, one: TrainState,
         resume: bool) -> tuple[TrainState, dict] | None:
    """A train.sync run's state from a checkpoint. `resume` (the run's own, or checkpoint.restore_from): None
    when it is in this run's layout (read as usual), else its global view on every replica, with the step
    counter and a warning. Else (train.init_from): its global view on every replica, from step 0."""
    manager = ckpt_lib.tree_manager(directory)
    try:
        saved = ckpt_lib.layout(manager, step, one)
        legacy = sync.mode != "diloco" and "outer" in manager.item_metadata(step)["optimizer"].tree
    except Exception:  # unreadable metadata: the ordinary restore reports it (or skips the step on resume)
        if resume:
            return None
        raise
    finally:
        manager.close()
    if resume and saved == sync.replicas:
        return restore_without_anchor(directory, step, target) if legacy else None
    if resume:
        held = f"{saved} replicas" if saved else "one model (train.sync=allreduce)"
        fresh = "inner optimizer states" + (" and outer momentum" if sync.mode == "diloco" else "")
        warn(f"mesh.replica={sync.replicas} but checkpoint {Path(directory) / str(step)} holds {held}: resuming from "
             f"its global view on every replica, with fresh {fresh}; not a bitwise resume")
    view, meta = read_global(directory, step, one)
    begin = meta["step"] if resume else None
    build = jax.jit(lambda s, v: sync_lib.from_model(sync, s, v, begin), out_shardings=shardings, donate_argnums=0)
    return build(state_lib.init_state(init, shardings), view), meta
