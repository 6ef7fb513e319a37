"""Mixture-of-experts Hugging Face folders (Mixtral, Qwen3-MoE, OLMoE, GPT-OSS, Llama 4's text model): tiny random
models built offline with transformers, every parameter perturbed, read into the library's MoE with dropless
routing: the same logits on one device and under fsdp, tp, fsdp_tp and ep (experts split), the same greedy tokens
(past every window and chunk), the same first training loss and load-balancing loss, and an export transformers
reads back with the same logits. Bad config values are refused in one line."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard import config  # noqa: E402
from shard.errors import UserError  # noqa: E402
from shard.hf import read  # noqa: E402
from shard.run import trainer  # noqa: E402
from shard.use import export, load  # noqa: E402

from conftest import overrides  # noqa: E402
from test_hf import (FINE_TUNE, NO_IDS, TOKENS, VOCAB, adapters_merge_as_peft_merges,  # noqa: E402
                     first_batch, jax_logits, relative, saved_folders, torch_logits)
from test_hf import test_greedy_generate_equals_transformers as greedy_generate_equals_transformers  # noqa: E402

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2)
KINDS = {  # Mixtral adds its load-balancing loss to the training loss (output_router_logits); the others not
    "mixtral": lambda T: T.MixtralForCausalLM(T.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4,
                                                              output_router_logits=True, router_aux_loss_coef=0.02)),
    "qwen3_moe": lambda T: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**COMMON, intermediate_size=64,
                                                                  moe_intermediate_size=24, num_experts=4)),
    # OLMoE: a Llama's attention with q/k norms over the whole projection, its experts renormalised here
    "olmoe": lambda T: T.OlmoeForCausalLM(T.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4,
                                                        norm_topk_prob=True, **NO_IDS)),
    # GPT-OSS (issue 59): sinks, attention biases, every other layer sliding (a window under the 16 tokens), YaRN
    # with truncate false over a short original context, its biased router and clamped experts (a limit that bites)
    "gpt_oss": lambda T: T.GptOssForCausalLM(T.GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                                            head_dim=8, sliding_window=6, swiglu_limit=0.3,
                                                            rope_parameters=GPT_OSS_ROPE, **NO_IDS)),
    "llama4_text": lambda T: T.Llama4ForCausalLM(T.Llama4TextConfig(**{**COMMON, **LLAMA4_TEXT})),
}
# Llama 4: chunks of 6 on the rotating layers, every other layer without RoPE (its queries' temperature tuned from
# position 3 on), the weightless q/k norm, the top-1 sigmoid router and a shared expert
LLAMA4_TEXT = dict(intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1,
                   head_dim=8, attention_chunk_size=6, floor_scale=4, attn_scale=0.5, no_rope_layer_interval=2,
                   **NO_IDS)
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 16, "rope_theta": 1000.0}
ROWS = np.random.default_rng(1).integers(0, VOCAB, (4, 16))
MESHES = {"one": None, "fsdp": ["mesh=fsdp", "run.cpu_devices=2"], "tp": ["mesh=tp", "run.cpu_devices=2"],
          "fsdp_tp": ["mesh=fsdp_tp", "run.cpu_devices=4"], "ep": ["mesh=ep", "run.cpu_devices=4"]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return saved_folders(KINDS, tmp_path_factory)


# OLMoE's attention is OLMo 2's (tests/test_hf.py splits it every way): one device and its experts split
@pytest.mark.parametrize("kind,mesh", [(k, m) for k in KINDS for m in MESHES if k != "olmoe" or m in ("one", "ep")])
def test_logits_equal_transformers(folders, kind, mesh):
    path, model = folders[kind]
    loaded = load.load(path, MESHES[mesh] or [], whole_mesh=mesh != "one")
    assert loaded.cfg.model.name == "moe" and loaded.cfg.model.kwargs["routing"] == "dropless"
    if mesh == "ep":  # each device holds its experts only
        w_in = loaded.model.blocks.ffn.w_in[...]
        assert w_in.addressable_shards[0].data.shape[1] == 4 // 4
    # 4 rows: every mesh splits them, each device routing its own (under ep, gathered to the experts' devices)
    assert relative(jax_logits(loaded, ROWS), torch_logits(model, ROWS)) < 1e-5


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_generate_equals_transformers(folders, kind):
    greedy_generate_equals_transformers(folders, kind)  # test_hf's check, on these folders


# OLMoE's export: below; Llama 4's: tests/test_hf_llama4.py
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_fine_tune_first_loss_and_export_round_trip(folders, kind, tmp_path):
    """One step under ep: the loss is transformers' cross-entropy and the aux loss its router_aux_loss_coef x
    load-balancing loss (Mixtral's output_router_logits; none for Qwen3-MoE); the export reads back in
    transformers with the run's logits."""
    path, model = folders[kind]
    cfg = config.load(None, overrides(tmp_path / "run", f"train.init_from={path}", "mesh=ep", "run.cpu_devices=2",
                                      "checkpoint.enabled=true", *FINE_TUNE))
    assert cfg.model.name == "moe"
    result = trainer.run(cfg)
    batch = first_batch(cfg)
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(batch["inputs"])), output_router_logits=True)
    targets = torch.tensor(np.asarray(batch["targets"])).reshape(-1).long()
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), targets)
    assert abs(result.history[0]["loss"] - float(want)) < 1e-5 * float(want)
    aux = model.config.router_aux_loss_coef * float(out.aux_loss) if model.config.output_router_logits else 0.0
    assert result.history[0]["aux_loss"] == pytest.approx(aux, rel=1e-5, abs=1e-9)

    hf = tmp_path / "hf"
    assert export.main([str(tmp_path / "run"), "--format", "hf", "--out", str(hf)]) == 0
    written = json.loads((hf / "config.json").read_text())
    assert written["model_type"] == kind and written["output_router_logits"] == model.config.output_router_logits
    again = transformers.AutoModelForCausalLM.from_pretrained(hf).float().eval()
    ours = load.load(str(tmp_path / "run"), [], whole_mesh=False)
    assert relative(torch_logits(again, TOKENS), jax_logits(ours)) < 1e-5


