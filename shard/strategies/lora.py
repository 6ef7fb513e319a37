"""Low-rank adapters (LoRA, `train.lora.rank=R`): the model's weights stay frozen and the step trains, for every
targeted weight W, a pair A (in, R) and B (R, out) with the model running on W + (alpha / R) * A @ B
(shard/strategies/adapters.py; targets `train.lora.targets`, e.g. [q, k, v, o, mlp]).

The state keeps the model's own weights in `params`, exactly as a run without adapters does, so checkpoints,
`train.init_from` (the usual start: a trained model) and every tool that reads a model's weights read them as
always; the adapters sit in `extra["lora"]` as `nnx.LoRAParam`s, and the optimizer state is theirs alone
(`tx.init(adapters)`). The step differentiates with respect to the adapters only (`trainable` below): the
weights enter the objective as constants, so they get no gradient, no optimizer moments and no update, and
stay bitwise as loaded. Eval, the sample, `load_model`, generation and export see the merged weights
(`model_view`, `read_model`); `python -m shard.export RUN --adapters-only` writes the adapters alone in PEFT's
layout (shard/use/peft.py).

`train.lora.base=nf4|int4|int8` (QLoRA) stores the frozen weights quantized (shard/quant/base.py): `params` holds
each matrix's codes in the weight's shape and logical names, `extra["lora_base"]` their scales, both checkpointed
once. `bfloat16` stores them in bfloat16. A fresh init, `train.init_from` (a checkpoint, or a Hugging Face folder
through `fill`) are quantized on loading. The step, eval and GRPO's rollouts hand the model each stacked weight as
a `deferred.Built` (codes, scales and adapters), dequantized and merged inside the stack one layer at a time, so
no float copy of the stack exists (shard/strategies/deferred.py); `model_view` (export, generation, the sample)
dequantizes and merges the whole model.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from shard.nn import partition
from shard.core import registry
from shard.core import state as state_lib
from shard.errors import UserError
from shard.quant import base as quant
from shard.run import checkpoint as ckpt_lib
from shard.nn.partition import logical_names, path_keys
from shard.strategies import adapters, deferred
from shard.strategies.base import Strategy, mb

KEY = "lora"
BASE = "lora_base"  # the quantized base's scales


def _without(extra: dict | None) -> dict | None:
    rest = {k: v for k, v in (extra or {}).items() if k not in (KEY, BASE)}
    return rest or None


def settings(cfg) -> tuple[int, float, tuple] | None:
    """(rank, alpha, targets) as cfg sets them, checked; None where the adapters are off."""
    lora = cfg.train.lora
    if lora.rank == 0:
        return None
    if lora.rank < 0:
        raise UserError(f"train.lora.rank={lora.rank}: the adapters' rank must be positive (0 turns them off)")
    alpha = 2.0 * lora.rank if lora.alpha is None else float(lora.alpha)
    if alpha <= 0:
        raise UserError(f"train.lora.alpha={lora.alpha:g}: must be positive (the adapters' scale is alpha / rank); "
                        "leave it out for 2 x rank")
    targets = tuple(str(t) for t in (lora.targets or ()))
    if not targets:
        raise UserError("train.lora.targets is empty; name the weights to adapt, e.g. [q, k, v, o]")
    return lora.rank, alpha, targets


def base_kind(cfg) -> str:
    """How the frozen base is stored: float32 (as a run without adapters), bfloat16, or quantized (quant.KINDS)."""
    return cfg.train.lora.base


class LoRA(Strategy):
    name = "lora"
    keys = ("train.lora.rank", "train.lora.alpha", "train.lora.targets", "train.lora.base")
    switches = {"lora": "`train.lora.rank` > 0", "qlora": "`train.lora.base` nf4, int4 or int8"}
    refuses = {
        ("qlora", "offload"): "the quantized base is dequantized in the step from device memory; "
                              "use train.offload=none",
        ("qlora", "sync"): "the replicas would average the quantized codes, not weights; use train.sync=allreduce",
        ("lora", "zero"): "ZeRO splits optimizer state the size of the weights; the adapters' is small: "
                          "use mesh.zero=0",
        ("lora", "offload"): "the adapters' optimizer state is small, keep it on the device: use train.offload=none",
        ("lora", "ema"): "train.ema averages the frozen weights, not the adapters; use train.ema=0",
        ("lora", "sync"): "the replicas' syncs move the weights, not the adapters; use train.sync=allreduce",
        ("lora", "replicas"): "the replicas keep a copy of the weights each, not of the adapters; use mesh.replica=1",
    }

    def __init__(self, rank: int, alpha: float, targets: tuple, site_list: tuple, seed: int, base: str = "float32"):
        self.rank, self.alpha, self.targets, self.sites, self.seed = rank, alpha, targets, site_list, seed
        self.scale = alpha / rank
        self.base = base
        self.device = None  # the adapters' shardings (the reduction's layout for their gradients)
        self.mesh_shape, self.rules = {}, {}  # where the base's scales are laid out

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        got = settings(cfg)
        if got is None:
            return None
        if mesh_shape.get("stage", 1) > 1 and cfg.pipeline.repeats > 1:
            raise UserError(f"train.lora.rank={got[0]} with pipeline.repeats={cfg.pipeline.repeats}: the circular "
                            "schedule's layer order is not kept for the adapters; use pipeline.repeats=1 (GPipe)")
        site_list = adapters.sites(work.model_cls, work.abstract.params, got[2], cfg.model.name)
        return (cls if base_kind(cfg) == "float32" else StoredBase)(*got, site_list, cfg.train.seed, base_kind(cfg))

    @property
    def label(self) -> str:
        return f"train.lora.rank={self.rank}" + (f" with train.lora.base={self.base}" if self.quantized else "")

    @property
    def tags(self) -> tuple:
        return ("qlora", "lora") if self.quantized else ("lora",)

    @property
    def quantized(self) -> bool:
        return self.base in quant.KINDS

    # ---- the state
    def fresh(self) -> dict:
        return adapters.create(self.sites, self.rank, self.seed)

    def add_state(self, abstract, init, shardings, place):
        tx = place.work.tx
        self.mesh_shape, self.rules = dict(place.mesh.shape), place.rules

        def build():
            state, ad = init(), self.fresh()
            return self.stored(state.replace(opt_state=tx.init(ad), extra={**(state.extra or {}), KEY: ad}))

        new = jax.eval_shape(build)
        laid = state_lib.state_shardings(new.replace(params=None, rest=None), place.mesh, place.rules, place.auto_min)
        self.device = laid.extra[KEY]
        extra = {**(shardings.extra or {}), KEY: self.device}
        if self.quantized:
            extra[BASE] = laid.extra[BASE]
        return new, build, shardings.replace(opt_state=laid.opt_state, extra=extra)

    def stored(self, state):
        """A state with the model's float32 weights, its base stored as train.lora.base says."""
        if self.base == "float32":
            return state
        codes, scales = quant.quantize(state.params, self.base, self.mesh_shape, self.rules)
        extra = {**(state.extra or {}), **({BASE: scales} if self.quantized else {})}
        return state.replace(params=codes, extra=extra)

    def base_weights(self, state):
        """The frozen weights the base stands for (float32)."""
        if self.base == "float32":
            return state.params
        return quant.dequantize(state.params, (state.extra or {}).get(BASE, {}), self.base)

    def take(self, job, folder, step: int, resume: bool):
        """A whole-state restore needs the adapters and their optimizer state; a checkpoint of a run without
        them is refused in one line (its weights are what train.init_from reads)."""
        if not resume and self.base != "float32":  # a model's float32 weights, stored as the base is
            return self._init_from(job, folder, step)
        if resume:
            manager = ckpt_lib.tree_manager(folder)
            try:
                saved = manager.item_metadata(step)["optimizer"].tree.get("extra") or {}
            finally:
                manager.close()
            if KEY not in saved:
                raise UserError(f"checkpoint {folder}/{step} holds no adapters (its run trained without "
                                f"train.lora), so {self.label} cannot resume it; start from its weights with "
                                f"train.init_from={folder}, in a new run.dir")
        return None

    def _init_from(self, job, folder, step: int):
        weights = ckpt_lib.abstract_target(job.work.abstract.params, job.shardings.params)
        got = ckpt_lib.read_parts(folder, step, {"model": {"params": weights, "rest": job.target.rest}})
        fresh = state_lib.init_state(job.init, job.shardings)
        return job.filled(fresh.replace(params=got["model"]["params"], rest=got["model"]["rest"]), always=True), \
            dict(got["meta"])

    # ---- what the step trains (shard/core/step.py's `trainable`)
    def get(self, state):
        return state.extra[KEY]

    def put(self, state, trained):
        return state.replace(extra={**state.extra, KEY: trained})

    def merged(self, state, trained):
        """The model's parameters, every adapted weight merged with its adapters (float32); trained None: the
        weights alone, as stored (a float32 base's; a stored base's reference is StoredBase.weights')."""
        if trained is None:
            return state.params
        return adapters.merged(jax.lax.stop_gradient(self.base_weights(state)), trained, self.sites, self.scale)

    weights = merged  # what the step runs the model on

    def trained(self, abstract):
        return abstract.extra[KEY]

    def gradient_shardings(self, job):
        return self.device

    def step_options(self, place) -> dict:
        # after the reduction's: the gradients it reduces are the adapters', laid out like them
        return {"trainable": self, "param_shardings": self.device}

    # ---- the model it stands for
    def model_view(self, state):
        return state.replace(params=self.merged(state, state.extra[KEY]), extra=_without(state.extra))

    def wrap_eval(self, eval_fn):
        return lambda state, batch: eval_fn(self.model_view(state), batch)

    @classmethod
    def adapters_target(cls, cfg, model_cls, params, mesh) -> tuple:
        """(sites, scale, the adapters' abstract target) of a LoRA run of this model (`params`: its abstract
        parameters), laid out on `mesh` by the run's rules (split like the weights they adapt)."""
        rank, alpha, targets = settings(cfg)
        site_list = adapters.sites(model_cls, params, targets, cfg.model.name)
        abstract = jax.eval_shape(lambda: adapters.create(site_list, rank, 0))
        rules = partition.merged_rules(cfg.mesh.rules, mesh.axis_names)
        laid = state_lib.state_shardings(abstract, mesh, rules, state_lib.auto_min_size(cfg.mesh))
        return site_list, alpha / rank, ckpt_lib.abstract_target(abstract, laid)

    @classmethod
    def read_model(cls, cfg, folder, step: int, target):
        if settings(cfg) is None:
            return None
        model_cls = registry.resolve(cfg.model.name)  # load_model resolved it first, with its trust check
        mesh = jax.tree.leaves(target.params)[0].sharding.mesh
        site_list, scale, held = cls.adapters_target(cfg, model_cls, target.params, mesh)
        kind = base_kind(cfg)
        rules = partition.merged_rules(cfg.mesh.rules, mesh.axis_names)
        codes, scales = jax.eval_shape(lambda p: quant.quantize(p, kind, dict(mesh.shape), rules), target.params)
        auto = state_lib.auto_min_size(cfg.mesh)
        stored = ckpt_lib.abstract_target(codes, state_lib.state_shardings(codes, mesh, rules, auto))
        laid = state_lib.state_shardings(scales, mesh, rules, auto)
        extra = {KEY: held, **({BASE: ckpt_lib.abstract_target(scales, laid)} if kind in quant.KINDS else {})}
        got = ckpt_lib.read_parts(folder, step, {"model": {"params": stored, "rest": target.rest},
                                                 "optimizer": {"extra": extra}})
        saved = got["optimizer"]["extra"]

        def merged(codes, scales, pairs):
            return adapters.merged(quant.dequantize(codes, scales, kind), pairs, site_list, scale)

        params = jax.jit(merged, out_shardings=jax.tree.map(lambda t: t.sharding, target.params))(
            got["model"]["params"], saved.get(BASE, {}), saved[KEY])
        return target.replace(params=params, rest=got["model"]["rest"]), dict(got["meta"])

    # ---- the plan
    def plan(self, job, step_ops, n) -> dict:
        held = ckpt_lib.abstract_target(job.abstract.extra[KEY], self.device)
        frozen = state_lib.count_params(job.work.abstract.params)  # the model's own (4-bit codes are packed)
        base = ckpt_lib.abstract_target(
            {"codes": job.abstract.params, "scales": (job.abstract.extra or {}).get(BASE)},
            {"codes": job.shardings.params, "scales": (job.shardings.extra or {}).get(BASE)})
        as_float32 = ckpt_lib.abstract_target(job.work.abstract.params, job.shardings.params)
        return {"lora": {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                         "weights_adapted": len(self.sites), "trainable_params": adapters.count(held),
                         "frozen_params": frozen, "adapter_bytes_per_device": state_lib.shard_bytes(held),
                         "base": self.base, "base_bytes_per_device": quant.stored_bytes(base),
                         "base_float32_bytes_per_device": quant.stored_bytes(as_float32)}}

    plan_keys = ("lora",)

    @staticmethod
    def report(plan: dict) -> list:
        if not (lora := plan.get("lora")):
            return []
        share = lora["trainable_params"] / max(lora["frozen_params"], 1)
        return [f"lora: rank {lora['rank']}, alpha {lora['alpha']:g} on {', '.join(lora['targets'])} "
                f"({lora['weights_adapted']} weights): {lora['trainable_params']:,} trainable adapter parameters "
                f"({share:.2%} of the {lora['frozen_params']:,} frozen ones), "
                f"{mb(lora['adapter_bytes_per_device'])} per device; the optimizer state is the adapters' alone"] + \
            ([f"lora base: the frozen weights stored {lora['base']} (scales included), "
              f"{mb(lora['base_bytes_per_device'])} per device against {mb(lora['base_float32_bytes_per_device'])} "
              f"in float32 ({lora['base_bytes_per_device'] / max(lora['base_float32_bytes_per_device'], 1):.3f}x)"]
             if lora.get("base", "float32") != "float32" else [])


