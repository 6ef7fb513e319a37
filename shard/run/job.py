"""The prepared job: everything a run (or the plan) needs before it allocates anything.

Two parts. The workload is what the mesh does not change: model class and arguments, data, loss,
optimizer, the state's shapes and the step's model FLOPs. The job adds what the mesh decides: the
mesh itself, every array's sharding and the compiled steps. `--compare` builds the workload once and
a job per candidate mesh; a training run builds one of each (shard/run/trainer.py).
"""

import dataclasses
import inspect
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shard.run import badsteps
from shard.run import checkpoint as ckpt_lib
from shard import config as config_lib
from shard import data as data_lib
from shard.data import tokenizer as tokenizer_lib
from shard.strategies import gradients
from shard.strategies import registry as strategies
from shard.strategies.base import Strategy
from shard.run import distributed
from shard.nn import attention as attn
from shard import hf, objectives, paths
from shard.nn import dropless, grouped, hooks, partition
from shard.hf import read as hf_read
from shard.core import blame, optim, registry
from shard.core import flops as flops_lib
from shard.core import mesh as mesh_lib
from shard.core import state as state_lib
from shard.core import step as step_lib
from shard.errors import UserError
from shard.quant import training as quant_training


@dataclass
class Workload:
    """The model, data, loss and optimizer: what every candidate mesh shares."""
    model_cls: type
    kwargs: dict          # model arguments, as given (checked against the class's signature)
    resolved: str         # the resolved config as YAML, model defaults filled in (config.yaml)
    data: data_lib.Data
    tx: object
    schedule: object
    dtype: object         # the compute dtype (train.dtype)
    graphdef: object
    abstract: object      # the train state's shapes and dtypes
    init: object          # builds the train state (jitted with its shardings by state.init_state)
    batch: dict           # one global batch's shapes, train and eval
    eval_batch: dict
    flops_per_step: float  # model FLOPs of one train step, all devices together (shard/core/flops.py)
    stacks: tuple = ()     # the layer count of each stack the model runs through shard.nn.hooks.stack
    attention_flops: float = 0.0  # of those, attention's forward (a fused kernel's work: the plan counts it apart)
    objective: object = None  # train.objective's (shard/objectives/): its data, loss and eval sums
    grouped_flops: float = 0.0  # of the FLOPs, the grouped products' forward (experts' kernels: counted apart too)


@dataclass
class Job:
    """A workload laid out on a mesh: shardings, the active strategies and the compiled steps."""
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
    strategies: tuple = ()  # the active strategies, in the order they apply (shard/strategies/registry.py)
    reduction: object = None  # how the gradients are accumulated and reduced (shard/strategies/gradients.py)
    abstract: object = None   # the train state's shapes on this mesh, with every strategy's state
    init: object = None       # builds that state (jitted with `shardings` by state.init_state)
    one_target: object = None  # the model's own train state's target, before any strategy added to it
    fill: object = None       # compiled: sets strategies' state from the model (a checkpoint without it)
    flags: object = None      # the compiler flags the steps compiled with (shard.plan.target.CompilerFlags)

    def strategy(self, name: str):
        """The active strategy of that name, else None (for tests and tools that look at one)."""
        return next((s for s in self.strategies if s.name == name), None)

    def notes(self) -> list[str]:
        return [line for s in self.strategies for line in s.notes()]

    def trained(self):
        """The abstract tree the step trains where it is not the weights (LoRA's adapters), else None."""
        return next((t for s in self.strategies if (t := s.trained(self.abstract)) is not None), None)

    def to_running(self, state):
        for s in self.strategies:
            state = s.to_running(state)
        return state

    def to_stored(self, state):
        for s in reversed(self.strategies):
            state = s.to_stored(state)
        return state

    def model_view(self, state):
        """The model a (stored) state stands for: what eval, the sample, load_model and export see."""
        for s in reversed(self.strategies):
            state = s.model_view(state)
        return state

    def after_step(self, state, done: int):
        for s in self.strategies:
            state = s.after_step(state, done)
        return state

    def take(self, folder, step: int, resume: bool):
        """A checkpoint of another layout than this job's, as its strategies read it; None: read as usual."""
        return next((got for s in self.strategies if (got := s.take(self, folder, step, resume))), None)

    def filled(self, state, always: bool = False):
        """`state` with the strategies' own state set from its model where it lacks it (or `always`: after
        the weights were replaced, by train.init_from)."""
        if self.fill is None or not (always or any(s.lacks(state) for s in self.strategies)):
            return state
        return self.fill(state)


