"""The promise: the same model and seed give the same loss curve under every mesh (float32)."""

import numpy as np
import pytest

from conftest import TINY_GPT, TINY_MLP

PRESETS = ["dp", "fsdp", "tp", "hybrid", "fsdp_tp"]
STEPS = ["train.steps=12", "run.log_every=1"]


def losses(result) -> np.ndarray:
    return np.array([r["loss"] for r in result.history])


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    from shard import config, trainer
    from conftest import overrides

    out = {}
    for name, model in (("gpt", TINY_GPT), ("mlp", TINY_MLP)):
        cfg = config.load(None, overrides(tmp_path_factory.mktemp(name), *model, *STEPS, "run.cpu_devices=1"))
        out[name] = losses(trainer.run(cfg))
    return out


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_loss_curve_matches_one_device(train, references, model, preset):
    args = TINY_GPT if model == "gpt" else TINY_MLP
    result = train(*args, *STEPS, "run.cpu_devices=8", f"mesh={preset}")
    curve, reference = losses(result), references[model]
    assert len(curve) == len(reference) == 12
    assert reference[-1] < reference[0]  # it is learning, so the comparison means something
    np.testing.assert_allclose(curve, reference, rtol=1e-5)


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
