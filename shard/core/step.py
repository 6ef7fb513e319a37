"""The jitted train and eval steps: the objective's loss (shard/objectives/), gradients, optimizer update.

Both are compiled ahead of time with explicit input and output shardings, so nothing is
resharded behind the user's back and the compiled program (memory, collectives) can be inspected.
The train step donates the old state: its buffers are reused for the new one.
"""

import contextlib
import re
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard.nn import ring
from shard.strategies import gradients
from shard.nn import recorded
from shard.errors import UserError
from shard.core.blame import blamed
from shard.core.precision import cast_floats
from shard.core.state import TrainState


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, goal, dtype,
                    skip_nonfinite: bool = False, reduction: gradients.Reduction = gradients.Reduction(),
                    device_shardings=None, order: tuple | None = None, schedule: Callable | None = None,
                    trainable=None, arrange: Callable | None = None, reference: Callable | None = None,
                    differentiate: Callable | None = None) -> Callable:
    """The train step: `goal`'s loss (the objective's, shard/objectives/: each microbatch's mean loss counting 1/K
    under accumulation, so the update is the whole batch's), gradients reduced as `reduction` says
    (shard/strategies/gradients.py), one optimizer update.
    `device_shardings` (host offload) is the state's layout in device memory: what lives on the host between
    steps is moved there for the step and back after it (the out shardings say where). `order`: context
    parallelism's load-balanced token order, in which inputs and targets are laid out (shard/nn/ring.py).
    `schedule`: the learning rate's, whose value at this step is an output (computed in the step, the trainer
    never dispatches a computation of its own to read it, which on a CPU would wait for the running step).
    `trainable` (low-rank adapters): what the step trains instead of `state.params`, as an object with
    `get(state)` (the trained tree), `put(state, tree)` and `weights(state, tree)` (the model's parameters
    they stand for); the rest of the state is a constant of the differentiation, so it gets no gradient.
    `arrange` (a pipeline): the order of the rows the model is run on, the loss being a mean over them.
    `reference(state)`: the frozen weights the objective compares with (shard/strategies/reference.py), if it
    wants them. `differentiate`: what stands for jax.value_and_grad of the objective (a 1F1B pipeline's schedule)."""

    def objective(params, rest, batch, weights=None, frozen=None):
        batch = ring.reorder(batch, order)
        batch = arrange(batch) if arrange is not None else batch
        model = nnx.merge(graphdef, cast_floats(params if weights is None else weights(params), dtype), rest,
                          copy=True)
        base = None if frozen is None else nnx.merge(graphdef, cast_floats(frozen, dtype), rest, copy=True)
        loss, stats = goal.loss(model, batch, base)
        # what the trained model recorded (e.g. a router's load-balancing loss), whatever the objective
        total, stats = recorded.added(model, loss, stats)
        return total, (kept_like(nnx.state(model, nnx.Not(nnx.Param)), rest), loss, stats)

    value_and_grad = differentiate or jax.value_and_grad
    gradient = gradients.build(value_and_grad(objective, has_aux=True), reduction)

    def train_step(state: TrainState, batch: dict):
        state = to_device(state, device_shardings)
        frozen = None if reference is None else jax.lax.stop_gradient(reference(state))
        if trainable is not None:
            return step_parts(state, batch, trainable.get(state), trainable.put, gradients.build(value_and_grad(
                partial(objective, weights=partial(trainable.weights, state), frozen=frozen), has_aux=True), reduction))
        if frozen is not None:
            return step_parts(state, batch, state.params, lambda s, p: s.replace(params=p), gradients.build(
                value_and_grad(partial(objective, frozen=frozen), has_aux=True), reduction))
        return step_parts(state, batch, state.params, lambda s, p: s.replace(params=p), gradient)

    def step_parts(state: TrainState, batch: dict, params, put, gradient):
        (total, (rest, loss, stats)), grads = gradient(params, state.rest, batch)
        rest = recorded.after_update(graphdef, state.params, rest)  # once a step: a router bias moved by its load
        updates, opt_state = tx.update(grads, state.opt_state, params)
        new_state = put(state.replace(step=state.step + 1, rest=rest, opt_state=opt_state),
                        optax.apply_updates(params, updates))
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
        if skip_nonfinite:  # keep the old parameters and optimizer state; the batch is still consumed
            skipped = state.replace(step=state.step + 1)
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, skipped)
        out = {"loss": loss, "grad_norm": grad_norm, "finite": finite, **stats}
        if schedule is not None:
            out["lr"] = schedule(state.step)
        return new_state, out

    return train_step


def kept_like(new, old):
    """The state the forward pass left, in the step's own variables (their dtype and metadata): a Linen module
    bridged by nnx.bridge stores its updates (batch statistics) as new Variables with Flax's default metadata.
    State that appeared or vanished in the forward pass is refused: the step's output must be its input's shape."""
    is_var = lambda x: isinstance(x, nnx.Variable)
    names = lambda tree: {jax.tree_util.keystr(p, simple=True, separator="/")
                          for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_var)[0]}
    if (added := names(new) - names(old)) | (gone := names(old) - names(new)):
        raise UserError(f"the model's forward pass changed its non-parameter state (new: {sorted(added)}, "
                        f"gone: {sorted(gone)}); the train state holds the variables the model is built with, so "
                        "create every variable the forward pass updates when the model is built")
    return jax.tree.map(lambda n, o: o.replace(n.get_value().astype(o.get_value().dtype)) if is_var(o)
                        else n.astype(o.dtype), new, old, is_leaf=is_var)


