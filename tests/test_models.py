"""Model-level checks that hold on any mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.gpt import GPT, rotary


def test_rotary_scores_depend_only_on_relative_position():
    q = jnp.tile(jax.random.normal(jax.random.key(0), (1, 1, 1, 8)), (1, 6, 1, 1))
    k = jnp.tile(jax.random.normal(jax.random.key(1), (1, 1, 1, 8)), (1, 6, 1, 1))
    qr, kr = rotary(q, 10000.0), rotary(k, 10000.0)
    score = lambda m, n: float(jnp.dot(qr[0, m, 0], kr[0, n, 0]))
    assert score(3, 1) == pytest.approx(score(4, 2), rel=1e-5) == pytest.approx(score(5, 3), rel=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(qr, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)


def test_llama_options_build_and_run():
    with nnx.use_eager_sharding(False):
        model = GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2, position="rope", norm="rmsnorm",
                    mlp="swiglu", d_ff=48, tie_embeddings=True, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert model.head is None and model.pos is None  # tied output layer, no learned positions
    assert params["blocks"]["attn"]["kv"].get_value().shape == (2, 32, 2, 2, 4)  # 2 layers, 2 key/value heads
    assert model(jnp.zeros((2, 10), jnp.int32)).shape == (2, 10, 64)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        GPT(n_heads=8, n_kv_heads=3, d_model=32, rngs=nnx.Rngs(0))


def test_causal_mask_hides_the_future():
    with nnx.use_eager_sharding(False):
        model = GPT(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=8, rngs=nnx.Rngs(0))
    a = model(jnp.array([[1, 2, 3, 4, 5, 6]]))
    b = model(jnp.array([[1, 2, 3, 9, 9, 9]]))
    np.testing.assert_allclose(a[0, :3], b[0, :3], rtol=1e-6)  # positions before the change are unaffected
    assert not np.allclose(a[0, 3:], b[0, 3:])


def test_layers_are_scanned_and_remat_policies_change_memory_not_results(train):
    from conftest import TINY_GPT

    runs = {r: train(*TINY_GPT, "model.n_layers=3", "train.steps=3", "run.log_every=1", f"train.remat={r}",
                     "run.cpu_devices=2", "mesh=fsdp", subdir=r) for r in ("none", "full", "dots")}
    curves = {r: [h["loss"] for h in result.history] for r, result in runs.items()}
    np.testing.assert_allclose(curves["full"], curves["none"], rtol=1e-5)
    np.testing.assert_allclose(curves["dots"], curves["none"], rtol=1e-5)
    hlo = runs["none"].train_step.as_text()
    assert "while" in hlo  # one block in a loop, not three copies
    w = runs["none"].state.params["blocks"]["mlp"]["w_in"].get_value()
    assert w.shape == (3, 32, 64) and w.sharding.spec[0] is None  # the layers axis stays whole
    temp = {r: result.train_step.memory_analysis().temp_size_in_bytes for r, result in runs.items()}
    assert temp["full"] < temp["none"]  # recomputing the layer keeps fewer activations
