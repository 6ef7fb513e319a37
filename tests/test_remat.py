"""train.remat (what each layer keeps for the backward pass) and train.scan_layers (the layers scanned or written
out): both change memory and the compiled program, never the losses."""

import numpy as np
import pytest

from conftest import TINY_GPT, one_device_runs, overrides
from test_target import SMALL_GPT, needs_libtpu

POLICIES = ("full", "dots", "qkv", "attention", "offload")
STEPS = ["train.steps=3", "run.log_every=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    configs = {r: [*TINY_GPT, *STEPS, f"train.remat={r}"] for r in ("none", *POLICIES)}
    configs["unrolled"] = [*TINY_GPT, *STEPS, "train.scan_layers=false"]
    return one_device_runs(tmp_path_factory, configs)


def losses(result) -> list[float]:
    return [h["loss"] for h in result.history]


def temp(result) -> int:
    return result.train_step.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_trains_as_none_does(runs, policy):
    np.testing.assert_allclose(losses(runs(policy)), losses(runs("none")), rtol=1e-5)
    assert runs(policy).eval["eval_loss"] == pytest.approx(runs("none").eval["eval_loss"], rel=1e-5)


def flops(result) -> float:
    analysis = result.train_step.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]


def test_keeping_less_takes_less_memory_and_recomputes_more(runs):
    t = {r: temp(runs(r)) for r in ("none", "full", "qkv", "attention")}
    assert t["full"] < t["qkv"] < t["attention"] < t["none"]  # attention keeps qkv's arrays and one more
    f = {r: flops(runs(r)) for r in ("none", "full", "qkv", "attention")}
    assert f["none"] < f["attention"] < f["qkv"] < f["full"]  # XLA's attention: its output kept, not recomputed


def test_unrolled_layers_train_as_the_scan_does(runs):
    scanned, unrolled = runs("none"), runs("unrolled")
    assert "while" in scanned.train_step.as_text() and "while" not in unrolled.train_step.as_text()
    np.testing.assert_allclose(losses(unrolled), losses(scanned), rtol=1e-5)
    assert unrolled.eval["eval_loss"] == pytest.approx(scanned.eval["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("mesh", [["mesh=fsdp", "run.cpu_devices=2", "train.remat=full"],
                                  ["mesh=pp", "mesh.stage=2", "run.cpu_devices=2", "train.remat=qkv"]],
                         ids=["fsdp", "pipeline"])
def test_unrolled_layers_with_remat_on_a_mesh_train_as_one_scanned_device(runs, train, mesh):
    """Each layer written out goes through hooks.layer (remat per layer, as in the scan), and a pipeline's stages
    write theirs out too."""
    result = train(*TINY_GPT, *STEPS, "train.scan_layers=false", *mesh)
    np.testing.assert_allclose(losses(result), losses(runs("none")), rtol=2e-5)
    assert result.eval["eval_loss"] == pytest.approx(runs("none").eval["eval_loss"], rel=2e-5)


@pytest.mark.slow
@needs_libtpu
def test_offload_compiles_for_a_tpu_and_frees_device_memory(tmp_path):
    from shard import config
    from shard.plan import analysis
    from shard.plan import target

    temps = {}
    for remat in ("none", "offload"):
        cfg = config.load(None, overrides(tmp_path / remat, *SMALL_GPT, "run.target=v5p-8", "mesh=fsdp",
                                          f"train.remat={remat}"))
        temps[remat] = analysis.analyse(cfg, target.devices(target.of(cfg.run)))["memory_per_device"]["temp"]
    assert temps["offload"] < temps["none"] * 0.75


def test_the_search_ranks_the_named_policies_by_what_they_keep_and_offload_only_as_configured(tmp_path):
    import jax
    from shard import config
    from shard.plan import search
    from shard.run import job

    cfg = config.load(None, overrides(tmp_path, *TINY_GPT, "train.remat=offload"))
    devices = jax.devices()[:4]
    work = job.workload(cfg, devices)
    candidates = search.enumerate_candidates(cfg, work, len(devices))
    assert {c.remat for c in candidates} == {*search.REMATS, "offload"}
    assert all(c.baseline for c in candidates if c.remat == "offload")  # its host transfers have no formula
    fsdp = [c for c in candidates if c.label == "fsdp" and c.accum == 1]
    for c in fsdp:
        assert search.estimate(cfg, work, c, peak=1e14, link=100)
    by = {c.remat: c for c in fsdp}
    order = ("none", "dots", "attention", "qkv", "full")  # keeping less, recomputing more
    assert [by[r].memory for r in order] == sorted((by[r].memory for r in order), reverse=True)
    assert [by[r].estimate for r in order] == sorted(by[r].estimate for r in order)
