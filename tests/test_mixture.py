"""data.mixture: rows drawn in proportion to the weights, the same batches for the same seed, processes
reading disjoint rows that make up the global batch, a bitwise resume, per-source eval metrics, and the
one-line refusals. Offline: two corpora of distinguishable bytes in tmp_path, the bytes tokenizer."""

import json
import shutil

import numpy as np
import pytest

from conftest import run_cli
from shard import config
from shard.data import mixture
from test_data import build_as

GPT = ["model.name=gpt", "model.d_model=32", "model.n_layers=2", "model.n_heads=8", "model.d_ff=64",
       "model.max_len=32", "data.name=documents", "data.seq_len=32", "data.batch_size=16"]


@pytest.fixture
def corpora(tmp_path):
    """Source `a` (a folder) holds only the letter a, source `b` (one file) only b: a row's letters say its source."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "docs.jsonl").write_text("".join(json.dumps({"text": "a" * (200 + i)}) + "\n" for i in range(40)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": "b" * (300 + i)}) + "\n" for i in range(30)))
    return f"data.mixture={{{tmp_path / 'a'}/: 3, {tmp_path / 'b.jsonl'}: 1}}"


def data_of(monkeypatch, tmp_path, mix, seed=0, n_proc=1, proc=0):
    cfg = config.load(None, [*GPT, mix, f"data.cache_dir={tmp_path / 'cache'}"]).data
    return build_as(monkeypatch, cfg, seed, n_proc, proc)


def share_of_a(batch) -> float:
    inputs = batch["inputs"]
    return float(np.mean((inputs == ord("a")).sum(1) > (inputs == ord("b")).sum(1)))


def test_rows_follow_the_weights_and_the_seed(monkeypatch, tmp_path, corpora):
    data = data_of(monkeypatch, tmp_path, corpora)
    shares = [share_of_a(data.train[s]) for s in range(200)]  # 3,200 rows: a's share is 3/4 within 0.03
    assert abs(np.mean(shares) - 0.75) < 0.03
    again, other = data_of(monkeypatch, tmp_path, corpora), data_of(monkeypatch, tmp_path, corpora, seed=1)
    for s in (0, 7, 150):
        np.testing.assert_array_equal(again.train[s]["inputs"], data.train[s]["inputs"])
    assert any(not np.array_equal(other.train[s]["inputs"], data.train[s]["inputs"]) for s in range(5))
    assert set(data.eval_parts) == {"a", "b"}


def test_processes_read_disjoint_rows_of_the_global_batch(monkeypatch, tmp_path, corpora):
    whole = data_of(monkeypatch, tmp_path, corpora)
    for s in (0, 3, 99):
        parts = [data_of(monkeypatch, tmp_path, corpora, n_proc=2, proc=p).train[s] for p in (0, 1)]
        for k, v in whole.train[s].items():
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), v)


def test_resume_is_bitwise_and_eval_reports_each_source(train, tmp_path, corpora):
    run = [*GPT, corpora, f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4", "run.log_every=1",
           "train.eval_every=4", "train.eval_batches=0", "checkpoint.enabled=true", "checkpoint.every=2",
           "checkpoint.async=false", "checkpoint.keep=5"]
    whole = train(*run, subdir="whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = train(*run, subdir="resumed")
    assert resumed.start_step == 2
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history][2:]  # bitwise
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_loss" in r][-1]
    for metric in ("eval_loss", "eval_bits_per_byte"):
        parts = [last[f"{metric}/a"], last[f"{metric}/b"]]
        assert min(parts) - 1e-9 <= last[metric] <= max(parts) + 1e-9  # the overall: all eval rows together


def test_labels_are_stems_made_unique():
    assert mixture.labels(["corpus_a/", "x/b/*.jsonl", "y/b.parquet", "b.jsonl"]) == ["corpus_a", "b", "b_2", "b_3"]


@pytest.mark.parametrize("mix, says", [
    ("{a/: 0}", "data.mixture: a/: 0 is not a weight; a weight is a positive number"),
    ("{a/: -1, b/: 1}", "data.mixture: a/: -1 is not a weight"),
    ("{a/: heavy}", "data.mixture: a/: 'heavy' is not a weight"),
])
def test_bad_weights_are_one_line(tmp_path, mix, says):
    result = run_cli(*GPT, f"data.mixture={mix}", f"run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2 and says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_path_with_mixture_and_an_empty_source_are_one_line(tmp_path, corpora):
    both = run_cli(*GPT, corpora, f"data.path={tmp_path / 'b.jsonl'}", f"run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert both.returncode == 2 and "data.path and data.mixture are exclusive" in both.stderr
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    empty = run_cli(*GPT, f"data.mixture={{{tmp_path / 'b.jsonl'}: 1, {tmp_path / 'empty.jsonl'}: 1}}",
                    f"run.dir={tmp_path / 'run2'}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1",
                    cwd=tmp_path)
    assert empty.returncode == 2 and f"data.mixture: {tmp_path / 'empty.jsonl'}:" in empty.stderr
    assert len(empty.stderr.strip().splitlines()) == 1
