"""Checkpoints with Orbax: every array saved as its shards, restored straight into any sharding.

A checkpoint is one step folder with three items:
  model      parameters and other model variables (all that `train.init_from` needs)
  optimizer  optimizer state and the step counter
  meta       JSON: step and data position (global batches consumed)
Orbax writes each step into a temporary folder and renames it when complete, so a process killed
mid-write leaves the earlier checkpoints as they were; a checkpoint that still fails to read is
skipped with a warning (resume) or refused (an explicit path), never loaded in part.

Failing to read is not always the checkpoint's fault: storage can be slow, unreachable or refuse access.
Such I/O errors are retried with backoff and then stop the run with one line; a step is skipped only for
what is wrong with the step itself (missing or truncated files, bad metadata), never deleted: when the run
saves that step again, the unreadable copy is moved aside (STEP.unreadable) and the step written in full.
Orbax's unfinished folders (STEP.orbax-checkpoint-tmp-*) are skipped and left in place too.
"""

import contextlib
import errno
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from shard import paths
from shard.errors import UserError, first_line, warn
from shard.core.state import TrainState

TMP_MARK = ".orbax-checkpoint-tmp"
RETRY_DELAYS_S = (1, 4, 16)  # waits between the tries of a read that failed for I/O
# Storage status words (tensorstore's, gRPC's) of a read that failed for the storage's sake, not the data's.
_IO_WORDS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED",
             "ABORTED", "Connection reset", "timed out")
_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)


def io_error(e: BaseException) -> bool:
    """Whether a failed read is the storage's fault (worth retrying, never a reason to skip the step)."""
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    if isinstance(e, OSError) and e.errno not in _MISSING and not isinstance(e, FileNotFoundError):
        return True
    return any(word in str(e) for word in _IO_WORDS)


def with_retries(read, where: str, delays=None):
    """read(), retried with backoff while it fails for I/O; then one line. Other failures pass through."""
    delays = RETRY_DELAYS_S if delays is None else delays
    for attempt in range(len(delays) + 1):
        try:
            return read()
        except UserError:
            raise
        except Exception as e:
            if not io_error(e):
                raise
            if attempt == len(delays):
                raise UserError(f"checkpoint {where} could not be read after {attempt + 1} tries, for the storage's "
                                f"sake ({first_line(e)}); nothing was skipped: "
                                "check the storage and run again") from None
            warn(f"reading checkpoint {where} failed ({first_line(e)}); trying again in {delays[attempt]} s")
            time.sleep(delays[attempt])


def _handlers() -> dict:
    return {"model": ocp.StandardCheckpointHandler(), "optimizer": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler()}


def _items(state: TrainState) -> dict:
    optimizer = {"opt_state": state.opt_state, "step": state.step}
    if state.outer is not None:  # train.sync=local_sgd/diloco: the outer state too
        optimizer["outer"] = state.outer
    if state.extra:  # other strategies' state (shard/strategies/base.py), by strategy name
        optimizer["extra"] = state.extra
    return {"model": {"params": state.params, "rest": state.rest}, "optimizer": optimizer}