@dataclass
class Placement:
    """What the strategies are told while a job is prepared (filled in as it goes)."""
    cfg: object
    work: Workload
    mesh: object
    rules: dict
    auto_min: object
    strategies: tuple
    split: list = None
    device_shardings: object = None  # the state's shardings with everything in device memory


def workload(cfg: config_lib.Config, devices: list) -> Workload:
    """Model, data, loss and optimizer for cfg, checked against each other and the devices (nothing
    allocated)."""
    attn.check(cfg.train.attention, devices[0], jnp.dtype(cfg.train.dtype))
    dropless.check(cfg.train.expert_exchange, devices[0])
    model_cls, kwargs = registry.load(cfg.model)
    kwargs = with_vocabulary(cfg, model_cls, kwargs)
    resolved = config_lib.to_yaml(cfg, model_kwargs=registry.with_defaults(model_cls, kwargs))
    goal = objectives.build(cfg)
    data = goal.data(cfg, cfg.train.seed, token_cache_dir(cfg))
    tx, schedule = optim.build(cfg.optimizer, cfg.train.steps, goal.updates_per_step)
    dtype = jnp.dtype(cfg.train.dtype)
    graphdef, abstract, init = state_lib.abstract_state(model_cls, kwargs, tx, cfg.train.seed, cfg.model.name)
    batch, eval_batch = data.abstract_batch(), data.abstract_batch(eval=True)
    # The model's FLOPs do not depend on the mesh: traced once, without rules and without remat (MFU
    # counts the model's work, not a recomputed forward), with the configured attention kernel.
    with hooks.use(attention=cfg.train.attention), attn.configured(cfg.train.attention_precision, devices[0]):
        with hooks.watch_stacks() as stacks:  # one forward: each stack the model runs, once
            forward = step_lib.model_forward(graphdef, abstract, batch, dtype, cfg.model.name,
                                             embedded_classes(cfg, kwargs, data))
        goal.check_outputs(forward.outputs, batch)  # what fails there is the loss, not the model
        # a frozen reference's forward passes are the step's work too (traced here with the weights standing in)
        frozen = (lambda state: state.params) if goal.reference == "init" else None
        train_fn = step_lib.make_train_step(graphdef, tx, goal, dtype, badsteps.policy(cfg.train) == "skip",
                                            reference=frozen)
        train_fn = goal.around(train_fn, graphdef, dtype)
        with blame.blamed(f"model {cfg.model.name!r} fails in the train step"):  # e.g. its gradient, its state
            train_jaxpr = jax.make_jaxpr(train_fn)(abstract, batch)
    flops = flops_lib.train_step_flops(train_jaxpr.jaxpr, forward.jaxpr)
    return Workload(model_cls, kwargs, resolved, data, tx, schedule, dtype, graphdef, abstract, init,
                    batch, eval_batch, flops, tuple(stacks), flops_lib.attention_flops(forward.jaxpr), goal,
                    grouped_flops=flops_lib.grouped_flops(forward.jaxpr))


