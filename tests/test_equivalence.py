"""The promise, for every model in the library: the same model and seed give the same loss curve
under every mesh (float32) as on one device, and the mesh really splits the model's weights."""

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import TINY_GPT, TINY_MODELS, one_device_runs
from shard.config import MeshConfig
from shard.core import mesh as mesh_lib
from shard.nn.partition import axes_of, merged_rules, param_spec

PRESETS = ["dp", "fsdp", "tp", "hybrid", "fsdp_tp"]
# The gpt under every preset; every other model under dp and fsdp_tp (which has both model axes, so every
# large weight must be split), and the moe under ep too: each preset's rules are the same for every model,
# and the suite must stay inside CI's time.
CASES = [("gpt", preset) for preset in PRESETS] + [(model, preset) for model in TINY_MODELS if model != "gpt"
                                                   for preset in ("dp", "fsdp_tp")] + [("moe", "ep")]
STEPS = ["train.steps=12", "run.log_every=1"]
# A weight holding at least this share of a model's parameters is "large". Under every preset, a large
# weight with a dimension named for a model axis the preset has (fsdp or tensor; expert by ep's rules) must be
# split on it; under fsdp_tp, where both exist, every large weight must be split: a model must name its big
# dimensions. (What may stay whole is small: norms, biases, positions; or a layer whose only
# model-sized dimension maps to the other axis, like a classifier head (embed, classes) under tp.)
LARGE = 0.05


def losses(result) -> np.ndarray:
    return np.array([r["loss"] for r in result.history])


def variables(tree):
    return [(jax.tree_util.keystr(path), var) for path, var in
            jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
            if isinstance(var, nnx.Variable)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each model trained on one device, computed once for the module."""
    return one_device_runs(tmp_path_factory, TINY_MODELS, *STEPS)


@pytest.mark.parametrize("model,preset", CASES)
def test_every_model_matches_one_device_and_is_split_by_every_preset(train, references, model, preset):
    result = train(*TINY_MODELS[model], *STEPS, "run.cpu_devices=8", f"mesh={preset}")
    reference = references(model)
    curve, expected = losses(result), losses(reference)
    assert len(curve) == len(expected) == 12
    # it is learning, so the comparison means something (per-batch losses of 16 digits are noisy: the
    # last batch may be a hard one, so the curve's lowest point is compared with its start)
    assert min(expected[1:]) < expected[0]
    # The MoE router's top-k is a discrete choice, but a choice changes only if two router scores are
    # within rounding of each other; with these seeds none is, so the MoE is held to the same 1e-5.
    np.testing.assert_allclose(curve, expected, rtol=1e-5)
    # Non-parameter state too: BatchNorm's running statistics match one device only if they are
    # means over the global batch, not each device's share of it.
    for (path, got), (_, want) in zip(variables(result.state.rest), variables(reference.state.rest)):
        np.testing.assert_allclose(got.get_value(), want.get_value(), rtol=1e-4, atol=1e-6, err_msg=path)

    mesh = result.mesh
    params = variables(result.state.params)
    total = sum(var.get_value().size for _, var in params)
    rules = merged_rules(mesh_lib.load_preset(preset).get("rules"), mesh_lib.AXES)  # the table, as the preset sets it
    for tree in (result.state.params, result.state.opt_state):  # Adam's moments are sharded like their parameters
        for path, var in variables(tree):
            array = var.get_value()
            want, _ = param_spec(array.shape, var.get_metadata()["out_sharding"], rules, dict(mesh.shape),
                                 MeshConfig().auto_shard_min_size)
            assert array.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, want), array.ndim), path
    for path, var in params:
        array, names = var.get_value(), var.get_metadata()["out_sharding"]
        used = {a for entry in array.sharding.spec for a in (entry if isinstance(entry, tuple) else (entry,))}
        if "experts" in names and mesh.shape["expert"] > 1:
            assert "expert" in used, f"{model} under {preset}: experts of {path} are not split"
        if array.size < LARGE * total:
            continue
        # (ep's rules split the rest of the model on expert as fsdp's do on fsdp: a large weight there too)
        model_axes = {a for name in names if name for a in axes_of(rules[name])} & {"fsdp", "tensor", "expert"}
        present = {a for a in ("fsdp", "tensor", "expert") if mesh.shape[a] > 1}
        if model_axes & present or preset == "fsdp_tp":
            assert used & present, f"{model} under {preset}: {path} {array.shape} is whole on every device"
            assert array.addressable_shards[0].data.size < array.size

# Llama-style options: rotary positions, RMSNorm, SwiGLU, grouped-query attention (8 query heads
# sharing 4 key/value heads), tied embeddings; on 4 devices so the key/value heads divide every mesh.
LLAMA = [*TINY_GPT, "model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.n_kv_heads=4",
         "model.tie_embeddings=true"]


def test_llama_options_match_one_device_under_every_preset(train):
    reference = losses(train(*LLAMA, *STEPS, "run.cpu_devices=1", subdir="one"))
    assert reference[-1] < reference[0]
    for preset in PRESETS:
        curve = losses(train(*LLAMA, *STEPS, "run.cpu_devices=4", f"mesh={preset}", subdir=preset))
        np.testing.assert_allclose(curve, reference, rtol=1e-5, err_msg=preset)
