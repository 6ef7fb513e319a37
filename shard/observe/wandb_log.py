"""`run.wandb=true`: the metrics records, the resolved config and the plan also go to Weights & Biases.

Offline (files under <run.dir>/wandb, `wandb sync` uploads them later) unless an API key is set
(WANDB_API_KEY, or `wandb login`'s ~/.netrc entry) or WANDB_MODE says otherwise, so a run without network
works. The W&B run's id is derived from the run folder, so a resumed or restarted run continues the same W&B
run; records carry our step as `step`, the x-axis of every chart, so steps trained again after a restart
are plotted where they belong. `wandb` is imported only when asked for; missing, it is one line (exit 2).
"""

import hashlib
import netrc
import os
import tempfile

from shard import paths
from shard.errors import UserError
from shard.observe.board import tag


def require():
    """The wandb module, or one line saying how to get it (before the run folder is touched)."""
    try:
        import wandb
    except ImportError:
        raise UserError("run.wandb=true needs the wandb package: pip install wandb (or set run.wandb=false)") from None
    return wandb


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbRun:
    """A metrics writer (write, close) over one W&B run (process 0 only)."""

    def __init__(self, run_dir, config: dict, plan: dict):
        wandb = require()
        local = tempfile.mkdtemp(prefix="shard-wandb-") if paths.is_remote(run_dir) else str(run_dir)
        mode = os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")
        run_id = hashlib.sha256(str(paths.resolve(run_dir)).encode()).hexdigest()[:16]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shard"), dir=local, id=run_id,
                              name=paths.resolve(run_dir).name, resume="allow", mode=mode, config=config,
                              settings=wandb.Settings(console="off", quiet=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run.summary.update({f"plan/{k}": v for k, v in plan.items()})

    def write(self, record: dict) -> None:
        values = {tag(k): v for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log({"step": record["step"], **values})

    def close(self) -> None:
        self.run.finish()


class Writers:
    """Several metrics writers as one (TensorBoard and W&B)."""

    def __init__(self, *writers):
        self.writers = [w for w in writers if w is not None]

    def write(self, record: dict) -> None:
        for w in self.writers:
            w.write(record)

    def close(self) -> None:
        for w in self.writers:
            w.close()
