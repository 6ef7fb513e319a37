"""Multi-token prediction (models/mtp.py, shard/hf/mtp.py): a tiny DeepSeek-V3 and GLM-4.5 whose folder holds its
MTP layer (model.layers.{n}) as the checkpoints lay it out; the MTP loss read from the folder equals one built in torch
from transformers' own decoder layer and norms; fine-tuning with model.mtp_depth=1 logs mtp_loss, the same curve under
fsdp with grad accumulation as on one device; export writes the layer back bit for bit; what it cannot do is refused in
one line."""

import functools
import importlib
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard.errors import UserError  # noqa: E402
from shard.use import load  # noqa: E402

from test_hf import FINE_TUNE, VOCAB  # noqa: E402
from test_hf_deepseek import GLM, TINY  # noqa: E402

FAMILIES = {"deepseek_v3": ("DeepseekV3", TINY), "glm4_moe": ("Glm4Moe", GLM)}
SEQUENCE = np.random.default_rng(1).integers(0, VOCAB, (2, 17))
INPUTS, TARGETS = SEQUENCE[:, :-1], SEQUENCE[:, 1:]
WEIGHT = 0.3
MESHES = {"one": [], "tp": ["mesh=tp", "run.cpu_devices=2"], "ep": ["mesh=ep", "run.cpu_devices=4"]}


def with_mtp_layer(name: str, tiny: dict, path):
    """A model of tiny's layers and one more, every weight off its init, saved as a folder of tiny's layers whose
    extra layer is the MTP layer: its decoder layer as saved, its enorm, hnorm, eh_proj and shared_head.norm (off
    theirs), and its copies of the embedding and output layer. Returns (the torch model, the MTP's modules)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    n, d = tiny["num_hidden_layers"], tiny["hidden_size"]
    config = getattr(transformers, name + "Config")(**{**tiny, "num_hidden_layers": n + 1})
    model = getattr(transformers, name + "ForCausalLM")(config).float().eval()
    module = {"DeepseekV3": "deepseek_v3", "Glm4Moe": "glm4_moe"}[name]
    rms = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name + "RMSNorm")
    extra = torch.nn.ModuleDict(dict(enorm=rms(d, config.rms_norm_eps), hnorm=rms(d, config.rms_norm_eps),
                                     eh_proj=torch.nn.Linear(2 * d, d, bias=False), norm=rms(d, config.rms_norm_eps)))
    with torch.no_grad():
        for p in [*model.parameters(), *extra.parameters()]:
            p.add_(0.05 * torch.randn_like(p))
        for layer in model.model.layers[tiny["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.5 * torch.randn(tiny["n_routed_experts"]))
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    at = f"model.layers.{n}."
    tensors.update({at + "enorm.weight": extra["enorm"].weight, at + "hnorm.weight": extra["hnorm"].weight,
                    at + "eh_proj.weight": extra["eh_proj"].weight,
                    at + "shared_head.norm.weight": extra["norm"].weight,
                    at + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    at + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "num_hidden_layers": n, "num_nextn_predict_layers": 1}))
    model.config.num_hidden_layers = n  # its forward runs the model's own layers
    return model, extra


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind -> (the folder, the torch model, the MTP's own modules)."""
    out = {}
    for kind, (name, tiny) in FAMILIES.items():
        path = tmp_path_factory.mktemp(kind)
        out[kind] = (str(path), *with_mtp_layer(name, tiny, path))
    return out


def torch_mtp_loss(model, extra) -> float:
    """Depth 1 as the MTP module computes it: h = the model's last hidden state after its final norm; the next
    tokens' embeddings normed by enorm, h by hnorm, concatenated in that order, through eh_proj and the decoder
    layer past the model's own, then shared_head's norm and the model's output layer, predicting the token after
    next; the mean cross entropy over the positions that have one."""
    from transformers.masking_utils import create_causal_mask

    inputs, targets = torch.tensor(INPUTS), torch.tensor(TARGETS)
    with torch.no_grad():
        h = model.model(inputs).last_hidden_state
        e = model.model.embed_tokens(targets)
        x = extra["eh_proj"](torch.cat([extra["enorm"](e), extra["hnorm"](h)], -1))
        positions = torch.arange(x.shape[1])[None]
        mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=positions)
        x = model.model.layers[model.config.num_hidden_layers](
            x, attention_mask=mask, position_ids=positions,
            position_embeddings=model.model.rotary_emb(x, positions))
        logits = model.lm_head(extra["norm"](x))
        return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets[:, 1:].reshape(-1)))


def our_losses(loaded, inputs=INPUTS, targets=TARGETS, weights=None, segments=None, positions=None) -> dict:
    """The model's recorded values after a forward pass with the next tokens given (and packed rows' target weights,
    segment ids and positions), as the train step's loss runs it."""
    import jax
    from flax import nnx

    from shard.nn import hooks, partition, recorded

    graphdef, state = nnx.split(loaded.model)

    def run(state, inputs, targets, weights, segments, positions):
        model = nnx.merge(graphdef, state)
        with hooks.next_tokens(targets, weights), hooks.packed(segments, positions):
            model(inputs)
        return recorded.collect(model)

    with partition.activate(loaded.mesh, loaded.rules):
        aux, stats = jax.jit(run)(state, inputs, targets, weights, segments, positions)
    return {"aux": float(aux), **{k: float(v) for k, v in stats.items()}}