def abstract_target(abstract: TrainState, shardings) -> TrainState:
    """Shapes, dtypes and the *new* shardings: Orbax reads each array's shards into place."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


class Checkpoints:
    """This run's checkpoint folder: save every so often, find and restore the newest readable one."""

    def __init__(self, directory: str | Path, keep: int, use_async: bool):
        self.directory = paths.resolve(directory)
        for partial in sorted(self.directory.glob(f"*{TMP_MARK}*")) if self.directory.is_dir() else []:
            warn(f"skipping incomplete checkpoint {partial} (a save was interrupted); it is left in place")
        # Never deleted: what a kill left behind may be all there is of a step someone wants to look at.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=use_async,
                                               cleanup_tmp_directories=False, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        self.unreadable: set[int] = set()  # steps skipped as corrupt: rewritten, not kept, when saved again

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, state: TrainState, step: int, seed: int, train_steps: int, wait: bool = False,
             data_offset: int = 0) -> None:
        """The step (one global batch per step, so also the position in the data) and `seed` fix the
        data order; training itself draws no other random numbers, and a model's own RNG variables are
        part of `state.rest`. `train_steps` (the run's planned length) fixes the learning-rate schedule.
        `data_offset`: batches skipped by rollbacks (shard/run/badsteps.py), so step k reads batch k-1+offset."""
        if step in self.unreadable and step in self.manager.all_steps():
            self._move_aside(step)  # the corrupt copy is kept, under another name, as its replacement is written
        if step not in self.manager.all_steps():
            self.unreadable.discard(step)
            items = {k: ocp.args.StandardSave(v) for k, v in _items(state).items()}
            meta = {"step": step, "seed": seed, "train_steps": train_steps}
            meta = ocp.args.JsonSave(meta | ({"data_offset": data_offset} if data_offset else {}))
            self.manager.save(step, args=ocp.args.Composite(**items, meta=meta), force=True)
        if wait:
            self.manager.wait_until_finished()

    def _move_aside(self, step: int) -> None:
        old = self.directory / str(step)
        for n in range(1000):
            aside = self.directory / f"{step}.unreadable{'-' + str(n) if n else ''}"
            if not aside.exists():
                break
        old.rename(aside)
        warn(f"moved unreadable checkpoint {old} to {aside}; step {step} is written again")
        self.manager.reload()

    def meta(self, step: int) -> dict:
        """A step's meta alone (step, seed, train_steps, data_offset), read without its arrays."""
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def restore_latest(self, target: TrainState) -> tuple[TrainState, dict] | None:
        """The newest checkpoint that reads back whole; corrupt ones are skipped with a warning (and rewritten
        when saved again), I/O failures retried and then refused (shard.run.checkpoint.with_retries)."""
        steps = self.steps()
        for step in reversed(steps):
            try:
                return with_retries(lambda: restore_step(self.manager, step, target), str(self.directory / str(step)))
            except UserError:
                raise
            except Exception as e:  # a corrupt or truncated checkpoint
                warn(f"skipping unreadable checkpoint {self.directory / str(step)}: {first_line(e)}")
                self.unreadable.add(step)
        if steps:
            raise UserError(f"no readable checkpoint in {self.directory}; move it away to start afresh")
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_step(manager: ocp.CheckpointManager, step: int, target: TrainState,
                 model_only: bool = False) -> tuple[TrainState, dict]:
    check_shapes(manager, step, target)
    if target.extra and not model_only:  # a strategy's state the checkpoint lacks is left None: the job fills it
        saved = manager.item_metadata(step)["optimizer"].tree.get("extra") or {}
        kept = {k: v for k, v in target.extra.items() if k in saved}
        target = target.replace(extra=kept or None)
    items = _items(target)
    if model_only:
        items = {"model": items["model"]}
    args = {k: ocp.args.StandardRestore(v) for k, v in items.items()}
    restored = manager.restore(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonRestore()))
    model = restored["model"]
    state = target.replace(params=model["params"], rest=model["rest"])
    if not model_only:
        state = state.replace(opt_state=restored["optimizer"]["opt_state"], step=restored["optimizer"]["step"],
                              outer=restored["optimizer"].get("outer"), extra=restored["optimizer"].get("extra"))
    return state, dict(restored["meta"])


def check_shapes(manager: ocp.CheckpointManager, step: int, target: TrainState, one: TrainState | None = None) -> None:
    """Name the first parameter whose saved shape differs from the model's, before reading anything.
    `one` (train.sync=local_sgd/diloco: one replica's target): one model, or any number of replicas', fits too."""
    if one is not None and layout(manager, step, one) is not None:
        return
    where = paths.resolve(manager.directory) / str(step)
    saved = _shapes(manager.item_metadata(step)["model"].tree)
    wanted = _shapes(_items(target)["model"])
    for path, shape in wanted.items():
        if path not in saved:
            raise UserError(f"checkpoint {where} has no parameter {path}; it was saved from another model")
        if tuple(saved[path]) != tuple(shape):
            raise UserError(f"checkpoint {where}: parameter {path} has shape {tuple(saved[path])}, "
                            f"but this model's is {tuple(shape)}")
    extra = sorted(set(saved) - set(wanted))
    if extra:
        raise UserError(f"checkpoint {where} has parameter {extra[0]} that this model lacks; "
                        "it was saved from another model")


