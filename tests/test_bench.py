"""bench/mfu.py runs end to end on the CPU (its figures there are not the point: an accelerator's are).

Its exit status is its verdict: 0 when the best setting reaches the 55% MFU target, 1 when none does
or none ran, 2 for bad arguments. A crash also exits 1, so every check of a 1 also asks for a clean
stderr (the bench reports a setting's failure on stdout; a crash leaves a traceback on stderr) and for
the report's closing line, which a crash would not print."""

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_GPT, subprocess_env


def mfu(*args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "mfu.py"), str(ROOT / "configs" / "default.yaml"),
                           *TINY_GPT, *args], env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def report(proc) -> list[str]:
    """stdout's lines, once it is clear the bench itself decided how to exit (it did not crash)."""
    assert proc.stderr == "", proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[0].startswith("device: cpu (cpu) | jax "), proc.stdout
    return lines


def test_mfu_sweep_reports_every_setting_and_the_fastest(tmp_path):
    out = tmp_path / "runs.jsonl"
    proc = mfu("run.peak_tflops=10", "--sweep", "--knobs", "remat", "--steps", "20", "--out", str(out))
    lines = report(proc)
    assert proc.returncode == 1  # ran; a tiny model on a CPU is far from 55% of 10 TFLOP/s
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    # default.yaml's remat (dots) first, then the others in the sweep's order, none tried twice
    assert [r["remat"] for r in runs] == ["dots", "none", "full"]
    for r in runs:
        assert r["status"] == "ok" and r["batch"] == 16 and r["attention"] == "auto"  # the default
        assert r["mfu"] == pytest.approx(r["tflops"] / 10) and r["mfu"] < 0.55
        assert r["tokens_per_s"] > 0 and r["compile_s"] > 0
    # one row per run, as it finished, then the fastest
    rows = lines[1:-1]
    assert [row.split(" | ")[1] for row in rows] == [f"remat {r['remat']:<4}" for r in runs]
    assert all(f"{r['tokens_per_s']:,.0f} tokens/s" in row for r, row in zip(runs, rows))
    best = max(runs, key=lambda r: r["tokens_per_s"])
    assert lines[-1].startswith(f"best: batch   16 | remat {best['remat']:<4}")
    assert lines[-1] == "best: " + rows[runs.index(best)]


def test_mfu_exits_0_when_the_target_is_met(tmp_path):
    out = tmp_path / "runs.jsonl"
    proc = mfu("run.peak_tflops=1e-6", "--steps", "20", "--out", str(out))  # any rate is most of 1 MFLOP/s
    lines = report(proc)
    assert proc.returncode == 0
    [run] = [json.loads(line) for line in out.read_text().splitlines()]
    assert run["status"] == "ok" and run["mfu"] >= 0.55 and run["remat"] == "dots"
    assert lines[-1].startswith("best: batch   16 | remat dots")


def test_mfu_reports_a_setting_that_cannot_run():
    proc = mfu("train.attention=cudnn", "train.dtype=bfloat16", "--steps", "20")
    lines = report(proc)
    assert proc.returncode == 1
    assert len(lines) == 3 and "| attention cudnn |" in lines[1]
    assert "| failed: error: train.attention=cudnn needs an NVIDIA GPU" in lines[1]  # train.py's one-line error
    assert lines[-1] == "no setting ran"


def test_mfu_rejects_bad_arguments_before_running_anything():
    proc = mfu("--steps", "5", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: --steps must be at least 20, got 5"


def test_cpu_profile_attributes_the_step_to_its_xla_instructions():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_profile.py"), "--no-torch", "--steps", "3",
                           "--top", "8", *TINY_GPT], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("ours (XLA thunks, self time):"))
    wall, busy = map(float, re.search(r"([\d.]+) ms per step \(wall\).* add up to ([\d.]+) ms", header).groups())
    rows = [line.split() for line in lines if line[:10].strip().replace(".", "").isdigit()]
    assert len(rows) == 8 and all(r[3] in ("fusion", "dot", "copy", "while", "custom-call") for r in rows), rows
    kinds = dict(part.rsplit(" ", 1)
                 for part in next(l for l in lines if "by kind:" in l).split(": ", 1)[1].split(", "))
    # Self times: a loop's thunk does not count again the thunks of its body, so it adds almost nothing.
    assert float(kinds.get("while", 0)) < 0.05 * busy
    assert 0.3 * wall < busy < 3 * wall  # one thread's worth of work, give or take the second core