@pytest.mark.parametrize("kind, mesh", [("deepseek_v3", "one"), ("glm4_moe", "one"), ("deepseek_v3", "tp"),
                                        ("deepseek_v3", "ep")])
def test_the_mtp_loss_read_from_the_folder_equals_torchs(folders, kind, mesh):
    path, model, extra = folders[kind]
    want = torch_mtp_loss(model, extra)
    got = our_losses(load.load(path, ["model.mtp_depth=1", f"model.mtp_weight={WEIGHT}", *MESHES[mesh]],
                               whole_mesh=mesh != "one"))
    assert abs(got["mtp_loss"] - want) < 1e-5 * want
    assert got["aux"] == pytest.approx(WEIGHT * want, rel=1e-5)  # (the experts' balancing weight is 0 here)


def test_packed_rows_mtp_loss_is_the_same_whole_or_as_microbatches(folders):
    """Packed rows (documents, padding, targets not trained on): the loss of the whole batch is the mean of its
    halves' under the step's global token weights, as gradient accumulation takes it."""
    import jax.numpy as jnp

    from shard.core import losses

    loaded = load.load(folders["deepseek_v3"][0], ["model.mtp_depth=1"], whole_mesh=False)
    segments = np.asarray([[1] * 6 + [2] * 7 + [0] * 3, [1] * 16])
    positions = np.asarray([[*range(6), *range(7), 0, 0, 0], list(range(16))])
    mask = (segments > 0).astype(np.float32)
    mask[1, :3] = 0  # a prompt's targets (each row then holds another count of positions: 11, 13)
    weights = np.asarray(losses.token_weights(jnp.asarray(mask))[0])
    whole = our_losses(loaded, INPUTS, TARGETS, weights, segments, positions)["mtp_loss"]
    halves = [our_losses(loaded, INPUTS[i:i + 1], TARGETS[i:i + 1], weights[i:i + 1], segments[i:i + 1],
                         positions[i:i + 1])["mtp_loss"] for i in range(2)]
    assert whole == pytest.approx(np.mean(halves), rel=1e-6) and whole > 1


def test_without_mtp_depth_the_layer_is_skipped_in_one_line_saying_how_to_train_it(folders, capfd):
    loaded = load.load(folders["deepseek_v3"][0], [], whole_mesh=False)
    assert loaded.model.mtp is None
    lines = [line for line in capfd.readouterr().err.splitlines() if "multi-token-prediction layer 3" in line]
    assert lines and "model.mtp_depth=1 trains" in lines[0]


def test_the_layers_past_mtp_depth_are_skipped_in_one_line_naming_num_hidden_layers(capfd):
    """(DeepSeek-V3's 61 layers, two MTP layers held, one trained: the line named 60, the depth taken off)"""
    from shard.hf import mtp

    layers = {61: {"model.layers.61.eh_proj.weight", "model.layers.61.embed_tokens.weight"},
              62: {"model.layers.62.eh_proj.weight"}}
    unread = mtp.unread(layers, 1, {"num_nextn_predict_layers": 2}, "test")
    assert unread == {"model.layers.62.eh_proj.weight", "model.layers.61.embed_tokens.weight",
                      "model.layers.61.shared_head.head.weight"}
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines == ["warning: test: the multi-token-prediction layer 62 (1 tensors) past num_hidden_layers=61 is not "
                     "read (model.mtp_depth=1)"]