def _shapes(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
        out[name] = _stored_shape(leaf)
    return out


def _stored_shape(leaf) -> tuple:
    """The shape as saved: a typed random key (e.g. a Dropout's nnx.Rngs) is stored as its key data."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
    return tuple(getattr(leaf, "shape", ()))


def open_path(path: str, key: str) -> tuple[ocp.CheckpointManager, int]:
    """A user-given checkpoint: a run folder, its checkpoints folder, or one step folder in it."""
    p = paths.resolve(path)
    if not p.exists():
        raise UserError(f"{key}={path!r} does not exist")
    step = None
    if p.name.isdigit() and (p / "meta").exists():
        p, step = p.parent, int(p.name)
    elif (p / "checkpoints").is_dir() and not any(c.name.isdigit() for c in p.iterdir()):
        p = p / "checkpoints"
    options = ocp.CheckpointManagerOptions(create=False)  # we only read; nothing is saved through it
    manager = ocp.CheckpointManager(p, options=options, item_handlers=_handlers())
    steps = sorted(manager.all_steps())
    if not steps:
        raise UserError(f"{key}={path!r} holds no checkpoint (expected a run folder, its checkpoints/ "
                        "folder, or a step folder)")
    return manager, steps[-1] if step is None else step


def check_resumable(directory: str | Path, target: TrainState, one: TrainState | None = None) -> None:
    """Before the run folder is touched: this run's own newest checkpoint must fit the model."""
    directory = paths.resolve(directory)
    if not directory.is_dir():
        return
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False),
                                    item_handlers=_handlers())
    try:
        steps = manager.all_steps()
        if steps:
            check_shapes(manager, max(steps), target, one)
    except UserError as e:
        raise UserError(f"{e}; to train this model, use a new run.dir") from None
    except Exception:
        pass  # unreadable: resuming skips it with a warning
    finally:
        manager.close()


@contextlib.contextmanager
def _named_checkpoint(path: str, key: str):
    """(manager, step) of a user-named checkpoint; any failure to read it becomes one clear line."""
    manager, step = open_path(path, key)
    try:
        yield manager, step
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{key}: checkpoint {manager.directory / str(step)} is unreadable: {first_line(e)}") from None
    finally:
        manager.close()


def check_path(path: str, key: str, target: TrainState, one: TrainState | None = None) -> None:
    """Fail early (before the run folder is touched) on a missing path, no checkpoint, or other shapes."""
    with _named_checkpoint(path, key) as (manager, step):
        check_shapes(manager, step, target, one)


def open_named(path: str, key: str, step: int | None = None):
    """(checkpoints folder, step) of a user-named checkpoint (`step`, else its newest or the step folder's)."""
    with _named_checkpoint(path, key) as (manager, newest):
        _check_step(manager, path, key, step)
        return paths.resolve(manager.directory), newest if step is None else step


def _check_step(manager, path: str, key: str, step: int | None) -> None:
    if step is not None and step not in manager.all_steps():
        raise UserError(f"{key}={path!r} has no step {step}; its steps are "
                        f"{', '.join(map(str, sorted(manager.all_steps())))}")


def layout(manager: ocp.CheckpointManager, step: int, one: TrainState) -> int | None:
    """0: the checkpoint holds one model of `one`'s shapes; R: R replicas' of it; None: neither."""
    saved = _shapes(manager.item_metadata(step)["model"].tree)
    wanted = _shapes(_items(one)["model"])
    if set(saved) != set(wanted) or not wanted:
        return None
    if all(tuple(saved[k]) == tuple(v) for k, v in wanted.items()):
        return 0
    r = {tuple(saved[k])[0] if len(saved[k]) == len(v) + 1 else -1 for k, v in wanted.items()}
    if len(r) == 1 and all(tuple(saved[k])[1:] == tuple(v) for k, v in wanted.items()):
        return r.pop()
    return None


def restore_path(path: str, key: str, target: TrainState, model_only: bool,
                 step: int | None = None) -> tuple[TrainState, dict]:
    """The checkpoint a user named (its newest step, or `step`), read into `target`'s shardings."""
    with _named_checkpoint(path, key) as (manager, newest):
        _check_step(manager, path, key, step)
        return restore_step(manager, newest if step is None else step, target, model_only=model_only)


def tree_manager(directory) -> ocp.CheckpointManager:
    """A read-only manager whose items are plain trees: what partial restores (`restore_parts`) read through."""
    handlers = {"model": ocp.PyTreeCheckpointHandler(), "optimizer": ocp.PyTreeCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(Path(directory), options=ocp.CheckpointManagerOptions(create=False),
                                 item_handlers=handlers)


def restore_parts(manager, step: int, items: dict) -> dict:
    """Only the arrays `items` names ({"model": {...}, "optimizer": {...}}, targets with shardings) of a step,
    with its meta: Orbax's partial restore reads nothing else."""
    args = {k: ocp.args.PyTreeRestore(v, restore_args=ocp.checkpoint_utils.construct_restore_args(v),
                                      partial_restore=True) for k, v in items.items()}
    return manager.restore(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonRestore()))


def read_parts(directory, step: int, items: dict) -> dict:
    """`restore_parts` of one step of a checkpoints folder."""
    manager = tree_manager(directory)
    try:
        return restore_parts(manager, step, items)
    finally:
        manager.close()
