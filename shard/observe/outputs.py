"""What a run writes about itself: metrics.jsonl as it goes (TensorBoard's event files and W&B beside it), and
curves.png when it ends.
"""

from shard import paths
from shard.core import state as state_lib
from shard.errors import UserError, warn
from shard.observe import plot, wandb_log
from shard.observe.board import Board
from shard.observe.metrics import MetricsLog


def metrics_log(cfg, run_dir, start_step: int, work, main: bool, plan: dict | None = None) -> MetricsLog:
    """metrics.jsonl, TensorBoard's event files unless run.tensorboard=false, and W&B under run.wandb=true
    (process 0 only)."""
    board = wandb = None
    if main and cfg.run.tensorboard:
        board = Board(paths.resolve(run_dir) / "tensorboard", start_step)
        board.describe(start_step, work.resolved, cfg.model.name, state_lib.count_params(work.abstract.params))
    if main and cfg.run.wandb:
        wandb = wandb_log.WandbRun(run_dir, paths.yaml_load(work.resolved), plan or {})
    log = MetricsLog(run_dir, wandb_log.Writers(board, wandb) if wandb else board)
    log.keep_until(start_step)  # after a restart, the steps past the checkpoint are logged again, once
    return log


def draw_curves(run_dir) -> None:
    """<run.dir>/curves.png for the finished run. A picture that cannot be drawn costs a warning, not the run."""
    try:
        plot.curves_png(run_dir)
    except (OSError, UserError, ValueError) as e:
        warn(f"curves.png was not drawn: {e}")