def to_device(state, device_shardings):
    """Host offload: the state moved into device memory inside the step (a no-op without offload)."""
    return state if device_shardings is None else jax.device_put(state, device_shardings)


def make_eval_step(graphdef: nnx.GraphDef, goal, dtype, device_shardings=None, order: tuple | None = None,
                   reference: Callable | None = None) -> Callable:
    """`goal`'s sums over the real (mask 1) examples of a batch (its `eval_sums`); the caller divides by the
    totals. `reference`: as for the train step."""

    def eval_step(state: TrainState, batch: dict):
        state, batch = to_device(state, device_shardings), ring.reorder(batch, order)
        model = nnx.merge(graphdef, cast_floats(state.params, dtype), state.rest)
        model.eval()  # e.g. normalisation layers use their running statistics
        base = None if reference is None else nnx.merge(graphdef, cast_floats(reference(state), dtype), state.rest)
        return goal.eval_sums(model, batch, base)

    return eval_step


class Forward(NamedTuple):
    outputs: jax.ShapeDtypeStruct  # the model's output on one batch
    jaxpr: object                  # its forward pass (shard/core/flops.py counts attention there)


def model_forward(graphdef: nnx.GraphDef, abstract_state, abstract_batch: dict, dtype, model_name: str,
                  num_classes: int) -> Forward:
    """The model's forward pass on one batch in the compute dtype (as the train step runs it, e.g. for
    kernels that only take half precision), traced abstractly; its outputs must cover the data's classes."""
    def forward(state, inputs):
        return nnx.merge(graphdef, cast_floats(state.params, dtype), state.rest)(cast_floats(inputs, dtype))

    shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in abstract_batch.items()}
    with blamed(f"model {model_name!r} failed on a batch {shapes}"):
        jaxpr, outputs = jax.make_jaxpr(forward, return_shape=True)(abstract_state, abstract_batch["inputs"])
    if num_classes and outputs.shape[-1] < num_classes:
        raise UserError(f"model {model_name!r} outputs {outputs.shape[-1]} scores per prediction but the targets "
                        f"range over {num_classes} classes; make its output width (vocab_size, out_features, ...) "
                        f"at least {num_classes}")
    return Forward(outputs, jaxpr)


_UNKNOWN = re.compile(r"No such compile option: '([^']+)'")


def compile_with(lowered, flags=None):
    """lowered.compile() with the flags (shard.plan.target.CompilerFlags) as compiler options: each a
    DebugOptions field or, on TPU, a libtpu flag."""
    if flags is None or not flags.flags:
        return lowered.compile()
    while True:
        try:
            return lowered.compile(compiler_options=dict(flags.flags))
        except Exception as e:  # the runtime's error type differs between jaxlib versions
            unknown = _UNKNOWN.search(str(e))
            if not unknown:
                raise
            name = unknown.group(1)
            if name in flags.users or name not in flags.flags:
                raise UserError(f"run.compiler_flags: this compiler has no flag {name!r} (a libtpu flag needs a TPU "
                                "or run.target=<TPU slice>; an XLA GPU flag a GPU or run.target=<GPUs>)") from None
            flags.flags.pop(name)
            flags.dropped.append(name)


def compile_step(fn: Callable, abstract_state, state_shardings, abstract_batch, batch_shardings,
                 mesh, *, donate: bool, returns_state: bool, what: str, flags=None, target_default: bool = False):
    """jit with explicit shardings, traced, lowered and compiled now (errors surface before training
    starts, named by `what`), with the compiler flags for the device. target_default: traced with the mesh's first
    device as JAX's default (`traced_for`), for a step whose kernels pick their lowering by it."""
    replicated = NamedSharding(mesh, PartitionSpec())
    out_shardings = (state_shardings, replicated) if returns_state else replicated
    jitted = jax.jit(fn, in_shardings=(state_shardings, batch_shardings), out_shardings=out_shardings,
                     donate_argnums=(0,) if donate else ())
    # it traced without one: the layout's
    with blamed(f"{what} does not compile on mesh {dict(mesh.shape)}"), \
            traced_for(mesh) if target_default else contextlib.nullcontext():
        lowered = jitted.lower(abstract_state, abstract_batch)
    return compile_with(lowered, flags)


def traced_for(mesh):
    """Where the mesh's devices are not this machine's default backend's (run.target's compile-only TPUs or GPUs),
    the first of them as JAX's default device while the step is traced: kernels that pick their lowering by the
    default device (tokamax's grouped products: Mosaic on a TPU, else its XLA path) pick the target's. Only for a step
    that needs it: splash attention's mask, built while tracing, would then run on a device that compiles only."""
    first = mesh.devices.flat[0]
    return jax.default_device(first) if first.platform != jax.devices()[0].platform else contextlib.nullcontext()
