"""Llama 4 beyond what tests/test_hf_moe.py checks of every MoE family (logits on every mesh, generation, export,
adapters): a multimodal `llama4` folder read as its language model (the towers skipped with one line, the logits
transformers' text model gives), and the families' refusals in one line."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard.errors import UserError  # noqa: E402
from shard.hf import read  # noqa: E402
from shard.use import load  # noqa: E402

from test_hf import jax_logits, relative, torch_logits  # noqa: E402
from test_hf_moe import COMMON, LLAMA4_TEXT, ROWS  # noqa: E402

VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, image_size=28,
              patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny Llama4ForConditionalGeneration (a vision tower and projector beside the language model), saved."""
    torch.manual_seed(0)
    config = transformers.Llama4Config(text_config={**COMMON, **LLAMA4_TEXT}, vision_config=VISION)
    model = transformers.Llama4ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(path)
    return str(path), model


def test_a_multimodal_folder_loads_its_language_model(multimodal, capsys):
    path, model = multimodal
    loaded = load.load(path, [], whole_mesh=False)
    said = capsys.readouterr().err
    assert "its language model is read, multi_modal_projector and vision_model skipped" in said
    assert loaded.cfg.model.name == "moe" and loaded.cfg.model.kwargs["chunks"]
    with torch.no_grad():
        want = model.language_model(torch.tensor(ROWS)).logits.numpy()  # (its forward wants images)
    assert relative(jax_logits(loaded, ROWS), want) < 1e-5


def test_bad_llama4_folders_are_one_line(multimodal, tmp_path):
    path, _ = multimodal
    text = json.loads((read.Path(path) / "config.json").read_text())["text_config"]
    cases = {
        "interleaved": ({"text_config": {**text, "moe_layers": [1]}}, "dense MLPs among the experts' layers"),
        "types": ({"text_config": {**text, "layer_types": ["sliding_attention"] * 2}},
                  "layer_types=['sliding_attention'"),
        "no_text": ({"text_config": None}, "text_config=None; its language model's config is read from there"),
    }
    for name, (change, expected) in cases.items():
        folder = tmp_path / name
        shutil.copytree(path, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError) as e:
            read.Folder(str(folder)).gpt_kwargs()
        assert expected in str(e.value) and "\n" not in str(e.value)


def test_the_text_model_exports_as_llama4_text(multimodal, tmp_path):
    """The language model of a multimodal folder exports as a llama4_text folder transformers reads with the same
    logits (the towers are not the run's)."""
    from flax import nnx

    from shard.hf import write

    path, model = multimodal
    loaded = load.load(path, [], whole_mesh=False)
    write.write_folder(nnx.state(loaded.model, nnx.Param), "moe", loaded.cfg.model.kwargs, tmp_path / "out", None)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert again.config.model_type == "llama4_text"
    with torch.no_grad():
        want = model.language_model(torch.tensor(ROWS)).logits.numpy()  # (its forward wants images)
    assert relative(torch_logits(again, ROWS), want) < 1e-6
    assert np.isfinite(want).all()


def test_the_cache_holds_one_chunk_for_a_chunked_layer(multimodal):
    """The server's cache: the global layer's keys and values at every position, the chunked layer's one chunk (a
    ring of attention_chunk_size slots), per slot whatever the context."""
    import shard
    from shard.server import engine
    from shard.use import generate

    path, _ = multimodal
    generator = generate.Generator(shard.load_model(path))
    kv, chunk, dim = COMMON["num_key_value_heads"], LLAMA4_TEXT["attention_chunk_size"], LLAMA4_TEXT["head_dim"]
    for context in (16, 32):
        want = 2 * (context + chunk) * 2 * kv * dim * 4
        assert engine.Engine(generator, 2, context, COMMON["vocab_size"]).cache_bytes() == want
