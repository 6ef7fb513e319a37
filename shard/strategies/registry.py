"""Every strategy, in the order the job applies them, and the rules for combining them.

A strategy added to the framework is one module in this folder plus one entry in ALL. The combination
rules are each strategy's `refuses` (data, not code): `build` checks them for a job, and `table` writes them
out for docs/meshes.md (tests/test_docs.py checks that the page shows this table).
"""

from shard.errors import UserError
from shard.strategies.accumulation import Accumulation
from shard.strategies.context import Context
from shard.strategies.ema import EMA
from shard.strategies.lora import LoRA
from shard.strategies.low_comm import LowCommunication
from shard.strategies.offload import Offload
from shard.strategies.pipeline import Pipeline
from shard.strategies.reference import Reference
from shard.strategies.reduction import Reduction
from shard.strategies.zero import Zero

# Their state is added and their steps wrapped in this order (the last wraps outermost): the replicas' vmap
# wraps the ordinary step, the weights' average wraps what the replicas would make of it. The adapters' step
# options come after the reduction's: their gradients are what it reduces. A DPO reference comes after the adapters: its eval
# view takes the weights before theirs merges the adapters in.
ALL = (Accumulation, Pipeline, Context, Zero, Offload, Reduction, LoRA, Reference, LowCommunication, EMA)


def build(cfg, mesh_shape: dict, rules: dict, work) -> tuple:
    """The strategies cfg switches on for this mesh and workload, each checked on its own and then against
    the others: a refused pair is one line naming both settings and why."""
    active = tuple(s for cls in ALL if (s := cls.build(cfg, mesh_shape, rules, work)) is not None)
    for a in active:
        for b in active:
            why = next((a.refuses[(mine, theirs)] for mine in a.tags for theirs in b.tags
                        if (mine, theirs) in a.refuses), None)
            if a is not b and why:
                raise UserError(f"{a.label} with {b.label}: {why}")
    return active


def table() -> str:
    """The combinations refused, as a Markdown table (every other pair of strategies combines): each row the
    settings that switch the two on, and why."""
    setting = {tag: text for cls in ALL for tag, text in cls.switches.items()}
    rows = ["| this | with | why it is refused |", "|---|---|---|"]
    for cls in ALL:
        for (mine, theirs), why in cls.refuses.items():
            rows.append(f"| {setting[mine]} | {setting[theirs]} | {why} |")
    return "\n".join(rows)
