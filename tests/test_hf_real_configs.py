"""Hugging Face folders as users bring them. Every real config.json in ../shared/fixtures/hf (byte for byte as
published) becomes a tiny random model, built by transformers with every field kept but the sizes: a
supported one loads with transformers' logits and exports back to a folder transformers reads with them, the
others are refused in one line. Then what a folder may hold beyond the plain case: biases on the MLP, tied
pairs stored either way, a base model's names, buffers, tensors nothing reads; and what an export writes:
the source's dtype, its generation_config.json, its --out's missing parents."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

FIXTURES = Path(__file__).resolve().parents[2] / "shared/fixtures/hf"
if not FIXTURES.is_dir():
    pytest.skip(f"{FIXTURES} is absent (a clone without ../shared): the real config.json files are not here",
                allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import shard  # noqa: E402
from shard import config  # noqa: E402
from shard.errors import UserError  # noqa: E402
from shard.hf import arch, write  # noqa: E402
from shard.hf.read import Folder  # noqa: E402
from shard.run import trainer  # noqa: E402
from shard.use import export, generate  # noqa: E402

from conftest import ROOT, overrides, subprocess_env  # noqa: E402

VOCAB, HEAD_DIM, WINDOW = 512, 16, 8
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 24))  # longer than WINDOW: a sliding window is cut
REAL = {p.parent.name: json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*/config.json"))}
SUPPORTED = [name for name, c in REAL.items() if c["model_type"] in arch.SUPPORTED]
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def tiny(real: dict) -> dict:
    """`real` with 2 layers (one period of a layer pattern where there is one: Gemma 3's 5 local layers then a
    global one), a 512-token vocabulary, heads of 16 and windows of 8 tokens, the same number of query heads per
    KV head and the same MLP-to-width ratio; every other field as published (RoPE scaling, eps, tying, biases,
    activation, which layers slide). Special token ids past the vocabulary are taken modulo it."""
    c = dict(real)
    heads = c["num_attention_heads"]
    group = heads // (c.get("num_key_value_heads") or heads)
    kv = max(1, min(heads // group, 4 // group))
    width = kv * group * HEAD_DIM
    c.update(num_hidden_layers=c.get("sliding_window_pattern") or 2, vocab_size=VOCAB, num_attention_heads=kv * group,
             num_key_value_heads=kv, hidden_size=width,
             intermediate_size=round(c["intermediate_size"] / c["hidden_size"] * width))
    if c.get("head_dim"):
        c["head_dim"] = HEAD_DIM
    if c.get("sliding_window"):
        c["sliding_window"] = min(c["sliding_window"], WINDOW)
    for key in ("layer_types", "no_rope_layers"):
        if key in c:  # the last two: where a repeating pattern ends (SmolLM3's rope-less 4th layer)
            c[key] = c[key][-2:]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if c.get(key) is not None:
            c[key] = [i % VOCAB for i in c[key]] if isinstance(c[key], list) else c[key] % VOCAB
    if c["model_type"] == "deepseek_v3":  # its experts and latents scaled down too; its FP8 format is test_hf_fp8.py's
        for key in ("quantization_config", "auto_map"):
            c.pop(key, None)
        c.update(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                 moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=HEAD_DIM // 2,
                 qk_rope_head_dim=HEAD_DIM // 4, v_head_dim=HEAD_DIM // 2)
    return c


def build(path: Path, c: dict, seed: int = 0, dtype=None):
    """A random model of config `c`, every parameter (norms and biases too) moved off its initial value so that
    a mix-up shows, saved into `path`; returns transformers' own float32 reading of the folder."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**c)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    (model if dtype is None else model.to(dtype)).save_pretrained(path)
    return reread(path)


def reread(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def ours(path) -> tuple[nnx.Module, np.ndarray]:
    model = shard.load_model(str(path))
    return model, np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS)))


