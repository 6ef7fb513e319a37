"""The prepared job: everything a run (or the plan) needs before it allocates anything.

Two parts. The workload is what the mesh does not change: model class and arguments, data, loss,
optimizer, the state's shapes and the step's model FLOPs. The job adds what the mesh decides: the
mesh itself, every array's sharding and the compiled steps. `--compare` builds the workload once and
a job per candidate mesh; a training run builds one of each (shard/trainer.py).
"""

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shard.run import checkpoint as ckpt_lib
from shard import config as config_lib
from shard import data as data_lib
from shard.strategies import context, gradients
from shard.run import distributed
from shard import hooks, partition, paths
from shard.core import losses, optim, registry
from shard.plan import flops as flops_lib
from shard.core import mesh as mesh_lib
from shard.strategies import pipeline as pipeline_lib
from shard.core import state as state_lib
from shard.core import step as step_lib
from shard.strategies import sync as sync_lib
from shard.errors import UserError


@dataclass
class Workload:
    """The model, data, loss and optimizer: what every candidate mesh shares."""
    model_cls: type
    kwargs: dict          # model arguments, as given (checked against the class's signature)
    resolved: str         # the resolved config as YAML, model defaults filled in (config.yaml)
    data: data_lib.Data
    loss_fn: object
    tx: object
    schedule: object
    dtype: object         # the compute dtype (train.dtype)
    graphdef: object
    abstract: object      # the train state's shapes and dtypes
    init: object          # builds the train state (jitted with its shardings by state.init_state)
    batch: dict           # one global batch's shapes, train and eval
    eval_batch: dict
    flops_per_step: float  # model FLOPs of one train step, all devices together (shard/flops.py)
    stacks: tuple = ()     # the layer count of each stack the model runs through shard.hooks.stack


@dataclass
class Job:
    """A workload laid out on a mesh: shardings and compiled steps."""
    work: Workload
    mesh: object
    rules: dict
    shardings: object
    batch_shardings: dict
    eval_shardings: dict
    target: object          # the state's shapes with their shardings: what checkpoints restore into
    checkpoint_dir: object  # an etils.epath.Path: local, or a URL such as gs://
    train_step: object
    eval_step: object       # None for the plan
    compile_s: float        # seconds to trace, lower and compile the train step
    split: list             # per parameter: shape, spec and how it was split (state.split_report)
    pipeline: object = None # the pipeline Schedule under mesh.stage > 1 (shard/pipeline.py), else None
    context: object = None  # the context split under mesh.context > 1 (shard/context.py), else None
    reduction: object = None  # how the gradients are accumulated and reduced (shard/gradients.py)
    abstract: object = None   # the train state's shapes on this mesh (the workload's, or every replica's under sync)
    init: object = None       # builds that state (jitted with `shardings` by state.init_state)
    sync: object = None       # train.sync=local_sgd/diloco: the Sync (shard/sync.py), else None
    sync_steps: tuple = ()    # its compiled programs, one per fragment
    layout: object = None     # a circular pipeline's order of the stacked layers in the state (shard/pipeline.py)
    one_target: object = None  # under sync: one replica's target (what a checkpoint of another layout is read into)


def workload(cfg: config_lib.Config, devices: list) -> Workload:
    """Model, data, loss and optimizer for cfg, checked against each other and the devices (nothing
    allocated)."""
    hooks.check_attention(cfg.train.attention, devices[0], jnp.dtype(cfg.train.dtype))
    model_cls, kwargs = registry.load(cfg.model)
    resolved = config_lib.to_yaml(cfg, model_kwargs=registry.with_defaults(model_cls, kwargs))
    data = data_lib.build(cfg.data, cfg.train.seed)
    loss_fn = losses.resolve(cfg.train.loss, data.task)
    tx, schedule = optim.build(cfg.optimizer, cfg.train.steps)
    dtype = jnp.dtype(cfg.train.dtype)
    graphdef, abstract, init = state_lib.abstract_state(model_cls, kwargs, tx, cfg.train.seed, cfg.model.name)
    batch, eval_batch = data.abstract_batch(), data.abstract_batch(eval=True)
    # The model's FLOPs do not depend on the mesh: traced once, without rules and without remat (MFU
    # counts the model's work, not a recomputed forward), with the configured attention kernel.
    with hooks.use(attention=cfg.train.attention):
        with hooks.watch_stacks() as stacks:  # one forward: each stack the model runs, once
            forward = step_lib.model_forward(graphdef, abstract, batch, dtype, cfg.model.name, data.num_classes)
        train_fn = step_lib.make_train_step(graphdef, tx, loss_fn, dtype, cfg.train.skip_nonfinite)
        try:
            train_jaxpr = jax.make_jaxpr(train_fn)(abstract, batch)
        except (TypeError, ValueError) as e:
            raise UserError(f"{_loss_context(cfg, loss_fn, data, forward, batch)}: "
                            f"{str(e).strip().splitlines()[0]}") from None
    flops = flops_lib.train_step_flops(train_jaxpr.jaxpr, forward.jaxpr)
    return Workload(model_cls, kwargs, resolved, data, loss_fn, tx, schedule, dtype, graphdef, abstract, init,
                    batch, eval_batch, flops, tuple(stacks))


