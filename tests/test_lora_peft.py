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


# and OLMo 2 (issue 47), whose blocks differ most from Llama's around the adapted weights: q/k norms over the whole
# projection, norms after each sublayer (the other new families' adapted Linears are Llama's too)
FAMILIES = {"llama": [], "olmo2": ["model.qk_norm=projection", "model.norms=post"]}


@pytest.mark.parametrize("family", list(FAMILIES))
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
    assert sorted(config.target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    np.testing.assert_allclose(logits_of(tuned, tokens), ours, atol=2e-4, rtol=1e-4)
    assert np.abs(untouched - ours).max() > 1e-2  # the adapters matter
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_merged").eval()
    np.testing.assert_allclose(logits_of(merged, tokens), ours, atol=2e-4, rtol=1e-4)


def test_adapters_only_refuses_a_run_without_adapters(train, tmp_path):
    from shard.errors import UserError

    train(*LLAMA, "train.steps=1", subdir="base")
    with pytest.raises(UserError, match="trained no adapters"):
        export.main([str(tmp_path / "base"), "--adapters-only", "--out", str(tmp_path / "out")])



def test_adapters_only_refuses_phi3s_fused_projections_in_one_line():
    """Phi-3's q, k and v (and gate and up) are one fused Linear each: PEFT's one adapter pair there is not our
    separate ones. Its output projection is a Linear of its own."""
    from types import SimpleNamespace

    from shard.errors import UserError
    from shard.hf import peft as hf_peft

    def site(path, pick=None):
        return SimpleNamespace(path=tuple(path.split(".")), weight=SimpleNamespace(pick=pick), target=path)

    for path, pick in (("blocks.attn.q", None), ("blocks.attn.kv", 1), ("blocks.ffn.w_gate", None)):
        with pytest.raises(UserError, match="part of phi3's fused model.layers.N.") as e:
            hf_peft.row_for("phi3", site(path, pick))
        assert "\n" not in str(e.value)
    assert hf_peft.row_for("phi3", site("blocks.attn.out")).theirs == "model.layers.{i}.self_attn.o_proj.weight"
