"""Values a model records in its forward pass for the trainer: auxiliary losses and statistics.

A model creates these variables in `__init__` and sets them in `__call__` (`self.aux.set_value(...)`);
they live with its other non-parameter state. The train step adds every `AuxLoss` to the training
loss (e.g. a mixture of experts' load-balancing term) and logs their sum as `aux_loss`; every
`Stat` (a scalar) is logged under its attribute name. Neither names a mesh or a strategy. The step does
so for every objective (`added`): the lm loss, DPO's and GRPO's (shard/objectives/) alike, from the
trained model's last forward pass (a frozen reference is another module: its values are never added).

A module may also keep state it changes by a rule of its own rather than by gradient, once per optimizer step (an
auxiliary-loss-free router's bias, moved by the load its forward passes tallied): its `after_update()` method, which
the train step calls on the model's state after the update (`after_update` here). Evaluation and generation run no
update, so they never call it; its forward passes only tally (sums over a step's microbatches, or a pipeline's mean
of them, keep what the step saw).
"""

import jax
import jax.numpy as jnp
from flax import nnx


class AuxLoss(nnx.Variable):
    """A term added to the training loss (all of them summed, whatever their shape)."""


class Stat(nnx.Variable):
    """A scalar diagnostic, logged with the loss under the variable's name."""


def collect(model: nnx.Module) -> tuple[jax.Array | None, dict]:
    """(sum of the model's auxiliary losses or None, {stat name: value})."""
    aux_leaves = jax.tree.leaves(nnx.state(model, AuxLoss))
    aux = sum(jnp.sum(x.astype(jnp.float32)) for x in aux_leaves) if aux_leaves else None
    stats = {}
    for path, value in nnx.to_flat_state(nnx.state(model, Stat)):
        value = value.get_value() if isinstance(value, nnx.Variable) else value
        stats[str(path[-1])] = jnp.asarray(value, jnp.float32).reshape(())
    return aux, stats


def added(model: nnx.Module, loss: jax.Array, stats: dict) -> tuple[jax.Array, dict]:
    """(`loss` plus the model's auxiliary losses, `stats` with their sum as `aux_loss` and the model's stats)."""
    aux, recorded = collect(model)
    if aux is None:
        return loss, {**recorded, **stats}
    return loss + aux, {"aux_loss": aux, **recorded, **stats}


def after_update(graphdef: nnx.GraphDef, params, rest):
    """The model's non-parameter state after an optimizer step: every module's `after_update()` called on it (see the
    module's docstring); `rest` itself where no module has one."""
    model = nnx.merge(graphdef, params, rest, copy=True)
    modules = [m for _, m in nnx.iter_modules(model) if callable(getattr(m, "after_update", None))]
    if not modules:
        return rest
    for module in modules:
        module.after_update()
    return nnx.state(model, nnx.Not(nnx.Param))
