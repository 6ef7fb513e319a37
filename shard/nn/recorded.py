"""Values a model records in its forward pass for the trainer: auxiliary losses and statistics.

A model creates these variables in `__init__` and sets them in `__call__` (`self.aux.set_value(...)`);
they live with its other non-parameter state. The train step adds every `AuxLoss` to the training
loss (e.g. a mixture of experts' load-balancing term) and logs their sum as `aux_loss`; every
`Stat` (a scalar) is logged under its attribute name. Neither names a mesh or a strategy. The step does
so for every objective (`added`): the lm loss, DPO's and GRPO's (shard/objectives/) alike, from the
trained model's last forward pass (a frozen reference is another module: its values are never added).
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
