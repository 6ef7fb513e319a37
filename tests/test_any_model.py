"""Any Flax model, any mesh: models built from Flax's stock layers, with no logical names, are split
by every preset (the automatic split) and train with the loss curve of one device."""

import textwrap

import jax
import numpy as np
import pytest

from conftest import ROOT, one_device_runs, run_cli

STOCK = {
    "mlp": ["model.name=stock_models:StockMLP", "data.name=synthetic", "data.features=[64]", "data.classes=10",
            "data.batch_size=32", "optimizer.lr=1e-2"],
    "transformer": ["model.name=stock_models:StockTransformer", "data.name=text", "data.seq_len=32",
                    "data.batch_size=16"],
}
STEPS = ["train.steps=12", "run.log_every=1"]


def losses(result) -> np.ndarray:
    return np.array([r["loss"] for r in result.history])


def share_per_device(params) -> float:
    """Bytes of parameters one device holds, over the model's bytes: read from the arrays' shards."""
    arrays = jax.tree.leaves(params)
    return sum(a.addressable_shards[0].data.nbytes for a in arrays) / sum(a.nbytes for a in arrays)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return one_device_runs(tmp_path_factory, STOCK, *STEPS)


@pytest.mark.parametrize("model", STOCK)
@pytest.mark.parametrize("preset", ["dp", "fsdp", "tp", "hybrid", "fsdp_tp"])
def test_stock_flax_model_matches_one_device_and_is_split(train, one_device, capsys, model, preset):
    result = train(*STOCK[model], *STEPS, "run.cpu_devices=8", f"mesh={preset}")
    expected = losses(one_device(model))
    assert expected[-1] < expected[0]
    np.testing.assert_allclose(losses(result), expected, rtol=1e-5)
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("parameters:")]
    assert summary and "0 split by logical names" in summary[-1]
    if preset == "dp":
        assert share_per_device(result.state.params) == 1.0 and "0 split automatically" in summary[-1]
    if preset in ("fsdp", "tp"):
        assert share_per_device(result.state.params) <= 0.25
        # Adam's moments follow their parameters onto the same devices.
        assert share_per_device(result.state.opt_state) <= 0.25


ANNOTATED = '''
import jax
from flax import nnx


class Styles(nnx.Module):
    """Flax's own ways of naming dimensions: with_partitioning, kernel_metadata, sharding_names, out_sharding."""

    def __init__(self, width_name: str = "mlp", *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.a = nnx.Linear(64, 256, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("features", width_name)))
        self.b = nnx.Linear(256, 256, rngs=rngs, kernel_metadata={"sharding_names": (width_name, "embed")})
        self.c = nnx.Param(init(rngs.params(), (256, 256)), out_sharding=("embed", width_name))
        self.d = nnx.Linear(256, 10, rngs=rngs)  # unnamed, and below the automatic split's size

    def __call__(self, x):
        x = jax.nn.relu(self.a(x))
        x = jax.nn.relu(self.b(x))
        return self.d(jax.nn.relu(x @ self.c[...]))
'''
STYLES = ["model.name=styles:Styles", "data.name=synthetic", "data.features=[64]", "data.classes=10",
          "data.batch_size=32", "train.steps=2", "run.cpu_devices=8"]


@pytest.fixture
def styles_module(tmp_path, monkeypatch):
    (tmp_path / "styles.py").write_text(textwrap.dedent(ANNOTATED))
    monkeypatch.chdir(tmp_path)


def test_flax_annotation_styles_map_through_the_rules(train, styles_module):
    result = train(*STYLES, "mesh=fsdp_tp")
    spec = lambda v: tuple(v.get_value().sharding.spec)
    p = result.state.params
    # Named dimensions follow the rules (mlp -> tensor, embed -> fsdp); the first layer has no embed,
    # so FSDP takes its largest free dimension as ZeRO-3 would.
    assert spec(p["a"]["kernel"]) == ("fsdp", "tensor")
    assert spec(p["b"]["kernel"]) == ("tensor", "fsdp")
    assert spec(p["c"]) == ("fsdp", "tensor")
    assert spec(p["d"]["kernel"]) in ((), (None, None))


def test_an_unknown_logical_name_is_one_line(styles_module, tmp_path):
    done = run_cli(*STYLES, "model.width_name=wide", f"run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "logical axis 'wide' has no rule" in done.stderr


def test_without_auto_shard_an_idle_axis_is_a_warning_naming_the_largest_parameters(train, capfd):
    result = train(*STOCK["mlp"], "train.steps=1", "run.cpu_devices=8", "mesh=fsdp", "mesh.auto_shard=false")
    assert share_per_device(result.state.params) == 1.0
    err = capfd.readouterr().err
    assert "mesh axis fsdp=8 splits no parameter" in err and "l2/kernel (256, 256)" in err
    assert "nnx.with_partitioning" in err and "mesh.auto_shard=true" in err


def test_dry_run_lists_the_automatically_split_parameters(tmp_path):
    done = run_cli(*STOCK["mlp"], "run.cpu_devices=8", "mesh=fsdp", f"run.dir={tmp_path}", "--dry-run",
                   cwd=ROOT / "tests")  # where stock_models.py is
    assert done.returncode == 0, done.stderr
    assert "2 split automatically" in done.stdout
    assert "auto: l2/kernel (256, 256) -> (fsdp, None)" in done.stdout
