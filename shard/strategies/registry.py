"""Every strategy, in the order the job applies them, and the rules for combining them.

A strategy added to the framework is one module in this folder plus one entry in ALL. The combination
rules are each strategy's and each objective's `refuses` (data, not code; an objective's in shard/objectives/):
`build` checks them for a job (`refusal`, one pair at a time), and `table` writes them out for docs/meshes.md
(tests/test_docs.py checks that the page shows this table).
"""

from shard import objectives
from shard.errors import UserError
from shard.strategies.accumulation import Accumulation
from shard.strategies.context import Context
from shard.strategies.ema import EMA
from shard.strategies.lora import LoRA
from shard.strategies.low_comm import LowCommunication
from shard.strategies.offload import Offload
from shard.strategies.pipeline_strategy import Pipeline
from shard.strategies.reference import Reference
from shard.strategies.reduction import Reduction
from shard.strategies.zero import Zero

# Their state is added and their steps wrapped in this order (the last wraps outermost): the replicas' vmap
# wraps the ordinary step, the weights' average wraps what the replicas would make of it. The adapters' step
# options come after the reduction's: their gradients are what it reduces. A DPO reference comes after the
# adapters: its eval view takes the weights before theirs merges the adapters in.
ALL = (Accumulation, Pipeline, Context, Zero, Offload, Reduction, LoRA, Reference, LowCommunication, EMA)


def build(cfg, mesh_shape: dict, rules: dict, work) -> tuple:
    """The strategies cfg switches on for this mesh and workload, each checked on its own and then against
    the others and the objective (`work.objective`, first): a refused pair is one line naming both settings
    and why."""
    active = tuple(s for cls in ALL if (s := cls.build(cfg, mesh_shape, rules, work)) is not None)
    parties = (work.objective, *active)
    for a in parties:
        for b in parties:
            if a is not b and (line := refusal(a, b)):
                raise UserError(line)
    return active


def refusal(a, b) -> str:
    """a's refusal of b in one line ("" where a takes b): the first of a's `refuses` whose pair of tags (a's, b's)
    both hold. `a` and `b`: strategies or the objective, anything with `tags`, `refuses` and `label`."""
    why = next((a.refuses[(mine, theirs)] for mine in a.tags for theirs in b.tags if (mine, theirs) in a.refuses),
               None)
    return f"{a.label} with {b.label}: {why}" if why else ""


def table() -> str:
    """The combinations refused, as a Markdown table (every other pair combines): each strategy's, then each
    objective's; each row the settings that switch the two on, and why."""
    kinds = (*ALL, *objectives.kinds())
    setting = {tag: text for cls in kinds for tag, text in cls.switches.items()}
    rows = ["| this | with | why it is refused |", "|---|---|---|"]
    for cls in kinds:
        for (mine, theirs), why in cls.refuses.items():
            rows.append(f"| {setting[mine]} | {setting[theirs]} | {why} |")
    return "\n".join(rows)