@pytest.mark.slow
def test_fine_tuning_logs_mtp_loss_and_the_curve_under_fsdp_and_accumulation_is_one_devices(folders, train):
    """(two tiny fine-tunes, three steps each: most of it compiling)"""
    import jax
    from flax import nnx

    path = folders["deepseek_v3"][0]
    base = [f"train.init_from={path}", "model.mtp_depth=1", "model.correction_rate=1e-3", *FINE_TUNE, "train.steps=3",
            "optimizer.lr=1e-2"]
    one = train(*base, "run.cpu_devices=1", subdir="one")
    many = train(*base, "mesh=fsdp", "run.cpu_devices=2", "train.grad_accum=2", subdir="many")
    for name in ("loss", "mtp_loss", "aux_loss"):
        np.testing.assert_allclose([r[name] for r in many.history], [r[name] for r in one.history], rtol=1e-5)
    assert [r["aux_loss"] for r in one.history] == pytest.approx([WEIGHT * r["mtp_loss"] for r in one.history])
    value = lambda tree, *at: np.asarray(jax.tree.leaves(functools.reduce(lambda t, k: t[k], at, tree))[0])  # noqa
    start = nnx.state(load.load(path, ["model.mtp_depth=1"], whole_mesh=False).model)
    proj = ("mtp", "layers", "proj")
    assert np.abs(value(one.state.params, *proj) - value(start, *proj)).max() > 1e-4  # trained by its loss
    # its layer's experts' aux-loss-free bias moved by their own load, as the stack's by theirs
    for at in (("mtp", "layers", "block", "ffn", "correction"), ("blocks", "ffn", "correction")):
        moved = value(one.state.rest, *at) - value(start, *at)
        assert np.abs(moved).max() > 5e-4, at  # (+-1e-3 a step, by the sign of its load's excess)
        np.testing.assert_allclose(value(many.state.rest, *at), value(one.state.rest, *at), atol=1e-7)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_export_writes_the_mtp_layer_back_bitwise_and_it_reads_again(folders, kind, tmp_path):
    """Every tensor of the folder (the MTP layer's copies of the embedding and output layer too) written back bit for
    bit, num_nextn_predict_layers with them; the written folder reads into the same parameters."""
    import jax
    from flax import nnx
    from safetensors.numpy import load_file

    from shard.hf import read, write

    path = folders[kind][0]
    loaded = load.load(path, ["model.mtp_depth=1"], whole_mesh=False)
    _, params, rest = nnx.split(loaded.model, nnx.Param, ...)
    out = tmp_path / "out"
    write.write_folder(params, loaded.cfg.model.name, loaded.cfg.model.kwargs, out, None, source=read.Folder(path),
                       rest=rest)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    theirs, ours = load_file(f"{path}/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)
    again = load.load(str(out), ["model.mtp_depth=1"], whole_mesh=False)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again.model), nnx.state(loaded.model))


def refused(call) -> str:
    with pytest.raises(UserError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_what_mtp_cannot_do_is_refused_in_one_line(folders, train):
    path = folders["glm4_moe"][0]
    said = refused(lambda: load.load(path, ["model.mtp_depth=2"], whole_mesh=False))
    assert "model.mtp_depth=2" in said and "holds 1 multi-token-prediction layer " in said
    said = refused(lambda: train(f"train.init_from={path}", "model.mtp_depth=1", *FINE_TUNE, "mesh=pp",
                                 "run.cpu_devices=2"))
    assert "mesh.stage=2 with model.mtp_depth=1" in said
    said = refused(lambda: train("model.name=gpt", "model.n_layers=2", "model.d_model=16", "model.n_heads=2",
                                 "model.max_len=16", "model.mtp_depth=1", "model.windows=[4,0]", *FINE_TUNE))
    assert "mtp_depth=1" in said
    said = refused(lambda: train("model.name=gpt", "model.n_layers=2", "model.d_model=16", "model.n_heads=2",
                                 "model.max_len=16", "model.mtp_depth=1", *FINE_TUNE, "mesh=cp", "run.cpu_devices=2"))
    assert "mesh.context=2" in said


def test_an_fp8_mtp_layer_reads_dequantized_or_is_skipped(folders, tmp_path):
    """The MTP layer's weights in FP8 with a scale per 8 x 8 block, as DeepSeek-V3's ship: read as the float weights
    transformers dequantizes them into; skipped whole (their scales too) without model.mtp_depth."""
    import shutil

    from flax import nnx
    from safetensors.torch import load_file, save_file

    path = folders["deepseek_v3"][0]
    shutil.copytree(path, tmp_path / "fp8")
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    n, block = TINY["num_hidden_layers"], 8
    name = f"model.layers.{n}.eh_proj.weight"
    w = tensors[name]
    blocks = w.reshape(w.shape[0] // block, block, w.shape[1] // block, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    codes = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
    tensors[name], tensors[name + "_scale_inv"] = codes, scale.float()
    save_file(tensors, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    want = (codes.float().reshape(blocks.shape) * scale[:, None, :, None]).reshape(w.shape).numpy()  # (d, 2 d)
    loaded = load.load(str(tmp_path / "fp8"), ["model.mtp_depth=1"], whole_mesh=False)
    proj = np.asarray(nnx.state(loaded.model, nnx.Param)["mtp"]["layers"]["proj"][...])[0]  # (2, d in, d out)
    np.testing.assert_array_equal(np.concatenate([proj[0], proj[1]]).T, want)
    assert load.load(str(tmp_path / "fp8"), [], whole_mesh=False).model.mtp is None


def test_a_target_counts_within_the_row_and_its_document_at_its_weight():
    import jax.numpy as jnp

    from shard.models.mtp import valid

    segments = jnp.asarray([[1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(valid((1, 6), None, segments, 1), [[1, 1, 0, 1, 0, 0]])
    np.testing.assert_array_equal(valid((1, 6), None, segments, 2), [[1, 0, 0, 0, 0, 0]])
    weights = jnp.asarray([[0.0, 0.5, 2.0, 2.0, 2.0, 0.0]])
    np.testing.assert_array_equal(valid((1, 6), weights, segments, 1), [[0.5, 2.0, 0, 2.0, 0, 0]])
    np.testing.assert_array_equal(valid((1, 6), None, None, 2), [[1, 1, 1, 1, 0, 0]])
