"""DPO's reference log-likelihoods computed once, before the first step (`train.dpo.precompute=true`): the
reference is the starting weights, so each pair's two values are known before training and need neither a
copy of the weights in device memory nor the reference's forward passes in every step.

They are computed with the run's starting state on its mesh (every process feeding its rows of each batch, as
eval does, and receiving every value), kept in the pairs' `chosen_ref` and `rejected_ref` columns, and written to
`<run.dir>/dpo_reference.npz` by process 0. A resumed run's state is no longer the start, so it reads them back
from there (a run folder without them cannot resume: one line).
"""

import io

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard import data as data_lib, paths
from shard.core import state as state_lib
from shard.core.precision import cast_floats
from shard.errors import UserError

FILE = "dpo_reference.npz"


def fill(splits: dict, job, state, run_dir, main: bool, likelihoods) -> None:
    """Set each split's (name -> preferences.Pairs) `chosen_ref` and `rejected_ref` from the starting state, or
    from the run folder when the run resumes. `likelihoods(model, inputs, targets, mask)`: per row, the sum."""
    path = paths.resolve(run_dir) / FILE  # run.dir may be a URL (gs://): read and written as bytes
    if int(state.step) > 0:
        if not path.exists():
            raise UserError(f"train.dpo.precompute=true: this run resumes at step {int(state.step)} but {path} is "
                            "missing (the reference's log-likelihoods computed at its start); start a new run.dir")
        saved = np.load(io.BytesIO(path.read_bytes()))
        for name, pairs in splits.items():
            for key in ("chosen_ref", "rejected_ref"):
                if saved[f"{name}_{key}"].shape != pairs.arrays[key].shape:
                    raise UserError(f"{path} holds the reference for other pairs than this run's data; start a new "
                                    "run.dir")
                pairs.arrays[key][:] = saved[f"{name}_{key}"]
        return
    compute = _program(job, likelihoods)
    params = state_lib.in_device_memory(job.model_view(state).params)
    out = {}
    for name, pairs in splits.items():
        batches = data_lib.EvalBatches(pairs, lambda b: b, job.work.data.batch_size, job.work.data.rows)
        feed = data_lib.device_batches(batches, job.eval_shardings, prefetch=0, batch_size=job.work.data.batch_size)
        got = [jax.device_get(compute(params, state.rest, next(feed))) for _ in range(len(batches))]
        feed.close()
        for i, key in enumerate(("chosen_ref", "rejected_ref")):
            pairs.arrays[key][:] = np.concatenate([g[i] for g in got])[:len(pairs)]
            out[f"{name}_{key}"] = pairs.arrays[key]
    if main:
        buffer = io.BytesIO()
        np.savez(buffer, **out)
        path.write_bytes(buffer.getvalue())


def _program(job, likelihoods):
    """The reference's per-row log-likelihoods of both answers of a batch, every value on every process."""
    graphdef, dtype = job.work.graphdef, job.work.dtype

    def both(params, rest, batch):
        model = nnx.merge(graphdef, cast_floats(params, dtype), rest)
        return (likelihoods(model, batch["inputs"], batch["targets"], batch["chosen_mask"])[0],
                likelihoods(model, batch["rejected_inputs"], batch["rejected_targets"], batch["rejected_mask"])[0])

    everywhere = NamedSharding(job.mesh, PartitionSpec())
    return jax.jit(both, out_shardings=(everywhere, everywhere))


def columns(n: int) -> dict:
    """The two columns before they are computed (filled in place by `fill`)."""
    return {"chosen_ref": np.zeros(n, np.float32), "rejected_ref": np.zeros(n, np.float32)}
