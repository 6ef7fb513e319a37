"""run.target: compiling the train step for hardware this machine does not have (TPU slices, GPU nodes)
with the real compiler, and the plan's figures beside the compiler's. The compile tests need libtpu
(`pip install -e ".[tpu]"`) or the CUDA plugin (`pip install -e ".[cuda]"`) and are skipped without."""

import importlib.util
import json
import sys

import pytest

from conftest import ROOT, overrides, run_cli
from shard import config
from shard.plan import analysis, meshes
from shard.errors import UserError
from shard.plan import target

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA_PLUGIN = (importlib.util.find_spec("jax_plugins") is not None
                   and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install -e '.[tpu]')")
needs_cuda = pytest.mark.skipif(not HAS_CUDA_PLUGIN,
                                reason="the CUDA plugin is not installed (pip install -e '.[cuda]')")

# The default GPT, small, with every dimension split over the 4 chips of a v5p-8 still a multiple of the
# TPU's 128-wide tiles: the compiler pads a smaller piece up to a tile, which the plan does not count.
SMALL_GPT = ["model.name=gpt", "model.vocab_size=512", "model.d_model=512", "model.n_layers=4", "model.n_heads=4",
             "model.d_ff=512", "model.max_len=64", "data.name=text", "data.seq_len=64", "data.batch_size=16"]


@pytest.mark.parametrize("name,chips,topology", [
    ("v4-8", 4, "v4:2x2x1"), ("v5p-8", 4, "v5p:2x2x1"), ("v5p-32", 16, "v5p:2x2x4"), ("v5p-128", 64, "v5p:4x4x4"),
    ("v5p-256", 128, "v5p:4x4x8"), ("v5e-16", 16, "v5e:4x4"), ("v5litepod-8", 8, "v5e:2x4"), ("v6e-64", 64, "v6e:8x8"),
    ("h100x8", 8, "1x1x8"), ("h100x16", 16, "1x2x8"), ("a100x4", 4, "1x1x4"), ("h200x8", 8, "1x1x8")])
def test_cloud_names_give_the_clouds_chips_and_topologies(name, chips, topology):
    t = target.parse(name)
    assert (t.n_chips, t.topology) == (chips, topology)


@pytest.mark.parametrize("name", ["v9-8", "v5p-6", "v5e-12", "h100x12", "tpu", "b200x8"])
def test_a_name_that_is_no_target_is_one_line(name):
    with pytest.raises(UserError, match="run.target"):
        target.parse(name)


def test_the_gpu_description_carries_the_chip_facts():
    text = target.gpu_target_config(target.chips()["gpu"]["h100"])
    assert "major: 9 minor: 0" in text and "core_count: 132" in text and 'NVIDIA H100 80GB HBM3' in text


def test_the_tpu_compilers_refusals_say_which_memory():
    # HBM: the shortfall; a fusion over a core's VMEM (seen compiling Qwen3-8B for v5p-8) is not a verdict on HBM
    hbm = target.out_of_memory("RESOURCE_EXHAUSTED: ...\nTotal hbm usage required for program (120.50G) exceeds "
                               "available HBM (95.74G)", "v5p-8")
    assert hbm.startswith("the step does not fit v5p-8: the compiler needs 120.50 GiB") and "short by 24.76" in hbm
    vmem = target.out_of_memory("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
                                "space vmem. Used 77.50M of 63.94M vmem. Exceeded vmem capacity by 13.56M.", "v5p-8")
    assert vmem.startswith("the step does not compile for v5p-8") and "HBM use is unknown" in vmem
    assert "\n" not in hbm + vmem


def test_the_gpu_compilers_own_failure_is_one_line_with_the_way_round():
    # seen compiling Phi-3 for h100x8 (head size 96, as many key/value heads as heads): the Triton GEMM emitter
    failed = target.compiler_failed("INTERNAL: Couldn't find output tile sizes that satisfy ...\n\tat fusion.12",
                                    "h100x8")
    assert failed.startswith("the step does not compile for h100x8: the compiler failed (INTERNAL: Couldn't find")
    assert "xla_gpu_enable_triton_gemm: false" in failed and "\n" not in failed
    assert "triton" not in target.compiler_failed("INTERNAL: something else", "v5p-8")


