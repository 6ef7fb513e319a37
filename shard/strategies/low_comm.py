"""Low-communication training as a strategy: replicas over `mesh.replica` that meet every H steps (local SGD,
DiLoCo, streaming DiLoCo). The arithmetic of the state and the sync programs is in shard/strategies/sync.py,
reading checkpoints of another replica layout in shard/strategies/sync_io.py; this module says when each runs.
With `train.sync=allreduce` the replica axis is one more data axis: the strategy then only reports, in the
plan, what crosses between replicas."""

import jax

from shard.plan import hlo  # the plan's reader of compiled programs
from shard.run import distributed
from shard.strategies import sync as sync_lib
from shard.strategies import sync_io
from shard.strategies.base import Strategy, mb

VMAP = ("each replica's step runs under a vmap, which {} cannot run in; leave it at its default or use "
        "train.sync=allreduce")


class LowCommunication(Strategy):
    name = "sync"
    keys = ("mesh.replica", "train.sync", "train.sync_every", "train.sync_fragments", "train.outer_lr",
            "train.outer_momentum")
    switches = {"sync": "`train.sync=local_sgd` or `diloco`", "replicas": "`mesh.replica` > 1"}
    refuses = {("sync", "pipeline"): VMAP.format("mesh.stage"),
               ("sync", "accumulation"): VMAP.format("train.grad_accum"),
               ("sync", "bf16 reduction"): VMAP.format("train.grad_dtype"),
               ("sync", "zero"): VMAP.format("mesh.zero"),
               ("sync", "offload"): VMAP.format("train.offload"),
               ("sync", "ring"): VMAP.format("train.context_strategy=ring")}

    def __init__(self, sync: sync_lib.Sync | None, replicas: int):
        self.sync, self.replicas = sync, replicas  # sync None: train.sync=allreduce over replicas > 1
        self.programs: tuple = ()
        self._sync_bytes: dict = {}  # per device count: each sync program's bytes (_per_sync)
        self.other_layouts = sync is not None  # a plain checkpoint, or another replica count, seeds every replica

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        sync = sync_lib.settings(cfg, mesh_shape, work.abstract.params)
        replicas = mesh_shape[sync_lib.AXIS]
        return cls(sync, replicas) if sync or replicas > 1 else None

    @property
    def tags(self) -> tuple:
        return ("sync", self.sync.mode) if self.sync else ("replicas",)

    @property
    def label(self) -> str:
        return f"train.sync={self.sync.mode}" if self.sync else f"mesh.replica={self.replicas}"

    def add_state(self, abstract, init, shardings, place):
        if not self.sync:
            return abstract, init, shardings
        return (sync_lib.abstract_state(self.sync, abstract), sync_lib.init(self.sync, init),
                sync_lib.shardings(self.sync, shardings, place.mesh))

    def wrap_train(self, train_fn):
        return sync_lib.local_step(train_fn, self.sync) if self.sync else train_fn

    def wrap_eval(self, eval_fn):  # eval sees the replicas' global view
        return (lambda state, batch: eval_fn(sync_lib.global_view(state), batch)) if self.sync else eval_fn

    def compile(self, abstract, shardings) -> None:
        if self.sync:
            self.programs = tuple(
                jax.jit(sync_lib.sync_program(self.sync, f), in_shardings=(shardings,), out_shardings=shardings,
                        donate_argnums=0).lower(abstract).compile() for f in range(len(self.sync.fragments)))

    def after_step(self, state, done: int):
        for fragment in self.sync.due(done) if self.sync else ():  # the replicas meet
            state = distributed.finished(self.programs[fragment](state))
        return state

    def model_view(self, state):
        return sync_lib.global_view(state) if self.sync else state

    def take(self, job, folder, step: int, resume: bool):
        if not self.sync:
            return None
        return sync_io.take(self.sync, folder, step, job.init, job.shardings, job.target, job.one_target, resume)

    @classmethod
    def read_model(cls, cfg, folder, step: int, target):
        if cfg.train.sync in sync_lib.LOCAL:  # every replica was saved: the run's global view (DiLoCo's anchor)
            return sync_io.read_global(folder, step, target)
        return None

    def _per_sync(self, n: int) -> list:
        """Bytes each fragment's sync sends per device, read once from its compiled program (the plan asks twice)."""
        if n not in self._sync_bytes:
            self._sync_bytes[n] = [hlo.summary(hlo.collectives(p.as_text(), n))[1] for p in self.programs]
        return self._sync_bytes[n]

    def wire_bytes(self, job, n: int) -> float:
        return sum(self._per_sync(n)) / self.sync.every if self.sync else 0.0

    def plan(self, job, step_ops, n) -> dict:
        """What crosses between replicas, per device. allreduce: the step's collectives over groups of at least R
        devices, a multiple of R (the gradient reduction spans every replica); local_sgd and diloco: the sync
        programs' collectives (all of them reduce over `replica`), each fragment's once every H steps, so per
        step their sum / H; the peak is the largest single sync."""
        r = self.replicas
        if not self.sync:
            per_step = hlo.summary([op for op in step_ops if op.group >= r and op.group % r == 0])[1]
            return {"sync": {"mode": "allreduce", "replicas": r, "every": 1, "fragments": 1,
                             "bytes_per_sync_peak": per_step, "cross_replica_bytes_per_step": per_step}}
        per_sync, s = self._per_sync(n), self.sync
        return {"sync": {"mode": s.mode, "replicas": r, "every": s.every, "fragments": len(s.fragments),
                         "bytes_per_sync_peak": max(per_sync), "cross_replica_bytes_per_step": sum(per_sync) / s.every}}

    plan_keys = ("sync",)

    @staticmethod
    def report(plan: dict) -> list:
        if not (sync := plan.get("sync")):
            return []
        when = "every step" if sync["mode"] == "allreduce" else (
            f"every {sync['every']} steps"
            + (f", {sync['fragments']} fragments staggered" if sync["fragments"] > 1 else ""))
        return [f"replicas: {sync['replicas']} ({sync['mode']}, {when}); across replicas each device sends "
                f"{mb(sync['cross_replica_bytes_per_step'])} per step, {mb(sync['bytes_per_sync_peak'])} at a sync"]