class StoredBase(LoRA):
    """LoRA on a base stored otherwise than float32: weights loaded in float32 (train.init_from) are stored as the
    base is by the job's `fill` (a plain LoRA job compiles no fill); a checkpoint of the model's own float weights is
    read by `take` (train.init_from)."""
    other_layouts = True

    def weights(self, state, trained):
        """The model's parameters: each adapted or quantized weight of a stack a `deferred.Built`, which the stack
        builds a layer at a time; the others dequantized (cast) and merged here, as LoRA merges them. trained None:
        the base alone (a preference objective's reference)."""
        scales = (state.extra or {}).get(BASE, {})
        by_path: dict = {}
        for s in self.sites if trained is not None else ():
            by_path.setdefault(s.path, []).append(s)
        frozen = jax.lax.stop_gradient

        def one(path, var):
            if not isinstance(var, nnx.Variable):
                return var
            here, held, value = by_path.get(path_keys(path), []), quant.scale_of(scales, path), var[...]
            if held is None and not here:  # stored as it is (bfloat16, a vector): the step's cast is enough,
                full = var.get_metadata().get("full_precision")  # but for a weight it leaves in float32 (a router)
                return var.replace(value.astype(jnp.float32)) if full and jnp.issubdtype(value.dtype, jnp.floating) \
                    else var
            scale = None if held is None else frozen(held[...])
            ab = adapters.pairs(trained, here)
            names = logical_names(var)
            if deferred.stacked(names) and (here or held is not None):
                pair_names = tuple((logical_names(p["lora_a"])[1:], logical_names(p["lora_b"])[1:])
                                   for p in (adapters.pair(trained, s) for s in here))
                layout = (names[1:], None if held is None else logical_names(held)[1:], pair_names)
                return var.replace(deferred.Built(frozen(value), scale, ab, self.base, tuple(here), self.scale,
                                                  layout))
            return var.replace(adapters.adapted(quant.dequantize_value(frozen(value), scale, self.base), ab, here,
                                                self.scale))

        return jax.tree_util.tree_map_with_path(one, state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def wrap_eval(self, eval_fn):  # the weights built in the stack, as in the step
        return lambda state, batch: eval_fn(state.replace(params=self.weights(state, state.extra[KEY]),
                                                          extra=_without(state.extra)), batch)

    def fill(self, state):
        raw = any(v.get_value().dtype == jnp.float32 and quant.quantizes(v) for v in jax.tree.leaves(
            state.params, is_leaf=lambda x: isinstance(x, nnx.Variable)) if isinstance(v, nnx.Variable))
        return self.stored(state) if raw else state