def with_vocabulary(cfg, model_cls, kwargs: dict) -> dict:
    """A language model's vocabulary follows data.tokenizer: model.vocab_size is set from it where the model
    takes one and the user left it out; one set smaller than the tokenizer is refused."""
    if cfg.data.name != "documents":
        return kwargs
    vocab = data_lib.vocab_size(cfg.data)
    if "vocab_size" in kwargs:
        # A Hugging Face checkpoint fixes its embedding; its tokenizer may hold a few tokens more (gemma-3's
        # image tokens), as transformers allows: the data's ids are checked instead (embedded_classes).
        if isinstance(kwargs["vocab_size"], int) and kwargs["vocab_size"] < vocab and not hf.is_folder(
                cfg.train.init_from):
            raise UserError(f"model.vocab_size={kwargs['vocab_size']} is smaller than data.tokenizer="
                            f"{cfg.data.tokenizer}'s {vocab} tokens; raise it or leave it out "
                            "(it then follows the tokenizer)")
        return kwargs
    if "vocab_size" in inspect.signature(model_cls.__init__).parameters:
        return {**kwargs, "vocab_size": vocab}
    return kwargs


def embedded_classes(cfg, kwargs: dict, data) -> int:
    """The classes the model's outputs must cover: the data's, or (a Hugging Face model whose tokenizer holds
    more tokens than it embeds) its own vocabulary, once every token id of the data is known to fall inside."""
    rows = kwargs.get("vocab_size")
    if data.largest_token is None or not isinstance(rows, int) or rows >= data.num_classes:
        return data.num_classes
    if wrong := tokenizer_lib.unembedded(tokenizer_lib.load(cfg.data.tokenizer), [data.largest_token], rows):
        raise UserError(f"data.path={cfg.data.path}: {wrong} (model.vocab_size={rows}); drop the rows that hold it")
    return rows


def token_cache_dir(cfg) -> str:
    """data.cache_dir, else `.token_cache` beside the run folder (shared by the runs there)."""
    if cfg.data.cache_dir:
        return cfg.data.cache_dir
    run_dir = str(cfg.run.dir or "runs/x")
    return os.path.join("runs" if paths.is_remote(run_dir) else os.path.dirname(os.path.abspath(run_dir)),
                        ".token_cache")


