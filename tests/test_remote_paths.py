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
    from shard.run import checkpoint

    seen = []

    class Manager:
        def __init__(self, directory, **kwargs):
            seen.append(str(directory))

    monkeypatch.setattr(checkpoint.ocp, "CheckpointManager", Manager)
    checkpoint.Checkpoints("gs://bucket/run/checkpoints", keep=1, use_async=False)
    assert seen == ["gs://bucket/run/checkpoints"]


def test_a_run_writes_its_files_under_a_url_run_dir(local_bucket):
    from shard import config
    from shard.run import trainer
    from conftest import TINY_MLP

    args = [*TINY_MLP, "train.steps=3", "run.log_every=1", "run.dir=gs://bucket/run", "run.progress=false",
            "train.eval_batches=1", "checkpoint.enabled=false"]
    trainer.run(config.load(None, args))
    # a second run in the folder starts again from step 0 (no checkpoint): each step is logged once, the first
    # run's records past its start kept aside (as after a restart: tests/test_restarts.py)
    trainer.run(config.load(None, args))
    run = local_bucket / "run"
    assert (run / "config.yaml").read_text().count("dir: gs://bucket/run") == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    aside = [json.loads(line) for line in (run / "metrics.discarded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in aside if "loss" in r] == [1, 2, 3]
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file a run, copied through the URL
    assert (run / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_remote_logs_are_uploaded_now_and_then_and_a_failed_upload_costs_nothing(local_bucket, monkeypatch, capsys):
    """Each log record used to rewrite the whole metrics file and re-copy every event file, and a failed
    write ended the run before its checkpoint: now uploads are spaced out, and failures are a warning."""
    from shard import config
    from shard.observe import metrics
    from shard.run import trainer
    from conftest import TINY_MLP

    url_path = type(paths.resolve("gs://bucket/x"))
    writes, real_text, real_bytes = [], url_path.write_text, url_path.write_bytes
    monkeypatch.setattr(metrics, "UPLOAD_EVERY_S", 1e9)
    monkeypatch.setattr(url_path, "write_text",
                        lambda self, t, *a, **k: (writes.append(self.name), real_text(self, t, *a, **k))[1])
    args = [*TINY_MLP, "train.steps=6", "run.log_every=1", "run.dir=gs://bucket/run", "run.progress=false",
            "train.eval_batches=1", "checkpoint.enabled=true", "checkpoint.dir=checkpoints", "run.plot=false"]
    trainer.run(config.load(None, args))
    assert writes.count("metrics.jsonl") == 2  # the first record, and the whole log when it closes
    assert len((local_bucket / "run" / "metrics.jsonl").read_text().splitlines()) == 7  # 6 steps and the eval

    def broken(self, *a, **k):
        raise OSError(5, "the bucket is unreachable")

    monkeypatch.setattr(url_path, "write_text", lambda self, t, *a, **k: broken(self) if self.name == "metrics.jsonl"
                        else real_text(self, t, *a, **k))
    monkeypatch.setattr(url_path, "write_bytes", lambda self, b, *a, **k: broken(self) if "tfevents" in self.name
                        else real_bytes(self, b, *a, **k))
    capsys.readouterr()
    result = trainer.run(config.load(None, [a if a != "train.steps=6" else "train.steps=9" for a in args]))
    err = capsys.readouterr().err
    assert int(result.state.step) == 9
    assert err.count("writing gs://bucket/run/metrics.jsonl failed") == 1 and err.count("TensorBoard events") == 1
    assert (local_bucket.parent.parent / "checkpoints" / "9").is_dir()  # orbax's own gs:// needs the cloud library
