"""run.wandb=true: the same scalars, the config and the plan go to Weights & Biases, offline without an API
key (no network needed); without the wandb package it is one line, and nothing else needs it."""

import json
import struct
import sys
from pathlib import Path

import pytest

from conftest import TINY_MLP
from shard.errors import UserError


def wandb_records(path: Path) -> list:
    """The records of a .wandb file (what `wandb sync` uploads): a header, then a LevelDB-style log of 32 KiB
    blocks, each record a 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last part)
    and a protobuf Record. wandb has no Python reader for it any more."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, out, part = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def items(update) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def test_offline_without_an_api_key(train, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no `wandb login` either
    monkeypatch.setenv("HOME", str(tmp_path))
    result = train(*TINY_MLP, "train.steps=6", "run.log_every=2", "run.wandb=true")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "run").iterdir())
    records = wandb_records(next(runs[0].glob("run-*.wandb")))
    # the same scalars as metrics.jsonl, under TensorBoard's tags, against our step
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(h["step"], h.get("train/loss"), h.get("eval/loss")) for h in history] == \
        [(r["step"], r.get("loss"), r.get("eval_loss")) for r in logged]
    assert history[-2]["train/loss"] == result.history[-1]["loss"]
    # the resolved config, and the plan
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in items(run.config.update).items()}
    assert config["model"]["hidden"] == [32, 32] and config["train"]["steps"] == 6
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary |= items(r.summary.update)
    assert summary["plan/model"] == "mlp" and summary["plan/parameters"] == 1864 and "split" in summary["plan/split"]


def test_asked_for_without_the_package_is_one_line(train, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(UserError, match=r"run.wandb=true needs the wandb package: pip install wandb"):
        train(*TINY_MLP, "train.steps=2", "run.wandb=true")
    assert not (tmp_path / "run").exists()  # nothing written
    assert train(*TINY_MLP, "train.steps=2").history  # not asked for: nothing needs it
