"""The data pipeline: every source, per-process shares, exact positions, eval coverage, quality bars."""

import numpy as np
import pytest

from conftest import ROOT
from shard import config
from shard.data import build
from shard.data import sources
from shard.errors import UserError


def data_cfg(*overrides):
    return config.load(None, list(overrides)).data


def test_processes_cover_every_example_exactly_once_per_epoch(monkeypatch):
    import jax

    cfg = data_cfg("data.name=tabular", "data.path=breast_cancer", "data.batch_size=24", "data.eval_fraction=0.2")
    n_train = len(sources.tabular("breast_cancer", "target", 0.2)[0])
    for n_proc in (1, 2, 3, 4):
        seen = []
        for proc in range(n_proc):
            monkeypatch.setattr(jax, "process_count", lambda: n_proc)
            monkeypatch.setattr(jax, "process_index", lambda: proc)
            data = build(cfg, seed=3)
            local = [data.train[s] for s in range(n_train // 24)]
            assert all(len(b["inputs"]) == 24 // n_proc for b in local)
            seen.append(np.concatenate([b["inputs"] for b in local]))
        rows = np.concatenate(seen)  # one epoch's worth of global batches, all processes together
        assert len(np.unique(rows, axis=0)) == len(rows) == (n_train // 24) * 24
        if n_proc == 1:
            reference = rows
        else:  # the same global batches, however they are split over processes
            assert set(map(bytes, rows)) == set(map(bytes, reference))


def test_batches_are_a_pure_function_of_seed_and_step():
    cfg = data_cfg("data.name=digits", "data.batch_size=32")
    a, b = build(cfg, seed=5), build(cfg, seed=5)
    np.testing.assert_array_equal(a.train[17]["inputs"], b.train[17]["inputs"])  # resume at step 17: same batch
    assert not np.array_equal(a.train[17]["inputs"], build(cfg, seed=6).train[17]["inputs"])


def test_eval_covers_every_example_once_with_a_mask():
    cfg = data_cfg("data.name=digits", "data.batch_size=64", "data.eval_fraction=0.2")
    data = build(cfg, seed=0)
    n_eval = len(sources.digits(0.2)[1])
    masks = np.concatenate([data.eval[i]["mask"] for i in range(len(data.eval))])
    assert masks.sum() == n_eval and len(masks) == len(data.eval) * 64


@pytest.mark.parametrize("name,task,shape", [
    ("digits", "classification", (8, 8, 1)),
    ("tabular", "regression", (10,)),
    ("text", "lm", (16,)),
    ("synthetic", "classification", (16,)),
])
def test_sources_and_their_tasks(name, task, shape):
    data = build(data_cfg(f"data.name={name}", "data.batch_size=8", "data.seq_len=16"), seed=0)
    batch = data.train[0]
    assert data.task == task and batch["inputs"].shape == (8, *shape)


def test_tabular_standardises_with_train_statistics_only():
    train, held, task = sources.tabular("diabetes", "target", 0.2)
    assert task == "regression"
    np.testing.assert_allclose(train.inputs.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(train.inputs.std(0), 1, atol=1e-3)
    assert np.abs(held.inputs.mean(0)).max() > 1e-3  # the held-out split was not used for the statistics


def test_csv_arrays_and_array_record(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 3))
    y = (x[:, 0] > 0).astype(int)
    csv = tmp_path / "t.csv"
    csv.write_text("a,b,label,c\n" + "\n".join(f"{r[0]},{r[1]},{l},{r[2]}" for r, l in zip(x, y)))
    train, held, task = sources.tabular(str(csv), "label", 0.2)
    assert task == "binary" and train.inputs.shape[1] == 3 and len(train) + len(held) == 50
    np.savez(tmp_path / "a.npz", inputs=rng.standard_normal((40, 4, 2)), targets=rng.integers(0, 5, 40))
    train, held, task = sources.arrays(str(tmp_path / "a.npz"), 0.25)
    assert task == "classification" and train[0]["inputs"].shape == (4, 2) and len(held) == 10
    sources.write_array_record(str(tmp_path / "d.array_record"), rng.standard_normal((30, 5)).astype(np.float32),
                               rng.standard_normal((30, 1)).astype(np.float32))
    train, held, task = sources.array_record(str(tmp_path / "*.array_record"), 0.2)
    assert task == "regression" and len(train) == 24 and train[0]["inputs"].shape == (5,)


def test_bad_data_inputs(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n1,2\n3,4\n")
    with pytest.raises(UserError, match="data.target='label' is not a column"):
        sources.tabular(str(csv), "label", 0.2)
    np.savez(tmp_path / "bad.npz", inputs=np.zeros((5, 2)), targets=np.zeros(4))
    with pytest.raises(UserError, match="first dimensions must match"):
        sources.arrays(str(tmp_path / "bad.npz"), 0.2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="matches no files"):
        sources.text_files(str(tmp_path / "empty"))
    with pytest.raises(UserError, match="does not exist"):
        sources.text_files(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="larger than the train split"):
        build(data_cfg("data.name=tabular", "data.path=diabetes", "data.batch_size=1000"), seed=0)


@pytest.mark.parametrize("name,metric,bar", [
    ("digits_mlp", "eval_accuracy", 0.95),
    ("tabular_binary", "eval_accuracy", 0.95),
    ("tabular_regression", "eval_r2", 0.4),
])
def test_configs_reach_their_quality_bars(tmp_path, name, metric, bar):
    from shard import trainer

    cfg = config.load(ROOT / "configs" / f"{name}.yaml", [f"run.dir={tmp_path}", "run.progress=false",
                                                           "checkpoint.enabled=false"])
    assert trainer.run(cfg).eval[metric] >= bar
