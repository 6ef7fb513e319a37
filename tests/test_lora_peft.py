"""A LoRA run's exports as Hugging Face reads them: --adapters-only is a folder that `peft` loads over the base
model (exported with --format hf) and runs as our merged model; --format hf of the LoRA run is that merged model."""

import numpy as np
import pytest

import shard
from conftest import TINY_GPT
from shard.use import export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LLAMA = [*TINY_GPT, "model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.n_kv_heads=4",
         "train.steps=3", "checkpoint.enabled=true", "optimizer.lr=3e-2"]


def logits_of(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


# Llama's separate projections and Phi-3's fused qkv_proj and gate_up_proj (a GPT with half of each head rotated:
# our pairs side by side at ranks 3r and 2r, their scale kept); every other family's names are Llama's
# (tests/test_hf.py's random adapters, merged by peft as ours), the mixtures' experts tests/test_hf_moe.py's
FAMILIES = {"llama": [], "phi3": ["model.rotary_dim=2"]}
MODULES = {"llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
           "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]}
PARTS = {"llama": {}, "phi3": {"qkv_proj": 3, "gate_up_proj": 2}}  # our weights in one of their Linears


@pytest.mark.parametrize("family", ["llama", pytest.param("phi3", marks=pytest.mark.slow)])  # 35 s on a loaded CPU
def test_peft_runs_the_adapters_as_our_merged_model(train, tmp_path, capsys, family):
    base = [*LLAMA, *FAMILIES[family]]
    train(*base, subdir="base")
    train(*base, "train.lora.rank=4", "train.lora.alpha=6", "train.lora.targets=[q,k,v,o,mlp]",
          f"train.init_from={tmp_path / 'base'}", subdir="tuned")
    export.main([str(tmp_path / "base"), "--format", "hf", "--out", str(tmp_path / "hf_base")])
    export.main([str(tmp_path / "tuned"), "--adapters-only", "--out", str(tmp_path / "adapters")])
    export.main([str(tmp_path / "tuned"), "--format", "hf", "--out", str(tmp_path / "hf_merged")])
    assert "7 adapted weights" in capsys.readouterr().out  # q, k, v, o, gate, up, down (stacked over layers)

    tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
    ours = np.asarray(shard.load_model(str(tmp_path / "tuned"))(tokens))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base").eval()
    assert base.config.model_type == family
    untouched = logits_of(base, tokens)
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    config = tuned.peft_config["default"]
    assert (config.r, config.lora_alpha) == (4, 6)
    assert sorted(config.target_modules) == MODULES[family]
    assert (config.rank_pattern, config.alpha_pattern) == ({k: 4 * n for k, n in PARTS[family].items()},
                                                           {k: 6 * n for k, n in PARTS[family].items()})
    np.testing.assert_allclose(logits_of(tuned, tokens), ours, atol=2e-4, rtol=1e-4)
    assert np.abs(untouched - ours).max() > 1e-2  # the adapters matter
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_merged").eval()
    np.testing.assert_allclose(logits_of(merged, tokens), ours, atol=2e-4, rtol=1e-4)


def test_adapters_only_refuses_a_run_without_adapters(train, tmp_path):
    from shard.errors import UserError

    train(*LLAMA, "train.steps=1", subdir="base")
    with pytest.raises(UserError, match="trained no adapters"):
        export.main([str(tmp_path / "base"), "--adapters-only", "--out", str(tmp_path / "out")])


