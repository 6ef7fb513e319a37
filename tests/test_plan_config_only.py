"""A plan from a Hugging Face config.json alone (`python train.py train.init_from=FOLDER --dry-run`): the model at
the size config.json gives, its parameters counted against transformers' model of the same config (built on torch's
meta device: nothing allocated), no weights or tokenizer needed and nothing written into the folder; anything that
runs the model from such a folder is refused in one line."""

import json
import shutil

import jax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT, TINY_GPT, overrides, run_cli  # noqa: E402
from shard import config  # noqa: E402
from shard.errors import UserError  # noqa: E402
from shard.plan import analysis  # noqa: E402
from shard.use import load  # noqa: E402

FIXTURES = ROOT.parent / "shared" / "fixtures" / "hf"
COMMON = dict(vocab_size=300, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
TINY = {
    "qwen3": lambda T: T.Qwen3Config(**COMMON, hidden_size=64, intermediate_size=96, head_dim=32),
    "qwen3_moe": lambda T: T.Qwen3MoeConfig(**COMMON, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                            num_experts=4, num_experts_per_tok=2),
}
SMALL = ["run.cpu_devices=8", "mesh=fsdp", "data.seq_len=32", "data.batch_size=8"]
ALONE = "planned from config.json alone (no weights, no tokenizer)"


def config_folder(path, hf_config):
    """A folder holding the config's config.json and nothing else."""
    hf_config.save_pretrained(path)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    return path


def their_count(path) -> int:
    """transformers' parameter count of the folder's config.json (tied embeddings once)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def plan(tmp_path, folder, *extra) -> dict:
    cfg = config.load(None, overrides(tmp_path / "run", f"train.init_from={folder}", *SMALL, *extra), planning=True)
    return analysis.analyse(cfg, jax.devices()[:cfg.run.cpu_devices])


def test_a_config_json_alone_plans_through_the_command_line(tmp_path):
    folder = config_folder(tmp_path / "qwen3", TINY["qwen3"](transformers))
    done = run_cli(f"train.init_from={folder}", *SMALL, f"run.dir={tmp_path / 'run'}", "--dry-run")
    assert done.returncode == 0, done.stderr
    said = [line.strip() for line in done.stdout.splitlines() if "config.json alone" in line]
    assert len(said) == 1 and said[0].startswith(ALONE), done.stdout
    p = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert p["param_count"] == their_count(folder) and p["planned_from"] == said[0]
    assert [f.name for f in folder.iterdir()] == ["config.json"]  # nothing written into the folder


def test_a_mixture_of_experts_config_json_alone_plans_every_expert(tmp_path):
    """On one device: routing over a mesh is tests/test_moe_dropless.py's."""
    folder = config_folder(tmp_path / "moe", TINY["qwen3_moe"](transformers))
    p = plan(tmp_path, folder, "run.cpu_devices=1", "mesh=dp")
    assert p["param_count"] == their_count(folder) and p["planned_from"].startswith(ALONE)
    assert p["memory_per_device"]["params"] == pytest.approx(4 * p["param_count"], rel=1e-2)  # float32, one copy


@pytest.mark.skipif(not (FIXTURES / "qwen3-4b" / "config.json").exists(), reason="no ../shared/fixtures/hf")
def test_a_real_config_json_alone_plans_at_its_real_size(tmp_path):
    """Qwen3-4B's real config.json, copied alone: 4.02 billion parameters planned (nothing allocated), split over
    8 devices; the fixture's own folder (config.json and a tokenizer, no weights) reads the same."""
    folder = tmp_path / "qwen3-4b"
    folder.mkdir()
    shutil.copy(FIXTURES / "qwen3-4b" / "config.json", folder)
    p = plan(tmp_path, folder)
    assert p["param_count"] == their_count(folder) == 4_022_468_096
    assert p["memory_per_device"]["params"] == pytest.approx(4 * p["param_count"] / 8, rel=1e-3)
    assert p["planned_from"].startswith(ALONE)
    fixture = config.load(None, [f"train.init_from={FIXTURES / 'qwen3-4b'}"], planning=True)
    assert fixture.model.kwargs == config.load(None, [f"train.init_from={folder}"], planning=True).model.kwargs


def test_running_a_config_only_folder_is_refused_in_one_line(tmp_path):
    folder = config_folder(tmp_path / "qwen3", TINY["qwen3"](transformers))
    done = run_cli(f"train.init_from={folder}", f"run.dir={tmp_path / 'run'}", "train.steps=1")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no weights (.safetensors files) and no tokenizer" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "run").exists()
    # generate, export and serve read the folder through load: the same line
    with pytest.raises(UserError, match=r"no weights .* config.json alone only plans") as e:
        load.load(str(folder), [])
    assert "\n" not in str(e.value)
    assert [f.name for f in folder.iterdir()] == ["config.json"]


def test_a_plan_of_a_folder_without_a_tokenizer_reads_its_documents_as_bytes(tmp_path):
    """Weights but no tokenizer: training on documents is refused as before; a plan reads them as bytes."""
    model = transformers.Qwen3ForCausalLM(TINY["qwen3"](transformers))
    model.save_pretrained(tmp_path / "weights")
    given = [f"train.init_from={tmp_path / 'weights'}", "data.name=documents"]
    with pytest.raises(UserError, match="tokenizer"):
        config.load(None, given)
    assert config.load(None, given, planning=True).data.tokenizer == "bytes"


def test_a_folder_without_config_json_or_with_a_bad_one_keeps_its_one_line_error_when_planning(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    (weights := tmp_path / "weights").mkdir()
    save_file({"lm_head.weight": np.zeros((2, 2), np.float32)}, str(weights / "model.safetensors"))
    with pytest.raises(UserError, match="no config.json in the folder"):
        config.load(None, [f"train.init_from={weights}"], planning=True)
    (bad := tmp_path / "bad").mkdir()
    (bad / "config.json").write_text("{")
    with pytest.raises(UserError, match="config.json is not readable JSON"):
        config.load(None, [f"train.init_from={bad}"], planning=True)
    # a folder that is neither a model's nor a run's is said, not planned as the default model
    (empty := tmp_path / "empty").mkdir()
    cfg = config.load(None, overrides(tmp_path / "run", *TINY_GPT, f"train.init_from={empty}"), planning=True)
    with pytest.raises(UserError, match="holds no checkpoint"):
        analysis.analyse(cfg, jax.devices()[:1])
