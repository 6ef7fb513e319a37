"""`train.nonfinite`: what a step whose loss or gradients are not finite does to the run.

  stop      the run ends with one line naming the step (exit 1); no checkpoint of that state is written
  skip      the update is dropped inside the step (parameters and optimizer state kept), the batch consumed
  rollback  the newest checkpoint is restored and the batches from it to the bad step (the bad one included)
            are skipped: the run goes on from the checkpoint with the data after them. More than
            `train.max_rollbacks` rollbacks in a row (no new checkpoint between them) stop the run.

The batches a rollback skips shift the data: step k then reads batch k - 1 + offset (0-based). The offset is
saved in every checkpoint's meta, so a resumed or restarted run reads what the rolled-back one would.
`train.skip_nonfinite=true` is the older spelling of `train.nonfinite=skip`.
"""

from shard.errors import NonFiniteLoss, UserError

POLICIES = ("stop", "skip", "rollback")


def policy(train) -> str:
    """The policy a train config asks for (train.nonfinite, or skip via the older train.skip_nonfinite)."""
    if train.skip_nonfinite and train.nonfinite not in (None, "skip"):
        raise UserError(f"train.skip_nonfinite=true and train.nonfinite={train.nonfinite} disagree; "
                        "give only train.nonfinite (stop, skip or rollback)")
    return "skip" if train.skip_nonfinite else (train.nonfinite or "stop")


def check(cfg) -> None:
    """Bad input, before anything runs: a rollback needs checkpoints to go back to."""
    if policy(cfg.train) == "rollback" and not cfg.checkpoint.enabled:
        raise UserError("train.nonfinite=rollback restores the last checkpoint, but checkpoint.enabled=false; "
                        "turn checkpoints on or choose train.nonfinite=stop or skip")


class Rollback(Exception):
    """Raised by the loop at a non-finite step under train.nonfinite=rollback."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        super().__init__(f"loss is {loss} (gradient norm {grad_norm}) at step {step}")
        self.step = step


class Rollbacks:
    """The data offset, and how many rollbacks in a row went back to the same checkpoint."""

    def __init__(self, max_in_a_row: int, offset: int = 0):
        self.max_in_a_row, self.offset = max_in_a_row, offset
        self.to_step, self.in_a_row = None, 0

    def plan(self, bad: Rollback, to_step: int | None) -> dict:
        """After a bad step: where the run goes back to and which batches it skips, as a metrics record
        (`to_step` None: no checkpoint yet, so the run starts over from step 0). Too many in a row stop it."""
        back = to_step or 0
        self.in_a_row = self.in_a_row + 1 if back == self.to_step else 1
        self.to_step = back
        if self.in_a_row > self.max_in_a_row:
            raise NonFiniteLoss(f"{bad}; stopped after {self.max_in_a_row} rollbacks in a row to step {back} "
                                "(train.max_rollbacks): lower optimizer.lr or check the data")
        first, last = back + self.offset, bad.step - 1 + self.offset  # 0-based positions in the data order
        self.offset += bad.step - back
        return {"step": back, "rolled_back_from": bad.step, "skipped_batches_first": first,
                "skipped_batches_last": last, "data_offset": self.offset}

    def saved(self) -> None:
        """A new checkpoint: rollbacks from here on count afresh."""
        self.in_a_row = 0