def relative(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def refusal(path) -> str:
    with pytest.raises(UserError) as e:
        shard.load_model(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, transformers' model of it), built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, build(path, tiny(REAL[name])))
            if (FIXTURES / name / "generation_config.json").is_file():  # (OLMo 3.1's fixture has none)
                shutil.copyfile(FIXTURES / name / "generation_config.json", path / "generation_config.json")
        return cache[name]
    return get


def test_the_fixtures_hold_the_configs_this_file_is_about():
    assert {"llama-2-7b-hf", "llama-3.2-3b-instruct", "gemma-2b-it", "deepseek-r1-distill-qwen-32b", "qwen3-4b",
            "smollm3-3b", "gemma-3-1b-it"} <= set(SUPPORTED)
    assert REAL["gemma-2b-it"]["hidden_act"] == "gelu"  # the legacy value transformers reads as tanh GELU
    assert REAL["llama-3.2-3b-instruct"]["rope_scaling"]["rope_type"] == "llama3"
    # Gemma 3's tiny model keeps its pattern, a global layer after 5 local ones, whose windows TOKENS pass
    assert transformers.AutoConfig.for_model(**tiny(REAL["gemma-3-1b-it"])).layer_types == \
        ["sliding_attention"] * 5 + ["full_attention"]
    assert arch.to_gpt(tiny(REAL["gemma-3-1b-it"]), "g")["windows"] == [WINDOW] * 5 + [0] and WINDOW < TOKENS.shape[1]


def test_olmo3s_windows_and_rope_per_layer_type_read_as_its_config_class_gives_them():
    """OLMo-3.1-32B: a window on three layers of four, YaRN on the global layers alone, the local ones unscaled."""
    real = REAL["olmo-3.1-32b-instruct"]
    c = transformers.AutoConfig.for_model(**real)
    got = arch.to_gpt(real, "o")
    sliding = [t == "sliding_attention" for t in c.layer_types]
    assert sliding == [i % 4 != 3 for i in range(64)]
    assert got["windows"] == [c.sliding_window if s else 0 for s in sliding]
    assert got["rope_layers"] == [2 if s else 1 for s in sliding]
    full, local = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
    assert (local["rope_type"], got["local_rope_theta"], got["rope_theta"]) == ("default", local["rope_theta"],
                                                                                 full["rope_theta"])
    assert got["rope_scaling"] == {"rope_type": "yarn", **{k: full[k] for k in (
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor")}}
    assert arch.to_gpt(arch.from_gpt(got, "gpt"), "again") == got


@pytest.mark.parametrize("name", SUPPORTED)
def test_a_real_config_loads_with_transformers_logits_and_exports_back(folders, name, tmp_path):
    path, model = folders(name)
    want = torch_logits(model)
    loaded, got = ours(path)
    assert relative(got, want) < 1e-5
    out = tmp_path / "out"
    source = Folder(str(path))
    _, params, rest = nnx.split(loaded, nnx.Param, ...)  # (rest: what else a folder holds, DeepSeek's corrections)
    kwargs = source.gpt_kwargs()
    write.write_folder(params, arch.model_name(source.kind, kwargs), kwargs, out, None, source=source, rest=rest)
    assert relative(torch_logits(reread(out)), want) < 1e-5
    written = json.loads((out / "config.json").read_text())
    assert (written["dtype"], written["torch_dtype"]) == ("float32", "float32")
    assert written["eos_token_id"] == tiny(REAL[name])["eos_token_id"]
    assert (out / "generation_config.json").read_bytes() == (path / "generation_config.json").read_bytes()


def test_a_family_not_yet_supported_is_refused_in_one_line(tmp_path):
    # a real config under the name of a family not read yet (StarCoder2's)
    (tmp_path / "config.json").write_text(json.dumps(dict(tiny(REAL["qwen3-4b"]), model_type="starcoder2")))
    assert refusal(tmp_path) == (f"path={str(tmp_path)!r}: model_type 'starcoder2' is not supported; "
                                 f"supported: {', '.join(arch.SUPPORTED)}")


LLAMA = dict(tiny(REAL["llama-2-7b-hf"]), num_key_value_heads=2)


@pytest.mark.parametrize("biases", [(True, True), (False, True)])
def test_biases_on_the_mlp_gate_included_load_exactly_and_export_back(biases, tmp_path):
    model = build(tmp_path / "in", dict(LLAMA, attention_bias=biases[0], mlp_bias=biases[1]))
    loaded, got = ours(tmp_path / "in")
    assert relative(got, torch_logits(model)) < 1e-5
    source = Folder(str(tmp_path / "in"))
    write.write_folder(nnx.split(loaded, nnx.Param, ...)[1], "gpt", source.gpt_kwargs(), tmp_path / "out", None)
    again = reread(tmp_path / "out")
    assert (again.config.attention_bias, again.config.mlp_bias) == biases
    assert relative(torch_logits(again), torch_logits(model)) < 1e-5


def test_tensors_nothing_reads_are_refused_in_one_line_and_buffers_are_not(folders, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, model = folders("llama-2-7b-hf")
    tensors = load_file(str(path / "model.safetensors"))

    def folder(name, **extra):
        shutil.copytree(path, tmp_path / name)
        save_file({**tensors, **extra}, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        return tmp_path / name

    extra = {f"model.layers.{i}.mlp.extra.weight": np.ones(3, np.float32) for i in range(4)}
    message = refusal(folder("unknown", **extra, **{"score.weight": np.ones(3, np.float32)}))
    assert "5 tensors of the folder would be read by nothing" in message
    assert message.endswith(": model.layers.0.mlp.extra.weight, model.layers.1.mlp.extra.weight, "
                            "model.layers.2.mlp.extra.weight, ...")
    (unused := dict(LLAMA, mlp_bias=True)).pop("attention_bias", None)  # gate, up, down biases; config says none
    build(tmp_path / "biased", unused)
    cfg = json.loads((tmp_path / "biased" / "config.json").read_text())
    (tmp_path / "biased" / "config.json").write_text(json.dumps(dict(cfg, mlp_bias=False)))
    assert "6 tensors" in refusal(tmp_path / "biased") and "mlp.down_proj.bias" in refusal(tmp_path / "biased")
    old = folder("old", **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)
                           for i in range(2)})
    assert relative(ours(old)[1], torch_logits(model)) < 1e-5


@pytest.mark.parametrize("case", ["differs", "equal", "only_head", "untied_without_head"])
def test_a_tied_pair_stored_either_way_reads_as_transformers_reads_it(case, tmp_path):
    from safetensors.numpy import load_file, save_file

    c = dict(LLAMA, tie_word_embeddings=case == "untied_without_head")
    build(tmp_path / "base", dict(c, tie_word_embeddings=False))
    tensors = load_file(str(tmp_path / "base" / "model.safetensors"))
    if case == "equal":
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    if case == "only_head":
        del tensors["model.embed_tokens.weight"]
    if case == "untied_without_head":
        del tensors["lm_head.weight"]
    path = tmp_path / case
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    base = json.loads((tmp_path / "base" / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(base, tie_word_embeddings=not c["tie_word_embeddings"])))
    if case == "untied_without_head":
        assert "tensor lm_head.weight is missing" in refusal(path)
        return
    if case == "differs" and not TRANSFORMERS_5:
        pytest.skip("transformers 4 ties them anyway")
    loaded, got = ours(path)
    assert relative(got, torch_logits(reread(path))) < 1e-5
    assert (loaded.head is None) == (case != "differs")


def test_a_base_models_folder_with_its_mask_buffers_reads_as_the_causal_lm(tmp_path):
    """The Hub's gpt2 is GPT2Model's checkpoint: no `transformer.` prefix, no lm_head, and each layer's causal
    mask saved as a buffer (attn.bias)."""
    from safetensors.numpy import load_file, save_file

    gpt2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, model_type="gpt2")
    model = build(tmp_path / "lm", gpt2)
    tensors = {k.removeprefix("transformer."): v
               for k, v in load_file(str(tmp_path / "lm" / "model.safetensors")).items() if k != "lm_head.weight"}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
        tensors[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
    (base := tmp_path / "base").mkdir()
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(tmp_path / "lm" / "config.json", base / "config.json")
    assert relative(ours(base)[1], torch_logits(model)) < 1e-5


@pytest.mark.parametrize("field, value, said", [
    ("hidden_act", "foo", "hidden_act='foo', which is not supported for llama"),
    ("rms_norm_eps", 1, "rms_norm_eps=1; transformers reads rms_norm_eps as a float"),
    ("tie_word_embeddings", 1, "tie_word_embeddings=1; transformers reads tie_word_embeddings as a bool"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_type='yarn', which is not supported"),
    ("attention_bias", True, "attention_bias=true, and llama's MLP then has no biases"),
])
def test_a_config_value_outside_what_is_read_is_one_line_naming_it_and_the_callers_argument(folders, field, value,
                                                                                             said, tmp_path):
    path = tmp_path / "bad"
    shutil.copytree(folders("llama-2-7b-hf")[0], path)
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**c, field: value}))
    assert refusal(path).startswith(f"path={str(path)!r}: ") and said in refusal(path)
    with pytest.raises(UserError, match=re.escape(f"RUN={str(path)!r}: config.json has {said}")):
        generate.main([str(path), "--max-new-tokens", "1"])


def test_the_command_line_names_its_own_argument_and_exits_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(tiny(REAL["qwen3-4b"]), model_type="starcoder2")))
    done = subprocess.run([sys.executable, "-m", "shard.generate", str(tmp_path)], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: RUN={str(tmp_path)!r}: model_type 'starcoder2' is not supported; supported: "
        f"{', '.join(arch.SUPPORTED)}"]


def test_an_export_is_the_sources_dtype_and_generation_config_into_new_parents(tmp_path):
    """A run started from a bfloat16 folder, trained one step at learning rate 0, exports through the command
    line into a folder whose parents did not exist: the same tensors, bit for bit, in bfloat16, with the
    source's generation_config.json; transformers reads it with the source's logits."""
    from safetensors import safe_open

    source = tmp_path / "source"
    build(source, tiny(REAL["llama-3.2-3b-instruct"]), dtype=torch.bfloat16)
    shutil.copyfile(FIXTURES / "llama-3.2-3b-instruct" / "generation_config.json", source / "generation_config.json")
    assert json.loads((source / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    run = tmp_path / "run"
    trainer.run(config.load(None, overrides(run, f"train.init_from={source}", "data.name=text", "data.seq_len=16",
                                            "data.batch_size=2", "run.cpu_devices=1", "train.steps=1", "optimizer.lr=0",
                                            "checkpoint.enabled=true")))
    out = tmp_path / "a" / "b" / "hf"
    assert export.main([str(run), "--format", "hf", "--out", str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert (written["dtype"], written["torch_dtype"], written["eos_token_id"]) == ("bfloat16", "bfloat16",
                                                                                    [1, 8, 9])
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    with safe_open(source / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert b.get_tensor(name).dtype == torch.bfloat16
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    assert relative(torch_logits(reread(out)), torch_logits(reread(source))) < 1e-5
    with pytest.raises(UserError, match="exists and is not an empty folder; nothing is overwritten"):
        export.main([str(run), "--format", "hf", "--out", str(out)])
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="file is a file, not a folder"):
        export.main([str(run), "--format", "hf", "--out", str(tmp_path / "file" / "hf")])


def test_without_a_source_folder_the_export_is_the_parameters_dtype_and_a_minimal_generation_config(folders,
                                                                                                    tmp_path):
    path, _ = folders("llama-2-7b-hf")
    loaded = shard.load_model(str(path))
    write.write_folder(nnx.split(loaded, nnx.Param, ...)[1], "gpt", Folder(str(path)).gpt_kwargs(), tmp_path / "hf",
                       None)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"_from_model_config": True}
    transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    kept = tmp_path / "tokenizer"  # a run's tokenizer copy keeps its folder's generation_config.json: it wins
    kept.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(FIXTURES / "llama-2-7b-hf" / name, kept / name)
    write.write_folder(nnx.split(loaded, nnx.Param, ...)[1], "gpt", Folder(str(path)).gpt_kwargs(), tmp_path / "hf2",
                       kept)
    assert (tmp_path / "hf2" / "generation_config.json").read_bytes() == (kept / "generation_config.json").read_bytes()


def test_a_gpt_with_biases_on_every_layer_but_the_gate_exports_its_gate_bias_as_zeros(tmp_path):
    """bias=true without mlp_bias: the gated MLP's gate has no bias, which a Llama with mlp_bias has; the
    export writes it as the zeros it is, so transformers misses nothing."""
    from shard.core.state import build_model
    from shard.models.gpt import GPT

    kwargs = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_len=32,
                  position="rope", norm="rmsnorm", mlp="swiglu", bias=True)
    model = build_model(GPT, kwargs, 0)
    model.blocks.ffn.b_in.set_value(model.blocks.ffn.b_in[...] + 0.1)  # off zero, as trained
    write.write_folder(nnx.state(model, nnx.Param), "gpt", kwargs, tmp_path / "hf", None)
    from safetensors.numpy import load_file

    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert not written["model.layers.1.mlp.gate_proj.bias"].any() and written["model.layers.1.mlp.up_proj.bias"].any()
    again = reread(tmp_path / "hf")
    assert again.config.mlp_bias
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS)))
    assert relative(torch_logits(again), got) < 1e-5
