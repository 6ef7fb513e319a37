"""python -m shard.export: a trained model's forward pass as ONNX (jax2onnx) that onnxruntime runs with the
JAX model's outputs, for every model of the library; an operation the converter lacks is one line."""

import jax.numpy as jnp
import numpy as np
import onnxruntime
import pytest

from conftest import TINY_MODELS, overrides
from shard import config
from shard.use import export, load
from shard.run import trainer
from shard.errors import UserError

STEPS = ["train.steps=2", "run.cpu_devices=1", "checkpoint.enabled=true"]
EXPORTED = ["mlp", "cnn", "gpt", "vit", "lstm", "moe"]


def trained(folder, *args):
    trainer.run(config.load(None, overrides(folder, *args, *STEPS)))
    return folder


@pytest.mark.parametrize("name", EXPORTED)
def test_the_onnx_file_runs_in_onnxruntime_with_the_jax_models_outputs(tmp_path, name):
    run = trained(tmp_path / "run", *TINY_MODELS[name])
    assert export.main([str(run), "--format", "onnx"]) == 0
    loaded = load.load(run, [], whole_mesh=False)
    inputs = export.example_batch(loaded.cfg, 5)  # a batch size the export never saw: the batch is symbolic
    session = onnxruntime.InferenceSession(str(run / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[0] == "B"
    got = session.run(None, {"inputs": inputs})[0]
    loaded.model.eval()  # running statistics, no dropout
    want = np.asarray(loaded.model(jnp.asarray(inputs)))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_a_fixed_batch_and_what_cannot_be_exported(tmp_path, capsys):
    run = trained(tmp_path / "mlp", *TINY_MODELS["mlp"])
    fixed = tmp_path / "new" / "folders" / "fixed.onnx"  # the missing folders are made
    assert export.main([str(run), "--format", "onnx", "--batch", "4", "--out", str(fixed)]) == 0
    assert "batch 4" in capsys.readouterr().out
    session = onnxruntime.InferenceSession(str(fixed), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [4, 16]
    for args, message in ((["--format", "tflite"], "invalid choice: 'tflite'"), (["--batch", "0"], "--batch 0"),
                          (["--out", str(tmp_path / "model.txt")], "name a .onnx file"),
                          (["--out", str(fixed / "x.onnx")], "fixed.onnx is a file, not a folder")):
        with pytest.raises(UserError, match=message):
            export.main([str(run), *([] if "--format" in args else ["--format", "onnx"]), *args])
    callback = trained(tmp_path / "callback", "model.name=stock_models:HostCallbackMLP", *TINY_MODELS["mlp"][4:])
    with pytest.raises(UserError, match="stock_models:HostCallbackMLP.*outside the model library.*--trust-code"):
        export.main([str(callback), "--format", "onnx"])
    with pytest.raises(UserError, match="does not convert to ONNX: .*primitive 'pure_callback'"):
        export.main([str(callback), "--format", "onnx", "--trust-code"])
    assert sorted(p.name for p in callback.iterdir()) == ["checkpoints", "config.yaml", "goodput.jsonl",
                                                          "metrics.jsonl"]


def test_a_run_exports_without_its_data_and_loaded_sharded(tmp_path, capsys):
    """A run folder moved to another machine has no data: the check runs on random tokens instead. A mesh
    override loads the checkpoint split over the devices, as generation does."""
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    run = trained(tmp_path / "run", *TINY_MODELS["gpt"], f"data.path={text}")
    text.unlink()
    assert export.main([str(run), "--format", "onnx", "mesh=fsdp", "run.cpu_devices=4"]) == 0
    assert "onnxruntime matches JAX" in capsys.readouterr().out
    with pytest.raises(UserError, match="unrecognized arguments: --bogus"):
        export.main([str(run), "--format", "onnx", "--bogus"])