def test_bad_config_values_are_one_line(folders, tmp_path):
    for name, (kind, change, expected) in {
        "sparse_step": ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2, making layer 0 a dense MLP"),
        "dense_layers": ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1], making layer 1 a dense MLP"),
        "top_k": ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok=5, more than num_local_experts=4"),
        "coef": ("qwen3_moe", {"router_aux_loss_coef": "high"}, "router_aux_loss_coef='high'; transformers reads"),
        "clip": ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0; clamping the queries, keys and values is not supported"),
        "head_dim": ("olmoe", {"head_dim": 4}, "head_dim=4 x num_attention_heads=4 != hidden_size=32"),
        "bias": ("olmoe", {"attention_bias": True}, "attention_bias=true; biases on OLMoE's attention are not"),
    }.items():
        folder = tmp_path / name
        shutil.copytree(folders[kind][0], folder)
        given = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**given, **change}))
        with pytest.raises(UserError) as e:
            read.Folder(str(folder)).gpt_kwargs()
        assert expected in str(e.value) and "\n" not in str(e.value)


def test_export_refuses_what_no_family_holds_in_one_line(folders, tmp_path):
    """Capacity routing (transformers drops no token), an OLMoE with sliding windows (its attention is global), a
    Qwen3-MoE with a window on some layers only (transformers gives its window to every layer)."""
    from shard.hf import arch

    mixtral, olmoe, qwen = (read.Folder(folders[kind][0]).gpt_kwargs() for kind in ("mixtral", "olmoe", "qwen3_moe"))
    for kwargs in ({**mixtral, "routing": "capacity"}, {**olmoe, "windows": [8, 0]}, {**qwen, "windows": [8, 0]}):
        with pytest.raises(UserError, match="need routing=dropless") as e:
            arch.from_gpt(kwargs, "moe")
        assert "\n" not in str(e.value)
    assert arch.from_gpt(mixtral, "moe")["model_type"] == "mixtral"
    assert arch.from_gpt(olmoe, "moe")["model_type"] == "olmoe"
    assert arch.from_gpt({**qwen, "windows": [8, 8]}, "moe")["model_type"] == "qwen3_moe"


