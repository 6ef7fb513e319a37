"""One training run: the prepared job, the loop, checkpoints, many processes, stopping, the launcher."""