def _loss_context(cfg, loss_fn, data, forward, batch) -> str:
    targets = batch["targets"]
    return (f"train.loss={loss_fn.__name__} does not fit outputs {tuple(forward.outputs.shape)} and targets "
            f"{tuple(targets.shape)} {targets.dtype} (task {data.task})")


def prepare(cfg: config_lib.Config, devices: list, work: Workload | None = None, training: bool = True) -> Job:
    """cfg's workload (built here unless given) on cfg's mesh over these devices, compiled.
    `training=False` (the plan) compiles only the train step and leaves checkpoints alone."""
    if cfg.mesh.preset == "auto":
        raise UserError("mesh=auto is resolved before a job is prepared (shard.plan.apply_auto, as train.py does)")
    work = work or workload(cfg, devices)
    if training:  # before compiling: every process runs the same job
        distributed.check_same_config(cfg, registry.with_defaults(work.model_cls, work.kwargs))
    mesh = mesh_lib.build_mesh(cfg.mesh, devices)
    rules = partition.merged_rules(cfg.mesh.rules, mesh.axis_names)
    abstract = work.abstract

    pipe = pipeline_lib.settings(cfg, dict(mesh.shape), rules, work)
    seq = context.settings(cfg, dict(mesh.shape), work)
    sync = sync_lib.settings(cfg, dict(mesh.shape), abstract.params)
    order = seq.order if seq else None  # the load-balanced token order under context parallelism
    with partition.activate(mesh, rules), hooks.use(cfg.train.remat, cfg.train.attention, pipe, seq):
        auto_min = state_lib.auto_min_size(cfg.mesh)
        device_shardings = state_lib.state_shardings(abstract, mesh, rules, auto_min, cfg.mesh.zero)
        state_lib.check_offload(cfg.train.offload, devices[0])
        shardings = state_lib.host_shardings(device_shardings, cfg.train.offload)
        moved = None if shardings is device_shardings else device_shardings  # what each step moves in
        split = state_lib.split_report(abstract.params, dict(mesh.shape), rules, auto_min)
        batch_shardings = state_lib.batch_shardings(work.batch, mesh, rules)
        eval_shardings = state_lib.batch_shardings(work.eval_batch, mesh, rules)
        init, one_target = work.init, None
        if sync:
            one_target = ckpt_lib.abstract_target(abstract, shardings)  # every replica's state, and the outer state
            abstract, init = sync_lib.abstract_state(sync, abstract), sync_lib.init(sync, init)
            shardings = sync_lib.shardings(sync, shardings, mesh)
        # Checkpoints to read must fit this model: checked before the (slower) compile.
        target = ckpt_lib.abstract_target(abstract, shardings)
        checkpoint_dir = paths.resolve(cfg.checkpoint.dir or paths.resolve(cfg.run.dir) / "checkpoints")
        if training:
            if cfg.checkpoint.enabled:
                ckpt_lib.check_resumable(checkpoint_dir, target, one_target)
            for key, path in (("checkpoint.restore_from", cfg.checkpoint.restore_from),
                              ("train.init_from", cfg.train.init_from)):
                if path:
                    ckpt_lib.check_path(path, key, target, one_target)
        check_grad_accum(cfg, dict(mesh.shape), rules)
        reduction = gradient_reduction(cfg, mesh, rules, work, split, auto_min, device_shardings.params)
        train_fn = step_lib.make_train_step(work.graphdef, work.tx, work.loss_fn, work.dtype,
                                            cfg.train.skip_nonfinite, reduction, moved, order, work.schedule)
        eval_fn = step_lib.make_eval_step(work.graphdef, work.loss_fn, work.data.task, work.dtype, moved, order)
        if sync:  # every replica steps on its own share of the batch; eval sees their mean
            train_fn, plain_eval = sync_lib.local_step(train_fn, sync), eval_fn
            eval_fn = lambda state, batch: plain_eval(sync_lib.global_view(state), batch)
        compile_start = time.perf_counter()
        train_step = step_lib.compile_step(train_fn, abstract, shardings, work.batch, batch_shardings, mesh,
                                           donate=True, returns_state=True, what="the train step")
        compile_s = time.perf_counter() - compile_start
        eval_step = None if not training else step_lib.compile_step(
            eval_fn, abstract, shardings, work.eval_batch, eval_shardings, mesh, donate=False, returns_state=False,
            what="the eval step")
        sync_steps = tuple(jax.jit(sync_lib.sync_program(sync, f), in_shardings=(shardings,), out_shardings=shardings,
                                   donate_argnums=0).lower(abstract).compile()
                           for f in range(len(sync.fragments))) if sync else ()

    return Job(work, mesh, rules, shardings, batch_shardings, eval_shardings, target, checkpoint_dir, train_step,
               eval_step, compile_s, split, pipe, seq, reduction, abstract, init, sync, sync_steps,
               pipeline_lib.layout(pipe, work.graphdef, work.abstract, work.batch["inputs"]), one_target)


