"""GPT-OSS beyond what tests/test_hf_moe.py checks of every MoE family (logits on every mesh, generation, export,
adapters): its checkpoints' MXFP4 experts read as transformers dequantizes them, and the real gpt-oss-20b
config.json read as transformers reads it (its YaRN without truncation, frequency for frequency)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from shard.errors import UserError  # noqa: E402
from shard.hf import read  # noqa: E402
from shard.use import load  # noqa: E402

from test_hf import jax_logits, relative, saved_folders, torch_logits  # noqa: E402
from test_hf_moe import KINDS, MESHES, ROWS  # noqa: E402

REAL = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf" / "gpt-oss-20b"
PACKED = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """The tiny GPT-OSS folder with its experts replaced by random MXFP4 blocks and scales (as the Hub's checkpoints
    hold them), and transformers' model with its own dequantization of them (integrations/mxfp4.py)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, model = saved_folders({"gpt_oss": KINDS["gpt_oss"]}, tmp_path_factory)["gpt_oss"]
    folder = tmp_path_factory.mktemp("mxfp4")
    tensors = load_file(f"{path}/model.safetensors")
    rng = np.random.default_rng(2)
    for i, layer in enumerate(model.model.layers):
        for name in PACKED:
            key = f"model.layers.{i}.mlp.experts.{name}"
            n, into, out = tensors.pop(key).shape  # (experts, in, out): packed along in, 32 values a scale
            blocks = rng.integers(0, 256, (n, out, into // 32, 16), dtype=np.uint8)
            scales = rng.integers(118, 125, (n, out, into // 32), dtype=np.uint8)  # 2^-9 .. 2^-3
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            weight = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32)
            with torch.no_grad():
                getattr(layer.mlp.experts, name).copy_(weight)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder), model


@pytest.mark.parametrize("mesh", ["one", "ep"])
def test_mxfp4_experts_give_transformers_logits(mxfp4, mesh):
    path, model = mxfp4
    loaded = load.load(path, MESHES[mesh] or [], whole_mesh=mesh != "one")
    assert relative(jax_logits(loaded, ROWS), torch_logits(model, ROWS)) < 1e-5


def test_mxfp4_exports_as_plain_tensors_transformers_reads(mxfp4, tmp_path):
    """The export holds the dequantized experts (the run's dtype, no quantization_config): transformers reads it
    without any MXFP4 support, with the same logits."""
    from flax import nnx

    from shard.hf import write

    path, model = mxfp4
    loaded = load.load(path, [], whole_mesh=False)
    write.write_folder(nnx.state(loaded.model, nnx.Param), "moe", loaded.cfg.model.kwargs, tmp_path / "out", None,
                       source=read.Folder(path))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gpt_oss"
    assert not any(n.endswith(("_blocks", "_scales")) for n in load_file(tmp_path / "out" / "model.safetensors"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert relative(torch_logits(again, ROWS), torch_logits(model, ROWS)) < 1e-6


def test_mxfp4_bad_folders_are_one_line(mxfp4, tmp_path):
    path, _ = mxfp4
    cases = {"method": ({"quant_method": "bitsandbytes"}, None, "quant_method='bitsandbytes'; only mxfp4"),
             "blocks": (None, np.zeros((4, 64, 1, 8), np.uint8), "are not MXFP4 blocks")}
    for name, (quantization, blocks, expected) in cases.items():
        folder = tmp_path / name
        shutil.copytree(path, folder)
        if quantization is not None:
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
        if blocks is not None:
            tensors = load_file(folder / "model.safetensors")
            tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] = blocks
            save_file(tensors, folder / "model.safetensors")
        with pytest.raises(UserError) as e:
            load.load(str(folder), [], whole_mesh=False)
        assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(not REAL.is_dir(), reason=f"the real config files are not here ({REAL})")
def test_real_gpt_oss_20b_config_reads_as_transformers_reads_it():
    """gpt-oss-20b's config.json: 32 experts, 4 a token, every other layer sliding by 128 (the first), sinks and
    attention biases, the clamped SwiGLU, and YaRN with truncate false whose frequencies are transformers' own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shard.models import rope

    kwargs = read.Folder(str(REAL), weights=False).gpt_kwargs()
    theirs = transformers.AutoConfig.from_pretrained(REAL)
    assert (kwargs["n_experts"], kwargs["top_k"], kwargs["n_layers"]) == (32, 4, 24)
    assert kwargs["windows"] == [128 if t == "sliding_attention" else 0 for t in theirs.layer_types]
    assert kwargs["windows"][:2] == [128, 0] and kwargs["attn_sinks"] and kwargs["attn_bias"]
    assert (kwargs["swiglu_limit"], kwargs["swiglu_alpha"]) == (theirs.swiglu_limit, theirs.swiglu_alpha)
    assert (kwargs["router"], kwargs["router_bias"], kwargs["expert_bias"]) == ("topk_softmax", True, True)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    ours = rope.make(kwargs["rope_theta"], kwargs["rope_scaling"])
    np.testing.assert_allclose(np.asarray(ours.frequencies(kwargs["head_dim"] // 2)), inv_freq.numpy(), rtol=1e-6)
    assert ours.yarn[4] == pytest.approx(factor) and kwargs["rope_scaling"]["truncate"] is False
    rounded = rope.make(kwargs["rope_theta"], {**kwargs["rope_scaling"], "truncate": True})
    assert np.max(np.abs(np.asarray(rounded.frequencies(32)) - inv_freq.numpy()) / inv_freq.numpy()) > 1e-3


def test_the_newer_attention_options_export_only_as_their_family():
    """Sinks, attention biases alone, interleaved RoPE, chunks and temperature tuning are GPT-OSS's or Llama 4's: a
    dense GPT with any of them, or one family's MoE with the other's, is refused in one line, never written as a
    folder transformers would read without them."""
    from shard.hf import arch

    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, position="rope", norm="rmsnorm", mlp="swiglu")
    oss = dict(base, n_experts=4, top_k=2, routing="dropless", router="topk_softmax", router_bias=True,
               expert_bias=True, swiglu_limit=7.0, attn_sinks=True)
    assert arch.from_gpt(oss, "moe")["model_type"] == "gpt_oss"
    for kwargs, name in ((dict(base, attn_sinks=True), "gpt"), (dict(base, attn_bias=True), "gpt"),
                         (dict(base, rope_interleaved=True), "gpt"), (dict(base, chunks=[6, 0]), "gpt"),
                         (dict(base, rope_layers=[1, 0], attn_temperature_floor=4.0), "gpt"),
                         (dict(oss, chunks=[6, 0]), "moe"), (dict(oss, rope_interleaved=True), "moe")):
        with pytest.raises(UserError, match="--format hf: model") as e:
            arch.from_gpt(kwargs, name)
        assert "\n" not in str(e.value)
