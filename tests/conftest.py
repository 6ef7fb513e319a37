"""Tests run on 8 simulated CPU devices: enough for every mesh. Set before JAX initialises."""

import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Tests check behaviour, not speed: XLA's CPU backend without its LLVM optimisations compiles about a
# third faster, and compiling is most of what the suite's small models cost. Subprocesses get the
# same flag (not the device count: they ask for theirs with run.cpu_devices).
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {FAST_COMPILE}"
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same small programs, in this process and in subprocesses: JAX's persistent
# compilation cache makes the second compile of each a file read.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "shard-tests-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")
assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices"  # also starts the backend now

ROOT = Path(__file__).resolve().parent.parent

# A tiny GPT whose every sharded dimension divides 8, so it fits every mesh of 8 devices.
TINY_GPT = ["model.name=gpt", "model.vocab_size=256", "model.d_model=32", "model.n_layers=2",
            "model.n_heads=8", "model.d_ff=64", "model.max_len=32", "data.name=text", "data.seq_len=32",
            "data.batch_size=16"]
TINY_MLP = ["model.name=mlp", "model.in_features=16", "model.out_features=8", "model.hidden=[32,32]",
            "data.name=synthetic", "data.features=[16]", "data.classes=8", "data.batch_size=32", "optimizer.lr=3e-2"]
# One tiny configuration of every model in the library, each dimension a mesh axis splits a multiple of 8.
DIGITS = ["data.name=digits", "data.batch_size=16", "data.eval_fraction=0.2"]
TEXT = ["data.name=text", "data.seq_len=16", "data.batch_size=16"]
TINY_MODELS = {
    "gpt": TINY_GPT,
    "mlp": TINY_MLP,
    "cnn": ["model.name=cnn", "model.widths=[8,16]", "model.blocks=1", *DIGITS],
    "vit": ["model.name=vit", "model.d_model=32", "model.n_layers=2", "model.n_heads=8", "model.d_ff=64", *DIGITS],
    "lstm": ["model.name=lstm", "model.d_model=32", "model.n_layers=2", *TEXT],
    "lstm_classifier": ["model.name=lstm", "model.vocab_size=0", "model.in_features=4", "model.num_classes=8",
                        "model.d_model=32", "data.name=synthetic", "data.features=[6,4]", "data.classes=8",
                        "data.batch_size=16", "optimizer.lr=1e-2"],
    "moe": ["model.name=moe", "model.d_model=32", "model.n_layers=2", "model.n_heads=8", "model.d_ff=64",
            "model.max_len=16", "model.n_experts=8", "model.top_k=2", *TEXT],
}


def overrides(tmp_path, *extra) -> list[str]:
    # TensorBoard and the end-of-run picture cost a second a run; tests/test_observe.py turns them on.
    return [f"run.dir={tmp_path}", "run.progress=false", "run.tensorboard=false", "run.plot=false",
            "train.sample_len=0", "train.eval_batches=1", "optimizer.warmup_steps=2", "checkpoint.enabled=false",
            *extra]


@pytest.fixture
def train(tmp_path):
    """Run the trainer in-process with the given overrides; returns shard.run.trainer.Result."""
    from shard import config
    from shard.run import trainer

    def go(*extra, subdir="run"):
        return trainer.run(config.load(None, overrides(tmp_path / subdir, *extra)))

    return go


def one_device_runs(tmp_path_factory, configs: dict, *extra):
    """get(name): configs[name] trained on one device, once per module that asks (the reference curves)."""
    from shard import config
    from shard.run import trainer

    out = {}

    def get(name):
        if name not in out:
            args = overrides(tmp_path_factory.mktemp(name), *configs[name], *extra, "run.cpu_devices=1")
            out[name] = trainer.run(config.load(None, args))
        return out[name]

    return get


def same_curve_as_one_device(train, base: list, mesh: list) -> None:
    """`base` trained on `mesh` and on one device (with the mesh's model.* settings): the same losses and eval."""
    import numpy as np

    layers = [a for a in mesh if a.startswith("model.")]
    one = train(*base, *layers, "run.cpu_devices=1", subdir="one")
    many = train(*base, *mesh, subdir="many")
    np.testing.assert_allclose([r["loss"] for r in many.history], [r["loss"] for r in one.history], rtol=2e-5)
    assert many.eval["eval_loss"] == pytest.approx(one.eval["eval_loss"], rel=2e-5)


def subprocess_env() -> dict:
    """This environment for a child process, less the 8-device flag."""
    return {**os.environ, "XLA_FLAGS": FAST_COMPILE}


def run_cli(*args, cwd=ROOT, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)



# Each test file's seconds in a full run (--durations=0, summed per file; the numbers' order is what counts, so a
# busy machine's run serves): the order the files are handed to the workers. A file not listed counts its tests.
FILE_SECONDS = json.loads((Path(__file__).parent / "file_seconds.json").read_text())


def pytest_collection_modifyitems(config, items):
    """The longest files first (each file's own order kept): with -n 2 a file runs on one worker (--dist loadfile),
    handed out in this order, so the long ones start early and the short ones fill the end (xdist's own order, by
    test count, left the two-process and compile-only files for last)."""
    count = collections.Counter(item.path.name for item in items)
    cost = lambda item: FILE_SECONDS.get(item.path.name, count[item.path.name])  # noqa: E731
    items.sort(key=lambda item: (-cost(item), item.path.name))
