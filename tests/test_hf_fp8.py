"""Fine-grained FP8 checkpoints (DeepSeek-V3's format, Qwen3's -FP8 folders): a tiny Qwen3 folder whose Linear
weights are float8 e4m3 with a scale per 16 x 16 block, read dequantized; transformers, told to dequantize the same
folder (FineGrainedFP8Config(dequantize=True)), gives the same logits; an uneven grid is refused in one line."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from shard.errors import UserError  # noqa: E402
from shard.hf import read  # noqa: E402
from shard.use import load  # noqa: E402

from test_hf import TOKENS, jax_logits, relative, saved_folders, torch_logits  # noqa: E402

BLOCK = 16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """The tiny Qwen3 of tests/test_hf.py with every layer's Linear weights stored in FP8, a scale per block."""
    from test_hf import KINDS

    path, _ = saved_folders({"qwen3": KINDS["qwen3"]}, tmp_path_factory)["qwen3"]
    folder = tmp_path_factory.mktemp("fp8")
    tensors = load_file(f"{path}/model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        w = tensors[name].float()
        rows, cols = w.shape[0] // BLOCK, w.shape[1] // BLOCK
        blocks = w.reshape(rows, BLOCK, cols, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # e4m3's largest value at each block's largest weight
        codes = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = codes, scale.float()
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_fp8_weights_read_as_transformers_dequantizes_them(fp8_folder):
    ours = jax_logits(load.load(str(fp8_folder), [], whole_mesh=False))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        fp8_folder, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.float32)
    assert relative(ours, torch_logits(theirs.eval(), TOKENS)) < 1e-5


def test_an_fp8_scale_grid_that_splits_no_whole_blocks_is_one_line(fp8_folder, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(fp8_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.weight_scale_inv"))
    tensors[name] = torch.ones(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(UserError, match="not an FP8 weight and its scales") as e:
        load.load(str(folder), [], whole_mesh=False)
    assert "\n" not in str(e.value)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(UserError, match="quant_method='awq'; only mxfp4"):
        read.Folder(str(folder))