@pytest.mark.parametrize("args,says", [
    (["run.target=v9-8", "--dry-run"], "unknown run.target 'v9-8'; known: v4-N"),
    (["run.target=v5p-8"], "add --dry-run or --compare"),
    (["run.target=v5p-8", "mesh=tp", "mesh.tensor=3", "--dry-run"], "run.target=v5p-8 has 4 devices"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    if "has 4 devices" in says and not HAS_LIBTPU:
        pytest.skip("libtpu is not installed: the target's devices cannot be listed")
    r = run_cli(*overrides(tmp_path), *args)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_missing_compiler_names_the_command_to_install_it(tmp_path):
    fake = tmp_path / "hide" / "libtpu"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    import os
    import subprocess
    from conftest import subprocess_env
    env = {k: v for k, v in subprocess_env().items() if k != "TPU_LIBRARY_PATH"}  # JAX sets it once it found libtpu
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hide"), str(ROOT)])
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides(tmp_path), "run.target=v5p-8", "--dry-run"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[:300] + r.stderr
    assert 'pip install -e ".[tpu]"' in r.stderr.strip().splitlines()[-1]


def _analyse(tmp_path, name, *extra):
    cfg = config.load(None, overrides(tmp_path, *SMALL_GPT, f"run.target={name}", *extra))
    return analysis.analyse(cfg, target.devices(target.of(cfg.run)))


# What each mesh must make the compiler emit (the plan's own reading of the strategies), checked on the presets
# mesh=auto compiles (below) and fsdp_tp's on the command line's plan.
EXPECTED = {"dp": "all-reduce", "tp": "all-reduce", "fsdp_tp": "all-gather", "pp": "collective-permute",
            "cp": "all-gather"}


def _check_state_bytes(p: dict, mesh: str) -> None:
    mem, c = p["memory_per_device"], p["compiler"]
    batch = 2 * 16 * 64 * 4 / (p["mesh"]["data"] * p["mesh"]["fsdp"] * p["mesh"]["context"])  # inputs, targets
    state = mem["params"] + mem["optimizer"]
    assert mem["arguments"] - batch == pytest.approx(state, rel=0.02)  # the compiler's bytes: the state's
    assert mem["capacity"] == 95 * 2**30 and mem["fits"]
    assert p["collectives"][EXPECTED[mesh]]["count"] > 0
    assert c["step_s"] > 0 and 0 < c["mfu"] < 1 and c["loop_factor"] > 1  # scanned layers: bodies counted once
    assert "the target's compiler estimates the step" in analysis.report(p)


@needs_libtpu
def test_a_dry_run_for_a_tpu_target_writes_the_plan(tmp_path):
    r = run_cli(*overrides(tmp_path, *SMALL_GPT), "run.target=v5p-8", "mesh=fsdp_tp", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "compile-only devices of v5p-8 (4 TPU v5p chips, v5p:2x2x1)" in r.stdout
    assert "of 97280.00 MiB (fits)" in r.stdout
    written = {p.name for p in tmp_path.iterdir() if p.name.startswith("plan")}
    assert written == {"plan-v5p-8.json"}  # beside a local plan.json, never over it
    _check_state_bytes(json.loads((tmp_path / "plan-v5p-8.json").read_text()), "fsdp_tp")


@needs_cuda
def test_the_gpu_compilers_state_bytes_are_the_plans(tmp_path):
    p = _analyse(tmp_path, "h100x8", "mesh=fsdp")
    mem = p["memory_per_device"]
    batch = 2 * 16 * 64 * 4 / 8
    assert mem["arguments"] - batch == pytest.approx(mem["params"] + mem["optimizer"], rel=0.02)
    assert p["collectives"]["all-gather"]["count"] > 0 and mem["fits"]


@needs_libtpu
def test_mesh_auto_for_a_target_picks_a_config_that_fits_and_beats_every_preset(tmp_path):
    from shard.plan import search

    tiny = ["model.d_model=128", "model.n_heads=4", "model.d_ff=512", "model.n_layers=4", "model.vocab_size=256",
            "model.max_len=64", "data.seq_len=64", "data.batch_size=16"]
    cfg = config.load(None, overrides(tmp_path, *tiny, "run.target=v5p-8", "mesh=auto", "run.search_compiles=1"))
    devices = target.devices(target.of(cfg.run))
    rows, _, considered = search.search(cfg, devices, compiles=1)
    assert considered > len(rows) > 4  # many ranked by formula, a few compiled: the best one and the presets
    fitting = [r for r in rows if "skipped" not in r and r["memory_per_device"]["fits"]]
    best = fitting[0]
    assert best["compiler"]["step_s"] is not None
    presets = [r for r in fitting if r["baseline"] and r["compiler"]["step_s"]]
    assert presets and all(best["compiler"]["step_s"] <= r["compiler"]["step_s"] for r in presets)
    # each preset's compiled state is the plan's, with the collectives its strategy makes: those that keep the
    # 128-wide arrays whole (a TPU lays an array out in tiles 128 wide, so fsdp's quarters of them are padded 4x;
    # fsdp_tp is the command line's SMALL_GPT below)
    compiled = {r["preset"]: r for r in presets}
    for preset in ("dp", "tp", "pp", "cp"):
        _check_state_bytes(compiled[preset], preset)
    cfg_best = search.configured(cfg, search.Candidate(best["label"], best["preset"], best["mesh"], best["remat"],
                                                       best["grad_accum"]))
    written = meshes.write_config(cfg_best, str(tmp_path / "best.yaml"))
    again = config.load(written, [])
    assert again.run.target is None and again.train.remat == best["remat"]
    assert {a: getattr(again.mesh, a) for a in best["mesh"]} == best["mesh"]
    with pytest.raises(UserError, match="exists"):
        meshes.write_config(cfg_best, str(written))