def gradient_reduction(cfg, mesh, rules: dict, work: Workload, split: list, auto_min,
                       param_shardings) -> gradients.Reduction:
    """How the step sums and reduces its gradients (shard/gradients.py): each device keeps its own over the
    leading data axes that split no parameter, for models whose examples stay apart."""
    param_axes = {a for r in split for entry in r["spec"] for a in partition.axes_of(entry)}
    local = gradients.local_axes(rules, dict(mesh.shape), param_axes)
    wire = jnp.dtype(cfg.train.grad_dtype)
    needed = cfg.train.grad_accum > 1 or wire != jnp.float32 or (cfg.mesh.zero and mesh.shape["data"] > 1) \
        or mesh.shape["stage"] > 1  # a pipeline would reduce each group's gradient at every microbatch it passes
    ring = cfg.train.context_strategy == "ring" and mesh.shape["context"] > 1
    interacts = gradients.interaction(work.model_cls, work.abstract.rest)
    fallback = ""
    if local and ring:  # the ring's shard_map cannot run under the per-shard vmap
        if wire != jnp.float32:
            raise UserError(f"train.grad_dtype={cfg.train.grad_dtype} with train.context_strategy=ring: the ring's "
                            "shard_map cannot run per data shard; use train.context_strategy=all_gather or "
                            "train.grad_dtype=float32")
        local, fallback = (), "train.context_strategy=ring cannot run per data shard"
    if local and interacts:
        if wire != jnp.float32:
            raise UserError(f"train.grad_dtype={cfg.train.grad_dtype} sums each device's own gradient, and model "
                            f"{cfg.model.name!r} has none: its examples meet in the forward pass ({interacts}); "
                            "use train.grad_dtype=float32")
        local, fallback = (), f"model {cfg.model.name!r} has examples that meet in the forward pass ({interacts})"
    if fallback and needed:
        fallback = (f"gradients are reduced by XLA inside the backward pass, not once a step per device: {fallback}; "
                    + _fallback_cost(cfg, mesh))
    else:
        fallback = ""
    if wire != jnp.float32 and not local:
        shown = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names if mesh.shape[a] > 1) or "one device"
        raise UserError(f"train.grad_dtype={cfg.train.grad_dtype} lowers the data axis's gradient reduction, and "
                        f"mesh {shown} splits the batch over no axis that leaves the parameters whole (fsdp and "
                        "expert reduce inside the backward pass); add mesh.data > 1 or use train.grad_dtype=float32")
    zero = cfg.mesh.zero and mesh.shape["data"] > 1
    return gradients.Reduction(
        accum=cfg.train.grad_accum, accum_dtype=jnp.dtype(cfg.train.accum_dtype), wire_dtype=wire,
        local_axes=local if needed else (),
        update_shardings=state_lib.update_shardings(work.abstract.params, mesh, rules, auto_min) if zero else None,
        param_shardings=param_shardings, split_sum=cfg.mesh.zero == 2, fallback=fallback)


def _fallback_cost(cfg, mesh) -> str:
    """What reducing inside the backward pass costs against once a step, for the knobs that wanted the latter."""
    costs = []
    if cfg.train.grad_accum > 1:
        costs.append(f"each of the {cfg.train.grad_accum} microbatches' gradients is reduced on its own "
                     f"({cfg.train.grad_accum}x the reduction bytes)")
    if mesh.shape["stage"] > 1:
        costs.append("the pipeline reduces each layer group's gradient at every microbatch it passes")
    if cfg.mesh.zero and mesh.shape["data"] > 1:
        costs.append("ZeRO's reduction into each device's slice is placed by XLA's partitioner")
    return "; ".join(costs) or "no extra bytes on this mesh"


def check_grad_accum(cfg, mesh_shape: dict, rules: dict) -> None:
    """train.grad_accum=K: the batch must cut into K microbatches that the batch's shards divide."""
    k, shards = cfg.train.grad_accum, partition.batch_shards(rules, mesh_shape)
    if k > 1 and (cfg.data.batch_size % k or (cfg.data.batch_size // k) % shards):
        raise UserError(f"train.grad_accum={k}: data.batch_size={cfg.data.batch_size} does not cut into {k} "
                        f"microbatches that the batch's {shards} shards divide; use a batch size that is a "
                        f"multiple of {k * shards}")
