"""Each loss against a computation by hand."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from shard.core import losses
from shard.errors import UserError


def test_mse():
    assert float(losses.mse(jnp.array([[1.0], [3.0]]), jnp.array([[0.0], [1.0]]))) == pytest.approx((1 + 4) / 2)


def test_binary_crossentropy_from_logits():
    logits, targets = jnp.array([0.0, 2.0]), jnp.array([1.0, 0.0])
    expected = (math.log(2) + (2 + math.log1p(math.exp(-2)))) / 2  # -log(sigmoid(0)), -log(1 - sigmoid(2))
    assert float(losses.binary_crossentropy(logits, targets)) == pytest.approx(expected, rel=1e-6)


def test_sparse_and_categorical_crossentropy_agree_with_hand_softmax():
    logits = jnp.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    p = np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum()
    expected = (-math.log(p[2]) + math.log(3)) / 2
    assert float(losses.sparse_categorical_crossentropy(logits, jnp.array([2, 0]))) == pytest.approx(expected, rel=1e-6)
    one_hot = jnp.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(losses.categorical_crossentropy(logits, one_hot)) == pytest.approx(expected, rel=1e-6)
    multi = jnp.array([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])  # multi-label targets
    expected_multi = (-(0.5 * math.log(p[1]) + 0.5 * math.log(p[2])) + math.log(3)) / 2
    assert float(losses.categorical_crossentropy(logits, multi)) == pytest.approx(expected_multi, rel=1e-6)


def test_categorical_hinge():
    outputs, targets = jnp.array([[0.2, 0.9, 0.1], [2.0, 0.5, 0.0]]), jnp.array([[1.0, 0, 0], [1.0, 0, 0]])
    expected = (max(0, 0.9 - 0.2 + 1) + max(0, 0.5 - 2.0 + 1)) / 2
    assert float(losses.categorical_hinge(outputs, targets)) == pytest.approx(expected)


def test_squared_hinge_maps_zero_one_targets_to_signs():
    outputs, targets = jnp.array([0.3, -2.0, 0.5]), jnp.array([1.0, 0.0, 0.0])
    expected = ((1 - 0.3) ** 2 + 0 + (1 + 0.5) ** 2) / 3
    assert float(losses.squared_hinge(outputs, targets)) == pytest.approx(expected)


def test_task_defaults_and_unknown_name():
    assert losses.resolve("auto", "regression") is losses.mse
    assert losses.resolve("auto", "binary") is losses.binary_crossentropy
    assert losses.resolve("auto", "lm") is losses.sparse_categorical_crossentropy
    with pytest.raises(UserError, match="unknown train.loss 'huber'"):
        losses.resolve("huber", "regression")
