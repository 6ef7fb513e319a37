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


def build_as(monkeypatch, cfg, seed: int, n_proc: int = 1, proc: int = 0):
    """The data as process `proc` of `n_proc` builds it."""
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: n_proc)
    monkeypatch.setattr(jax, "process_index", lambda: proc)
    return build(cfg, seed)


def per_example(source, indices) -> dict:
    return sources.stack([source[int(i)] for i in indices])


def all_sources(tmp_path) -> dict:
    rng = np.random.default_rng(0)
    sources.write_array_record(str(tmp_path / "d.array_record"), rng.standard_normal((40, 3, 2)).astype(np.float32),
                               rng.integers(0, 4, 40).astype(np.int32))
    return {
        "text": sources.text_splits(None, 16, 0.1)[0],
        "digits": sources.digits(0.2)[0],
        "tabular": sources.tabular("diabetes", "target", 0.2)[0],
        **{f"synthetic {task}": sources.Synthetic(50, (3, 2), task, 5, seed=1, split=0)
           for task in ("classification", "binary", "regression")},
        "array_record": sources.array_record(str(tmp_path / "d.array_record"), 0.2)[0],
    }


def test_batched_reads_are_the_per_example_reads_stacked(tmp_path):
    rng = np.random.default_rng(1)
    for name, source in all_sources(tmp_path).items():
        for size in (1, 7, 32):  # unsorted, with repeats, and the first and last examples
            indices = np.concatenate([[0, len(source) - 1], rng.integers(0, len(source), size)])
            batch, reference = source.read_batch(indices), per_example(source, indices)
            assert batch.keys() == reference.keys(), name
            for k in batch:
                assert batch[k].dtype == reference[k].dtype and batch[k].shape == reference[k].shape, (name, k)
                np.testing.assert_array_equal(batch[k], reference[k], err_msg=f"{name} {k}")


@pytest.mark.parametrize("name", ["digits", "text"])
def test_each_epoch_is_a_permutation_and_processes_read_their_own_rows(monkeypatch, tmp_path, name):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(np.random.default_rng(0).integers(0, 256, 60_000, np.uint8).tobytes())
    path = [f"data.path={corpus}"] if name == "text" else []
    cfg = data_cfg(f"data.name={name}", *path, "data.batch_size=240", "data.seq_len=16", "data.eval_fraction=0.2")
    whole = build_as(monkeypatch, cfg, seed=7)
    n = len(sources.digits(0.2)[0]) if name == "digits" else len(sources.text_splits(str(corpus), 16, 0.2)[0])
    steps = -(-2 * n // 240) + 1  # over two epochs, with a batch that crosses from one into the next
    rows = np.concatenate([whole.train[s]["inputs"] for s in range(steps)])
    rows = rows.reshape(len(rows), -1)
    first, second = rows[:n], rows[n:2 * n]
    assert len(np.unique(first, axis=0)) == len(np.unique(second, axis=0)) == len(np.unique(rows, axis=0))
    assert set(map(bytes, first)) == set(map(bytes, second)) and not np.array_equal(first, second)
    for n_proc in (2, 3, 4):  # process p reads rows [p*B/n, (p+1)*B/n) of every global batch, and only those
        local = 240 // n_proc
        for proc in range(n_proc):
            mine = build_as(monkeypatch, cfg, seed=7, n_proc=n_proc, proc=proc)
            for s in (0, steps - 1):
                for k, v in mine.train[s].items():
                    np.testing.assert_array_equal(v, whole.train[s][k][proc * local:(proc + 1) * local])


def test_array_record_keeps_grains_shuffle(monkeypatch, tmp_path):
    """Records are read in batches now, in the order of the pipeline they had before (Grain's shuffle)."""
    import grain

    rng = np.random.default_rng(0)
    path = tmp_path / "d.array_record"
    sources.write_array_record(str(path), rng.standard_normal((50, 3)).astype(np.float32),
                               rng.integers(0, 4, 50).astype(np.int64))
    cfg = data_cfg("data.name=array_record", f"data.path={path}", "data.batch_size=12", "data.eval_fraction=0.2")
    train_src = sources.array_record(str(path), 0.2)[0]
    cast = lambda ex: {"inputs": ex["inputs"], "targets": np.asarray(ex["targets"], np.int32)}
    for seed, n_proc in ((0, 1), (3, 2), (4, 3)):
        before = (grain.MapDataset.source(train_src).seed(seed).shuffle().map(cast).repeat()
                  .batch(12 // n_proc))
        for proc in range(n_proc):
            data = build_as(monkeypatch, cfg, seed, n_proc, proc)
            for s in range(9):  # over two epochs of 40 examples
                for k, v in data.train[s].items():
                    expected = before[s * n_proc + proc][k]
                    assert v.dtype == expected.dtype
                    np.testing.assert_array_equal(v, expected)


@pytest.mark.parametrize("name", ["digits", "tabular", "text"])
def test_eval_reads_every_example_once_in_order(monkeypatch, name):
    cfg = data_cfg(f"data.name={name}", "data.batch_size=48", "data.seq_len=16", "data.eval_fraction=0.2")
    eval_src = build_as(monkeypatch, cfg, seed=0).eval.source
    for n_proc in (1, 2, 3):
        real = []
        for proc in range(n_proc):
            batches = build_as(monkeypatch, cfg, seed=0, n_proc=n_proc, proc=proc).eval
            assert len(batches) == -(-len(eval_src) // 48)
            real.append([b["inputs"][b["mask"] == 1] for b in (batches[i] for i in range(len(batches)))])
        # global batch i is the processes' blocks one after another
        seen = np.concatenate([block for i in range(len(real[0])) for block in (real[p][i] for p in range(n_proc))])
        np.testing.assert_array_equal(seen, per_example(eval_src, range(len(eval_src)))["inputs"])


@pytest.mark.parametrize("overrides,inputs,targets", [
    (["data.name=text", "data.seq_len=16"], ((16,), np.int32), ((16,), np.int32)),
    (["data.name=digits"], ((8, 8, 1), np.float32), ((), np.int32)),
    (["data.name=digits", "data.task=regression"], ((8, 8, 1), np.float32), ((), np.float32)),
    (["data.name=tabular"], ((10,), np.float32), ((1,), np.float32)),
    (["data.name=synthetic", "data.task=binary", "data.features=[3,2]"], ((3, 2), np.float32), ((), np.float32)),
])
def test_batch_shapes_and_dtypes(overrides, inputs, targets):
    data = build(data_cfg(*overrides, "data.batch_size=8"), seed=0)
    for eval in (False, True):
        batch = {k: (v.shape, v.dtype) for k, v in data.abstract_batch(eval).items()}
        expected = {"inputs": ((8, *inputs[0]), inputs[1]), "targets": ((8, *targets[0]), targets[1])}
        assert batch == expected | ({"mask": ((8,), np.float32)} if eval else {})


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
    from shard.run import trainer

    cfg = config.load(ROOT / "configs" / f"{name}.yaml", [f"run.dir={tmp_path}", "run.progress=false",
                                                           "checkpoint.enabled=false"])
    assert trainer.run(cfg).eval[metric] >= bar
