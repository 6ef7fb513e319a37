"""Context (sequence) parallelism, the strategy: mesh.context > 1 splits each sequence along its length over the
`context` mesh axis (the logical name `length` maps to it), and attention runs over the split by all-gather or ring
(`train.context_strategy`). The attention itself and the load-balanced layout are the model-facing floor's
(shard/nn/ring.py): this module checks the split against the job and hands it to the hooks (`hooks()`).
"""

from shard.errors import UserError
from shard.nn.ring import AXIS, Split, balanced_order
from shard.strategies.base import Strategy


def settings(cfg, mesh_shape: dict, work) -> Split | None:
    """The context split cfg's mesh asks for (None without one), checked against the data and kernel."""
    n = mesh_shape[AXIS]
    if n == 1:
        return None
    if cfg.train.attention not in ("auto", "xla"):  # auto: the strategy's own attention
        raise UserError(f"train.attention={cfg.train.attention} with mesh.context={n}: the fused kernel takes whole "
                        "sequences, and the context strategies compute attention from their chunks with XLA's "
                        "matrix products; use train.attention=auto or xla")
    if work.kwargs.get("mtp_depth"):  # its targets lie k places on along the row, which the split reorders
        raise UserError(f"model.mtp_depth={work.kwargs['mtp_depth']} with mesh.context={n}: multi-token prediction "
                        "reads the tokens further along each row, which the context split lays out of order; use a "
                        "mesh without a context axis")
    order = None
    if work.data.task == "lm":  # causal: the load-balanced layout
        length = work.batch["inputs"].shape[1]
        if length % (2 * n):
            raise UserError(f"data.seq_len={length} does not cut into the 2 x {n} chunks that mesh.context={n} lays "
                            f"out (each device holds one early and one late chunk, for even causal work); use a "
                            f"multiple of {2 * n}")
        order = balanced_order(length, n)
    return Split(n, cfg.train.context_strategy, order)


# ----------------------------------------------------------------------------- the strategy

class Context(Strategy):
    """mesh.context > 1: each sequence split over the context devices; attention by all-gather or ring."""
    name = "context"
    keys = ("mesh.context", "train.context_strategy")
    switches = {"context": "`mesh.context` > 1", "ring": "`train.context_strategy=ring`"}
    refuses = {("ring", "bf16 reduction"): "the ring's shard_map cannot run per data shard, where a bfloat16 "
                                           "reduction sums; use train.context_strategy=all_gather or "
                                           "train.grad_dtype=float32"}

    def __init__(self, split: Split):
        self.split = split

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        split = settings(cfg, mesh_shape, work)
        return None if split is None else cls(split)

    @property
    def tags(self) -> tuple:
        return ("context", self.split.strategy)

    @property
    def label(self) -> str:
        return "train.context_strategy=ring" if self.split.strategy == "ring" else f"mesh.context={self.split.size}"

    def hooks(self) -> dict:
        return {"split": self.split}

    def step_options(self, place) -> dict:
        return {"order": self.split.order}

    def per_shard(self) -> str:
        return "train.context_strategy=ring cannot run per data shard" if self.split.strategy == "ring" else ""

    def plan(self, job, step_ops, n) -> dict:
        s = self.split
        return {"context": {"size": s.size, "strategy": s.strategy, "balanced": s.order is not None}}

    plan_keys = ("context",)

    @staticmethod
    def report(plan: dict) -> list:
        if not (ctx := plan.get("context")):
            return []
        how = {"all_gather": "each device gathers every layer's keys and values",
               "ring": "keys and values pass round the devices, one chunk per step"}[ctx["strategy"]]
        return [f"context: each sequence split over {ctx['size']} devices ({ctx['strategy']}: {how})"
                + ("; causal work balanced (chunks i and 2N-1-i on device i)" if ctx["balanced"] else "")]
