"""train.py as a user meets it: help, printed config, a short real run, and one-line errors."""

import json

import pytest
import yaml

from conftest import TINY_GPT, run_cli

QUICK = ["train.steps=4", "run.log_every=2", "run.progress=false", "train.eval_batches=1"]

BAD_INPUTS = {
    "unknown key": (["train.stepz=3"], "train.stepz"),
    "unknown section": (["trian.steps=3"], "trian"),
    "wrong type": (["train.steps=abc"], "train.steps"),
    "wrong choice": (["train.dtype=float16"], "train.dtype"),
    "mesh product": (["run.cpu_devices=8", "mesh.data=3"], "8"),
    "two -1 axes": (["run.cpu_devices=8", "mesh.data=-1", "mesh.fsdp=-1"], "-1"),
    "param not divisible": (["run.cpu_devices=8", "mesh=tp", "model.n_heads=4"], "blocks/attn"),
    "bad model option": (["model.norm=batchnorm"], "norm='batchnorm'"),
    "batch not divisible": (["run.cpu_devices=8", "data.batch_size=12"], "data.batch_size=12"),
    "unknown model": (["model.name=resnet9000"], "resnet9000"),
    "unknown model argument": (["model.depth=3"], "model.depth"),
    "model argument type": (["model.d_model=wide"], "model.d_model"),
    "unknown preset": (["mesh=zero5"], "zero5"),
    "missing config file": (["no/such/config.yaml"], "no/such/config.yaml"),
    "not key=value": (["train.steps=3", "steps"], "steps"),
    "run.dir is a file": (["run.dir=RUN/config.yaml"], "run.dir"),
    "out of range": (["data.prefetch=-1"], "data.prefetch"),
    "model output narrower than the data": (["model.vocab_size=100"], "256"),
    "bad module name": (["model.name=:Foo"], "model.name"),
    "loss does not fit the task": (["train.loss=mse"], "train.loss=mse"),
    "duplicate rule axes": (["mesh.rules.embed=[fsdp,fsdp]"], "mesh.rules.embed"),
    "missing data path": (["data.path=no/such/dir"], "data.path"),
    "missing CSV": (["model.name=mlp", "data.name=tabular", "data.path=no/such.csv"], "no/such.csv"),
    "batch larger than the data": (["model.name=mlp", "data.name=digits", "data.batch_size=4096"], "4096"),
    "cudnn attention on CPU": (["train.attention=cudnn", "train.dtype=bfloat16"], "train.attention=cudnn"),
    "lm task on tables": (["model.name=mlp", "data.name=digits", "data.task=lm"], "data.task=lm"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(tmp_path, case):
    args, named = BAD_INPUTS[case]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("earlier: run\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    path = [a for a in args if a.endswith(".yaml") and "=" not in a]  # a config file comes first, overrides last
    rest = [a.replace("RUN", str(run_dir)) for a in args if a not in path]
    proc = run_cli(*path, f"run.dir={run_dir}", *QUICK, *rest)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert named in lines[0] and "Traceback" not in proc.stderr
    assert (run_dir / "config.yaml").read_text() == "earlier: run\n"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl"]


def test_help_lists_keys_with_types_and_defaults():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for expected in ("train.steps", "data.batch_size", "mesh.tensor", "run.cpu_devices", "model.n_layers"):
        assert expected in proc.stdout
    line = next(l for l in proc.stdout.splitlines() if "train.steps" in l)
    assert "int" in line and "300" in line  # type and the schema default


def test_print_config_resolves_preset_and_overrides():
    proc = run_cli("mesh=fsdp_tp", "mesh.tensor=4", "model.n_layers=2", "--print-config")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["mesh"] == {"preset": "fsdp_tp", "data": 1, "expert": 1, "fsdp": -1, "tensor": 4, "rules": {},
                           "auto_shard": True, "auto_shard_min_size": 16384,
                           "dcn_data": None, "dcn_expert": 1, "dcn_fsdp": 1, "dcn_tensor": 1}
    assert cfg["model"]["n_layers"] == 2 and cfg["model"]["vocab_size"] == 256  # signature default filled in
    assert cfg["train"]["steps"] == 640  # from configs/default.yaml


def test_a_short_run_writes_config_metrics_eval_and_sample(tmp_path):
    proc = run_cli(*TINY_GPT, "run.cpu_devices=2", "mesh=fsdp", f"run.dir={tmp_path}", "train.sample_len=20",
                   "run.peak_tflops=1", *QUICK)
    assert proc.returncode == 0, proc.stderr
    assert "eval_loss" in proc.stdout and "sample:" in proc.stdout
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["mesh"]["fsdp"] == -1 and saved["model"]["d_model"] == 32
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 4]
    for key in ("step", "loss", "lr", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"):
        assert key in train[-1]
    last = train[-1]  # peak 1 TFLOP/s: MFU is the achieved rate in TFLOP/s
    assert last["mfu"] == pytest.approx(last["tflops_per_device"])
    assert "peak_memory_gb" not in last  # the CPU does not report device memory
    assert "eval_loss" in records[-1] and "eval_accuracy" in records[-1]


def test_default_config_trains(tmp_path):
    proc = run_cli("train.steps=3", "train.sample_len=5", f"run.dir={tmp_path}", "run.progress=false")
    assert proc.returncode == 0, proc.stderr
    assert "model gpt" in proc.stdout and "sample:" in proc.stdout