# Qwen3-MoE's and OLMoE's experts and router are the same modules as Mixtral's in transformers 5 (its names after
# Mixtral's block_sparse_moe -> mlp), their attention Qwen3's and OLMo 2's (tests/test_lora_peft.py)
@pytest.mark.slow  # a LoRA run under ep, then our merged model and peft's: 26 s on a loaded 2-core CPU
@pytest.mark.parametrize("kind", ["mixtral"])
def test_lora_adapters_load_in_peft(folders, kind, tmp_path, capsys):
    """LoRA on attention, the experts and the router (a step from the folder, under ep); --adapters-only is
    PEFT's folder (the experts' and router's on transformers' stacked parameters: target_parameters) and peft runs
    it over the folder's model with the logits of our merged one."""
    peft = pytest.importorskip("peft")
    import shard

    path, _ = folders[kind]
    cfg = config.load(None, overrides(tmp_path / "run", f"train.init_from={path}", *MESHES["ep"],
                                      "checkpoint.enabled=true", "train.lora.rank=2", "train.lora.alpha=3",
                                      "train.lora.targets=[q,v,o,mlp,router]", "optimizer.lr=3e-2",
                                      *FINE_TUNE))
    trainer.run(cfg)
    assert export.main([str(tmp_path / "run"), "--adapters-only", "--out", str(tmp_path / "peft")]) == 0
    assert "7 adapted weights" in capsys.readouterr().out
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]
    assert written["rank_pattern"] == {"mlp.experts.gate_up_proj": 4}  # gate's and up's pairs side by side

    base = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    untouched = torch_logits(base, TOKENS)
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    assert tuned.base_model.model.model.layers[0].mlp.experts.base_layer.r["default"] == 4  # peft warns it unused
    ours = np.asarray(shard.load_model(str(tmp_path / "run"))(TOKENS))
    assert relative(torch_logits(tuned, TOKENS), ours) < 1e-5
    assert relative(untouched, ours) > 1e-3  # the adapters matter


@pytest.mark.parametrize("kind", list(KINDS))
def test_any_adapters_are_peft_weights_of_our_merged_model(folders, kind, tmp_path):
    """Random adapters on parts of each family (up alone in gate_up_proj; gate with down, router and attention):
    peft's merged weights are those of our merged model written as a folder, whatever the parts."""
    adapters_merge_as_peft_merges(folders[kind][0], "moe", [["w_in"], ["w_gate", "w_out", "router", "q", "o"]],
                                  tmp_path)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("gpt_oss", "llama4_text")])  # only ever stacked
def test_stacked_experts_read_and_write_back_per_expert(folders, kind, tmp_path):
    """transformers 5's own layout (save_pretrained(save_original_format=False)): each layer's experts one 3-D
    tensor per matrix, gate and up side by side in gate_up_proj, under mlp: read bitwise as the per-expert
    folder, each device's experts sliced out (ep); written back in the per-expert layout, tensor for tensor the
    folder transformers saved, and read by transformers with its model's logits."""
    from flax import nnx
    from safetensors.numpy import load_file

    from shard.hf import tables, write

    path, model = folders[kind]
    model.save_pretrained(tmp_path / "stacked", save_original_format=False)
    assert read.Folder(str(tmp_path / "stacked")).table == tables.FUSED[kind]
    want = read.flat_paths(nnx.state(load.load(path, [], whole_mesh=False).model, nnx.Param))
    loaded = load.load(str(tmp_path / "stacked"), MESHES["ep"])
    got = read.flat_paths(nnx.state(loaded.model, nnx.Param))
    assert want.keys() == got.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)

    write.write_folder(nnx.state(loaded.model, nnx.Param), "moe", loaded.cfg.model.kwargs, tmp_path / "out", None)
    theirs, ours = (load_file(f"{folder}/model.safetensors") for folder in (path, tmp_path / "out"))
    assert theirs.keys() == ours.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert again.config.model_type == kind
    np.testing.assert_array_equal(torch_logits(again, TOKENS), torch_logits(model, TOKENS))


@pytest.mark.slow  # two runs: 28 s on a loaded 2-core CPU
def test_fsdp_with_grad_accum_gives_the_one_device_curve(folders, train):
    """Four fine-tuning steps of the Mixtral folder (dropless routing) under fsdp with two accumulated microbatches:
    the one-device curve. Without the load-balancing loss (the Hub's Mixtral configs leave output_router_logits
    off): a microbatch's is its own batch's, as in transformers' Trainer (docs/meshes.md)."""
    base = [f"train.init_from={folders['mixtral'][0]}", *FINE_TUNE, "train.steps=4", "run.log_every=1",
            "optimizer.lr=1e-2", "model.aux_loss_weight=0"]
    one = [r["loss"] for r in train(*base, "run.cpu_devices=1", subdir="one").history]
    many = [r["loss"] for r in train(*base, "mesh=fsdp", "run.cpu_devices=2", "train.grad_accum=2",
                                     subdir="many").history]
    np.testing.assert_allclose(many, one, rtol=1e-5)
    assert one[-1] < one[0]