def prepare(cfg: config_lib.Config, devices: list, work: Workload | None = None, training: bool = True,
            flags=None) -> Job:
    """cfg's workload (built here unless given) on cfg's mesh over these devices, compiled, with every active
    strategy applied in turn. `training=False` (the plan) compiles only the train step and leaves checkpoints
    alone. `flags`: the compiler flags for the device (shard.plan.target.compiler_flags; None: the compiler's
    defaults)."""
    if cfg.mesh.preset == "auto":
        raise UserError("mesh=auto is resolved before a job is prepared (shard.plan.apply_auto, as train.py does)")
    work = work or workload(cfg, devices)
    if training:  # before compiling: every process runs the same job
        distributed.check_same_config(cfg, registry.with_defaults(work.model_cls, work.kwargs))
    mesh = mesh_lib.build_mesh(cfg.mesh, devices)
    rules = partition.merged_rules(cfg.mesh.rules, mesh.axis_names)
    work.objective.check(cfg, dict(mesh.shape))  # what is not a pair: registry.build checks the pairs
    active = strategies.build(cfg, dict(mesh.shape), rules, work)
    traced = {k: v for s in active for k, v in s.hooks().items()}
    with partition.activate(mesh, rules), hooks.use(cfg.train.remat, cfg.train.attention,
                                                     unroll=not cfg.train.scan_layers,
                                                     grouped_matmul=cfg.train.grouped_matmul,
                                                     expert_exchange=cfg.train.expert_exchange, **traced), \
            attn.configured(cfg.train.attention_precision, devices[0]):
        place = Placement(cfg, work, mesh, rules, state_lib.auto_min_size(cfg.mesh), active)
        shardings = state_lib.state_shardings(work.abstract, mesh, rules, place.auto_min)
        for s in active:
            shardings = s.shardings(shardings, place)  # ZeRO's split moments, offload's host memory
        place.device_shardings = state_lib.device_memory(shardings)
        place.split = split = state_lib.split_report(work.abstract.params, dict(mesh.shape), rules, place.auto_min)
        batch_shardings = state_lib.batch_shardings(work.batch, mesh, rules)
        eval_shardings = state_lib.batch_shardings(work.eval_batch, mesh, rules)
        abstract, init, one_target = work.abstract, work.init, ckpt_lib.abstract_target(work.abstract, shardings)
        # a strategy that reads checkpoints of another layout (replicas) checks them against one model's shapes
        one_target = one_target if any(s.other_layouts for s in active) else None
        for s in active:
            abstract, init, shardings = s.add_state(abstract, init, shardings, place)
        # Checkpoints to read must fit this model: checked before the (slower) compile.
        target = ckpt_lib.abstract_target(abstract, shardings)
        checkpoint_dir = paths.resolve(cfg.checkpoint.dir or paths.resolve(cfg.run.dir) / "checkpoints")
        if training:
            if cfg.checkpoint.enabled:
                ckpt_lib.check_resumable(checkpoint_dir, target, one_target)
            for key, path in (("checkpoint.restore_from", cfg.checkpoint.restore_from),
                              ("train.init_from", cfg.train.init_from)):
                if path and key == "train.init_from" and hf.is_folder(path):
                    hf_read.check(path, work.abstract.params, cfg.model.kwargs, work.abstract.rest)
                elif path:
                    ckpt_lib.check_path(path, key, target, one_target)
        elif (named := cfg.train.init_from) and not hf.is_folder(named) and not paths.is_remote(named):
            # a plan's model is the config's, but a mistyped folder would plan the default model without a word
            ckpt_lib.open_named(named, "train.init_from")
        options = {k: v for s in active for k, v in s.step_options(place).items()}
        reduction = gradients.Reduction(**{k: v for k, v in options.items() if k in REDUCTION_FIELDS})
        moved, order = options.get("device_shardings"), options.get("order")
        # train.quantize's products (traced on a batch's inputs: a model with none to quantize is refused)
        graphdef = quant_training.model_graph(cfg, work.graphdef, work.abstract, work.batch.get("inputs"))
        train_fn = step_lib.make_train_step(graphdef, work.tx, work.objective, work.dtype,
                                            badsteps.policy(cfg.train) == "skip", reduction, moved, order,
                                            work.schedule, options.get("trainable"), options.get("arrange"),
                                            options.get("reference"), options.get("differentiate"))
        # e.g. GRPO's rollouts before its updates, lm's packed rows weighed over the whole batch
        train_fn = work.objective.around(train_fn, work.graphdef, work.dtype, options.get("trainable"))
        eval_fn = step_lib.make_eval_step(graphdef, work.objective, work.dtype, moved, order,
                                          options.get("eval_reference"))
        for s in active:
            train_fn, eval_fn = s.wrap_train(train_fn), s.wrap_eval(eval_fn)
        compile_start = time.perf_counter()
        # tokamax's grouped products pick their kernel by the default device: the target's, where the step has them
        target_default = bool(work.grouped_flops) and \
            grouped.resolve(cfg.train.grouped_matmul, devices[0]) == "tokamax"
        train_step = step_lib.compile_step(train_fn, abstract, shardings, work.batch, batch_shardings, mesh,
                                           donate=True, returns_state=True, what="the train step", flags=flags,
                                           target_default=target_default)
        compile_s = time.perf_counter() - compile_start
        eval_step = None if not training else step_lib.compile_step(
            eval_fn, abstract, shardings, work.eval_batch, eval_shardings, mesh, donate=False, returns_state=False,
            what="the eval step", flags=flags, target_default=target_default)
        for s in active:
            s.compile(abstract, shardings)
        fill = None
        if training and any(type(s).fill is not Strategy.fill for s in active):
            def fill_all(state):
                for s in active:
                    state = s.fill(state)
                return state
            fill = jax.jit(fill_all, out_shardings=shardings)

    return Job(work, mesh, rules, shardings, batch_shardings, eval_shardings, target, checkpoint_dir, train_step,
               eval_step, compile_s, split, active, reduction, abstract, init, one_target, fill, flags)


REDUCTION_FIELDS = {f.name for f in dataclasses.fields(gradients.Reduction)}
