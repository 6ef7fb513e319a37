"""A user's own Flax NNX module, named as package.module:Class, trains under every preset."""

import textwrap

import numpy as np
import pytest

USER_MODULE = '''
import jax
import jax.numpy as jnp
from flax import nnx
from shard.nn.partition import constrain


class TinyClassifier(nnx.Module):
    """Written by a user: logical names on its parameters, nothing about meshes."""

    def __init__(self, width: int = 32, classes: int = 8, dtype=jnp.float32, act=jax.nn.relu, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (16, width)), out_sharding=("features", "mlp"))
        self.w2 = nnx.Param(init(rngs.params(), (width, classes)), out_sharding=("mlp", "classes"))
        self.norm = nnx.BatchNorm(width, rngs=rngs)  # non-parameter state rides along in the train state
        self.act = act  # a function default: not a config value, left out of the saved config

    def __call__(self, x):
        h = constrain(x @ self.w1[...], ("batch", "mlp"))
        return self.act(self.norm(h)) @ self.w2[...]
'''

ARGS = ["model.name=user_models:TinyClassifier", "model.width=32", "data.name=synthetic", "data.features=[16]",
        "data.classes=8", "data.batch_size=32", "optimizer.lr=3e-2", "train.steps=12", "run.log_every=1",
        "run.cpu_devices=8"]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)  # importable from the working directory, like `python -m`


@pytest.mark.parametrize("preset", ["dp", "fsdp", "tp", "hybrid", "fsdp_tp"])
def test_user_module_trains_under_every_preset(train, user_module, preset):
    result = train(*ARGS, f"mesh={preset}")
    curve = [r["loss"] for r in result.history]
    assert len(curve) == 12 and np.all(np.isfinite(curve))
    assert np.mean(curve[-3:]) < np.mean(curve[:3])
    mean = result.state.rest["norm"]["mean"].get_value()  # BatchNorm statistics were updated by training
    assert float(np.abs(np.asarray(mean)).sum()) > 0
    if preset == "tp":
        assert result.state.params["w1"].get_value().sharding.spec[1] == "tensor"
