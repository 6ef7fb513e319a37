"""Remote storage: run and checkpoint paths given as URLs (gs://, s3://) stay URLs end to end."""

import json

import pytest
from etils.epath import backend as epath_backend
from etils.epath import gpath

from shard import paths


@pytest.fixture
def local_bucket(tmp_path, monkeypatch):
    """gs:// served from the local file system: epath's own os backend reads `gs://bucket/x` as the
    relative path `gs:/bucket/x`, so in tmp_path a URL-shaped run.dir lands in tmp_path/gs:/bucket."""
    monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", epath_backend.os_backend)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "gs:" / "bucket"


def test_a_url_is_kept_and_a_local_path_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert str(paths.resolve("gs://bucket/run")) == "gs://bucket/run"
    assert str(paths.resolve("gs://bucket/run") / "checkpoints") == "gs://bucket/run/checkpoints"
    assert str(paths.resolve("runs/a")) == str(tmp_path / "runs" / "a")


def test_checkpoints_hand_the_url_to_orbax_unchanged(local_bucket, monkeypatch):
    from shard import checkpoint

    seen = []

    class Manager:
        def __init__(self, directory, **kwargs):
            seen.append(str(directory))

    monkeypatch.setattr(checkpoint.ocp, "CheckpointManager", Manager)
    checkpoint.Checkpoints("gs://bucket/run/checkpoints", keep=1, use_async=False)
    assert seen == ["gs://bucket/run/checkpoints"]


def test_a_run_writes_its_files_under_a_url_run_dir(local_bucket):
    from shard import config, trainer
    from conftest import TINY_MLP

    args = [*TINY_MLP, "train.steps=3", "run.log_every=1", "run.dir=gs://bucket/run", "run.progress=false",
            "train.eval_batches=1", "checkpoint.enabled=false"]
    trainer.run(config.load(None, args))
    trainer.run(config.load(None, args))  # a second run appends to the same log
    run = local_bucket / "run"
    assert (run / "config.yaml").read_text().count("dir: gs://bucket/run") == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 1, 2, 3]
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file a run, copied through the URL
    assert (run / "curves.png").read_bytes().startswith(b"\x89PNG")
