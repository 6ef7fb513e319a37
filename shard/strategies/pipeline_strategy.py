"""The pipeline strategy (`mesh.stage` > 1): `pipeline.*` read and checked against the model and the batch,
and the schedule it asks for: GPipe or circular (shard/strategies/pipeline.py), 1F1B or interleaved 1F1B
(shard/strategies/pipeline_1f1b.py)."""

import functools
import math

from shard.errors import UserError
from shard.nn import partition
from shard.strategies.base import Strategy, mb
from shard.strategies.pipeline import Schedule, arrange, bubble, layout, stacked_variables, to_layers, to_schedule
from shard.strategies.pipeline_1f1b import OneFOneB


def settings(cfg, mesh_shape: dict, rules: dict, work) -> Schedule | OneFOneB | None:
    """The pipeline cfg asks for on this mesh (None without a `stage` axis), checked against the model
    and the batch: one line naming what is wrong and what is allowed."""
    stages = mesh_shape["stage"]
    if stages == 1:
        return None
    repeats = cfg.pipeline.repeats
    micro = cfg.pipeline.microbatches or 2 * stages
    where = f"mesh.stage={stages}"
    if work.kwargs.get("mtp_depth"):
        raise UserError(f"{where} with model.mtp_depth={work.kwargs['mtp_depth']}: the multi-token-prediction modules "
                        "run after the stack, on the last hidden state no stage holds whole; use a mesh without a "
                        "stage axis")
    if not work.stacks:
        raise UserError(f"{where}: model {cfg.model.name!r} with these options runs no stacked layers through "
                        "shard.nn.hooks.stack, so there is nothing to cut into stages; use a mesh without a stage axis "
                        "(gpt, moe, vit and lstm stack theirs, but a GPT whose layers differ, as Gemma 4's, runs them "
                        "one by one)")
    for n in work.stacks:
        if n % (stages * repeats):
            raise UserError(f"{where} x pipeline.repeats={repeats}: the model's {n} stacked layers do not divide into "
                            f"{stages * repeats} groups; use a stage count and repeats whose product divides {n}")
    if repeats > 1 and micro < stages:
        raise UserError(f"pipeline.microbatches={micro} with pipeline.repeats={repeats}: a circular schedule needs "
                        f"at least as many microbatches as stages ({stages})")
    if micro % stages:
        raise UserError(f"pipeline.microbatches={micro} with {where}: each stage holds whole microbatches of the "
                        f"batch's rows, as many on every stage; use a multiple of {stages}")
    across = math.prod(mesh_shape[a] for a in partition.batch_axes(rules, mesh_shape) if a != "stage")
    # The train step hands the pipeline one accumulation microbatch at a time (train.grad_accum).
    sizes = (("data.batch_size", work.data.batch_size, cfg.train.grad_accum),
             ("the eval batch", work.data.batch_size, 1))
    for name, size, accum in sizes:
        seen = size // accum
        if seen % micro or (seen // micro) % across:
            per = f" / train.grad_accum={accum}" if accum > 1 else ""
            raise UserError(f"{name}={size}{per} does not cut into pipeline.microbatches={micro} microbatches whose "
                            f"size the batch's {across} shards beside the stages divide; use a batch size that is a "
                            f"multiple of {micro * across * accum}, or other microbatches")
    if cfg.pipeline.schedule == "1f1b":
        if len(work.stacks) != 1:
            raise UserError(f"pipeline.schedule=1f1b with {where}: the model runs {len(work.stacks)} stacks of layers "
                            "through shard.nn.hooks.stack, and 1F1B pipelines one; use pipeline.schedule=gpipe")
        return OneFOneB(stages, repeats, micro, stacked_variables(work.graphdef, work.abstract, work.batch["inputs"]))
    return Schedule(stages, repeats, micro)


class Pipeline(Strategy):
    """mesh.stage > 1: the stacked layers run as a pipeline (GPipe, or circular with pipeline.repeats > 1; 1F1B or
    interleaved 1F1B under pipeline.schedule=1f1b)."""
    name = "pipeline"
    keys = ("mesh.stage", "pipeline.microbatches", "pipeline.repeats", "pipeline.schedule")
    switches = {"pipeline": "`mesh.stage` > 1"}
    refuses = {("pipeline", "ring"): "JAX cannot batch the ring's shard_map over the stages; use "
                                     "train.context_strategy=all_gather"}

    def __init__(self, schedule: Schedule | OneFOneB, layout_, stacks: tuple):
        self.schedule, self.layout, self.stacks = schedule, layout_, stacks

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        schedule = settings(cfg, mesh_shape, rules, work)
        if schedule is None:
            return None
        stacked = schedule.stacked if isinstance(schedule, OneFOneB) else () if schedule.repeats == 1 else \
            stacked_variables(work.graphdef, work.abstract, work.batch["inputs"])
        return cls(schedule, layout(schedule, stacked), work.stacks)

    @property
    def label(self) -> str:
        return f"mesh.stage={self.schedule.stages}"

    def hooks(self) -> dict:
        return {"pipeline": self.schedule}

    def step_options(self, job) -> dict:
        p = self.schedule
        if isinstance(p, OneFOneB):  # it owns the step's loss and gradient (and arranges the rows itself)
            return {"differentiate": p.value_and_grad}
        return {"arrange": functools.partial(arrange, micro=p.microbatches, stages=p.stages)}

    def reduce_once(self) -> str:
        return "the pipeline reduces each layer group's gradient at every microbatch it passes"

    def to_running(self, state):
        return to_schedule(self.layout, state)

    def to_stored(self, state):
        return to_layers(self.layout, state)

    def idle_share(self) -> float:
        p = self.schedule
        return bubble(p.stages, p.repeats, p.microbatches)

    def plan(self, job, step_ops, n) -> dict:
        p = self.schedule
        out = {"schedule": "1f1b" if isinstance(p, OneFOneB) else "gpipe", "stages": p.stages, "repeats": p.repeats,
               "microbatches": p.microbatches, "layers_per_stage": [k // p.stages for k in self.stacks],
               "bubble": self.idle_share()}
        if isinstance(p, OneFOneB) and p.held:  # what tracing the step found: a slot is one microbatch's input
            out["held"] = {"slots": p.held["slots"], "slot_bytes": p.held["slot_bytes"],
                                  "gpipe_iterations": p.repeats * p.microbatches + p.stages - 1}
        return {"pipeline": out}

    plan_keys = ("pipeline",)

    @staticmethod
    def report(plan: dict) -> list:
        if not (pipe := plan.get("pipeline")):
            return []
        kind = {("gpipe", True): "GPipe", ("gpipe", False): "circular", ("1f1b", True): "1F1B",
                ("1f1b", False): "interleaved 1F1B"}[pipe.get("schedule", "gpipe"), pipe["repeats"] == 1]
        lines = [f"pipeline: {pipe['stages']} stages x {pipe['repeats']} repeat(s) ({kind}), {pipe['microbatches']} "
                 f"microbatches, {'/'.join(map(str, pipe['layers_per_stage']))} layers per stage; bubble "
                 f"(S-1)/(R*M+S-1) = {pipe['bubble']:.1%} of the step"]
        if held := pipe.get("held"):
            lines.append(f"pipeline: a stage keeps its activations (as train.remat says) for at most {held['slots']} "
                         f"microbatch visits at once, {mb(held['slot_bytes'])} each: "
                         f"{mb(held['slots'] * held['slot_bytes'])} (GPipe: {held['gpipe_iterations']} iterations)")
        return lines
