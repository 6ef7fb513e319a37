"""The loop's conversation with the device: what it waits for, and what an eval reads."""

import jax

SLOW = ["model.name=stock_models:SlowMLP", "model.work=10", "data.name=synthetic", "data.features=[16]",
        "data.classes=8", "data.batch_size=8", "run.cpu_devices=1"]


def test_a_log_point_fetches_only_finished_steps(train, monkeypatch):
    """Logging every step must not wait for the step just dispatched (the device would run dry while
    the host writes the record): a log point's record is written at the next one, from outputs that
    are ready. Only the end of the run (and checkpoints, evals) fetches the newest step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))  # stock_models
    real, ready = jax.device_get, []

    def spy(tree):
        ready.append(all(x.is_ready() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)))
        return real(tree)

    monkeypatch.setattr(jax, "device_get", spy)
    result = train(*SLOW, "train.steps=6", "run.log_every=1", "train.eval_batches=1")
    assert [r["step"] for r in result.history] == [1, 2, 3, 4, 5, 6]
    # the first record is written at once (the run shows it is alive); log points 2-5 look at finished steps only
    assert ready[1:5] == [True] * 4


def test_eval_batches_are_spread_evenly_over_the_split():
    from shard.run.evaluation import eval_selection

    assert list(eval_selection(range(10), 0)) == list(range(10))
    assert list(eval_selection(range(10), 20)) == list(range(10))
    assert list(eval_selection(range(10), 2)) == [2, 7]  # the middle of each half
    assert list(eval_selection(range(253), 4)) == [31, 94, 158, 221]
