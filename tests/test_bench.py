"""bench/mfu.py runs end to end on the CPU (its figures there are not the point: an accelerator's are)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_GPT, subprocess_env


def mfu(*args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "mfu.py"), str(ROOT / "configs" / "default.yaml"),
                           *TINY_GPT, *args], env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def test_mfu_sweep_reports_every_setting_and_the_fastest(tmp_path):
    out = tmp_path / "runs.jsonl"
    proc = mfu("run.peak_tflops=10", "--sweep", "--knobs", "remat", "--steps", "20", "--out", str(out))
    assert proc.returncode == 1, proc.stderr  # ran; a tiny model on a CPU is far from 55% of 10 TFLOP/s
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["remat"] for r in runs) == ["dots", "full", "none"]  # default.yaml's dots first, then the rest
    for r in runs:
        assert r["status"] == "ok" and r["batch"] == 16 and r["attention"] == "xla"
        assert r["mfu"] == pytest.approx(r["tflops"] / 10)
        assert r["tokens_per_s"] > 0 and r["compile_s"] > 0
    best = max(runs, key=lambda r: r["tokens_per_s"])
    assert proc.stdout.strip().splitlines()[-1].startswith(f"best: batch   16 | remat {best['remat']:<4}")


def test_mfu_reports_a_setting_that_cannot_run():
    proc = mfu("train.attention=cudnn", "train.dtype=bfloat16", "--steps", "20")
    assert proc.returncode == 1 and "Traceback" not in proc.stdout
    assert "failed: error: train.attention=cudnn needs an NVIDIA GPU" in proc.stdout
    assert proc.stdout.strip().endswith("no setting ran")
