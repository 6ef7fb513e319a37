"""An error raised while the step is traced is told by its real cause: the user's line where the model fails,
the loss only where the loss is what fails. A Flax Linen model with batch statistics, through nnx.bridge,
trains with the one-device curve."""

import textwrap

import numpy as np
import pytest

from conftest import ROOT, run_cli
from shard.errors import UserError

BUGS = '''
import jax
import numpy as np
from flax import nnx


class ShapeBug(nnx.Module):
    def __init__(self, in_features: int = 16, classes: int = 8, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(in_features, 32, rngs=rngs)
        self.l2 = nnx.Linear(24, classes, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))  # FORWARD: 32 features into a layer that takes 24


class NoGradient(nnx.Module):
    """Runs forward; has no gradient (a host callback has no derivative): only the train step finds out."""

    def __init__(self, in_features: int = 16, classes: int = 8, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(in_features, classes, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        return jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(h.shape, h.dtype), h)  # GRADIENT
'''
SYNTHETIC = ["data.name=synthetic", "data.features=[16]", "data.classes=8", "data.batch_size=32", "train.steps=1"]


def line_of(marker: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(BUGS).splitlines(), 1) if marker in line)


@pytest.fixture
def bugs(tmp_path, monkeypatch):
    (tmp_path / "trace_bugs.py").write_text(textwrap.dedent(BUGS))
    monkeypatch.chdir(tmp_path)  # importable from the working directory, like `python -m`


def refusal(train, *args) -> str:
    with pytest.raises(UserError) as caught:
        train(*args)
    message = str(caught.value)
    assert "\n" not in message, message  # one line on the command line
    return message


def test_a_bug_in_the_forward_pass_names_its_line_not_the_loss(train, bugs):
    message = refusal(train, "model.name=trace_bugs:ShapeBug", *SYNTHETIC)
    assert "train.loss" not in message, message
    assert "model 'trace_bugs:ShapeBug' failed on a batch" in message
    assert "TypeError: dot_general requires contracting dimensions to have the same shape" in message
    assert f"trace_bugs.py:{line_of('FORWARD')} in __call__: return self.l2(" in message


def test_a_bug_only_the_gradient_meets_names_its_line_not_the_loss(train, bugs):
    message = refusal(train, "model.name=trace_bugs:NoGradient", *SYNTHETIC)
    assert "train.loss" not in message, message
    assert "model 'trace_bugs:NoGradient' fails in the train step" in message
    assert "JVP" in message and f"trace_bugs.py:{line_of('GRADIENT')} in __call__" in message


def test_a_loss_that_does_not_fit_the_outputs_is_still_named(train):
    message = refusal(train, "model.name=stock_models:StockMLP", "model.in_features=16", "model.classes=8",
                      *SYNTHETIC, "train.loss=mse")
    assert message.startswith("train.loss=mse does not fit outputs (32, 8) and targets (32,) int32"), message
    assert "TypeError" in message and "reshape" in message


LINEN = ["model.name=stock_models:LinenBatchNormMLP", "data.name=synthetic", "data.features=[16]", "data.classes=8",
         "data.batch_size=32", "optimizer.lr=3e-2", "train.steps=6", "run.log_every=1"]


def test_a_linen_batchnorm_model_through_the_bridge_trains_with_the_one_device_curve(train):
    one = train(*LINEN, "run.cpu_devices=1", subdir="one")
    curve = [r["loss"] for r in one.history]
    assert curve[-1] < curve[0]
    stats = lambda result: np.asarray(result.state.rest["net"]["BatchNorm_0"]["mean"].get_value())
    assert np.abs(stats(one)).sum() > 0  # the step updated the batch statistics
    for mesh in (["run.cpu_devices=4", "mesh=fsdp"], ["run.cpu_devices=2", "mesh=dp"]):
        many = train(*LINEN, *mesh, subdir=mesh[1].replace("=", "_"))
        np.testing.assert_allclose([r["loss"] for r in many.history], curve, rtol=2e-5)
        np.testing.assert_allclose(stats(many), stats(one), rtol=1e-4, atol=1e-6)  # over the global batch
        assert many.eval["eval_loss"] == pytest.approx(one.eval["eval_loss"], rel=2e-5)


def test_a_linen_batchnorm_called_without_mutable_stats_is_one_line_saying_what_to_change(tmp_path):
    done = run_cli("model.name=stock_models:LinenBatchNormImmutable", *SYNTHETIC, f"run.dir={tmp_path / 'run'}",
                   cwd=ROOT / "tests")  # where stock_models.py is
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "train.loss" not in done.stderr
    assert 'ModifyScopeVariableError: Cannot update variable "mean"' in done.stderr
    assert "stock_models.py:" in done.stderr and "mutable=['batch_stats']" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_kernel_lowering_that_refuses_the_shapes_is_one_line_naming_the_kernels_that_take_any():
    """A Pallas kernel's lowering raises NotImplementedError where its tiles do not fit (tokamax's H100 grouped
    product at d_model 96: `WGMMA rhs swizzle must match lhs swizzle`), with no frame of the user's: a traceback
    before; now the step's one line, and what to choose instead."""
    import jax

    from shard.core.blame import blamed

    def raised_in_jax(error: str):  # the whole block in JAX's own frames: no line of the user's in its traceback
        pallas = f"{jax.__path__[0]}/_src/pallas/mosaic_gpu/lowering.py"
        exec(compile(f"with blamed('the step'):\n    raise {error}", pallas, "exec"), {"blamed": blamed})

    with pytest.raises(UserError, match=r"^the step: NotImplementedError: WGMMA .*train.grouped_matmul=tiled"):
        raised_in_jax("NotImplementedError('WGMMA rhs swizzle must match lhs swizzle')")
    with pytest.raises(KeyError):  # a fault of ours or JAX's stays a traceback
        raised_in_jax("KeyError('x')")
