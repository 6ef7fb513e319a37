"""train.py as a user meets it: help, printed config, a short real run, and one-line errors."""

import importlib.util
import json

import pytest
import yaml

from conftest import ROOT, TINY_GPT, TINY_MLP, run_cli
from shard.errors import UserError

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
    "config named without configs/": (["digits_cnn.yaml"], "did you mean configs/digits_cnn.yaml?"),
    "not key=value": (["train.steps=3", "steps"], "steps"),
    "run.dir is a file": (["run.dir=RUN/config.yaml"], "run.dir"),
    "out of range": (["data.prefetch=-1"], "data.prefetch"),
    "wrong choice in a group": (["train.lora.rank=4", "train.lora.base=nf5"], "train.lora.base='nf5' is not allowed"),
    "out of range in a group": (["train.grpo.group=1"], "train.grpo.group=1 is out of range"),
    "model output narrower than the data": (["model.vocab_size=100"], "256"),
    "bad module name": (["model.name=:Foo"], "model.name"),
    "loss does not fit the task": (["train.loss=mse"], "train.loss=mse"),
    "duplicate rule axes": (["mesh.rules.embed=[fsdp,fsdp]"], "mesh.rules.embed"),
    "missing data path": (["data.path=no/such/dir"], "data.path"),
    "missing CSV": (["model.name=mlp", "data.name=tabular", "data.path=no/such.csv"], "no/such.csv"),
    "batch larger than the data": (["model.name=mlp", "data.name=digits", "data.batch_size=4096"], "4096"),
    "cudnn attention on CPU": (["train.attention=cudnn", "train.dtype=bfloat16"], "train.attention=cudnn"),
    "ragged all-to-all on CPU": (["train.expert_exchange=ragged"], "train.expert_exchange=ragged needs a TPU or GPU"),
    "lm task on tables": (["model.name=mlp", "data.name=digits", "data.task=lm"], "data.task=lm"),
    "profile range not START:END": (["run.profile_steps=5"], "START:END"),
    "layers not divisible into stages": (["run.cpu_devices=8", "mesh=pp"], "4 stacked layers do not divide into 8"),
    "microbatches not whole on every stage": (["run.cpu_devices=2", "mesh=pp", "pipeline.microbatches=5"],
                                              "pipeline.microbatches=5 with mesh.stage=2"),
    "batch not into microbatches": (["run.cpu_devices=2", "mesh=pp", "pipeline.microbatches=6"],
                                    "data.batch_size=32 does not cut into pipeline.microbatches=6"),
    "batch not into accumulation microbatches": (["run.cpu_devices=8", "train.grad_accum=3"], "train.grad_accum=3"),
    "stages without stacked layers": (["model.name=mlp", "model.in_features=64", "data.name=digits",
                                       "run.cpu_devices=2", "mesh=pp"],
                                      "no stacked layers"),
    "profile range after the run": (["run.profile_steps=10:20"], "train.steps=4"),
    "bfloat16 reduction without a data axis": (["run.cpu_devices=8", "mesh=fsdp", "train.grad_dtype=bfloat16"],
                                               "train.grad_dtype=bfloat16"),
    "bfloat16 reduction of batch statistics": (["model.name=cnn", "data.name=digits", "run.cpu_devices=2",
                                                "train.grad_dtype=bfloat16"], "batch statistics"),
    "no ZeRO stage 3 over data": (["mesh.zero=3"], "mesh.zero=3"),
    "sequence not into 2 x context chunks": (["run.cpu_devices=8", "mesh=cp", "data.seq_len=24"], "data.seq_len=24"),
    "zero bubble: not a schedule": (["run.cpu_devices=2", "mesh=pp", "pipeline.schedule=zb"],
                                    "choose one of: gpipe, 1f1b"),
    "ring inside a pipeline": (["run.cpu_devices=8", "mesh=cp", "mesh.context=4", "mesh.stage=2",
                                "train.context_strategy=ring"], "train.context_strategy=ring"),
}


# Checked as a user meets them, in a new process (exit status 2, one line on stderr); the others call train.py's
# main() in this process, whose UserError is what its command line prints as that one line with status 2.
IN_A_NEW_PROCESS = ("unknown key", "param not divisible", "missing config file")


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(tmp_path, case, monkeypatch):
    args, named = BAD_INPUTS[case]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("earlier: run\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    path = [a for a in args if a.endswith(".yaml") and "=" not in a]  # a config file comes first, overrides last
    rest = [a.replace("RUN", str(run_dir)) for a in args if a not in path]
    argv = [*path, f"run.dir={run_dir}", *QUICK, *rest]
    if case in IN_A_NEW_PROCESS:
        proc = run_cli(*argv)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        stderr = proc.stderr
    else:
        monkeypatch.chdir(ROOT)  # as run_cli runs it: relative config paths
        with pytest.raises(UserError) as raised:
            train_main(*argv)
        stderr = f"error: {raised.value}\n"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert named in lines[0]
    assert (run_dir / "config.yaml").read_text() == "earlier: run\n"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl"]


def help_rows(text: str) -> dict[str, str]:
    """key -> its line (key lines are indented by two; wrapped help by more)."""
    return {line.split()[0]: line for line in text.splitlines()
            if line.startswith("  ") and line[2] != " " and "." in line.split()[0]}


def test_help_lists_keys_with_types_and_the_configs_values():
    proc = run_cli("--help")  # configs/default.yaml, whose values differ from the schema's here and there
    assert proc.returncode == 0, proc.stderr
    rows = help_rows(proc.stdout)
    for expected in ("train.steps", "data.batch_size", "mesh.tensor", "run.cpu_devices", "model.n_layers"):
        assert expected in rows
    assert rows["train.steps"].split()[1:5] == ["int", "640", "(default", "300)"]  # type, value, schema default
    assert "dots (default none)" in rows["train.remat"] and "96 (default 128)" in rows["model.d_model"]
    assert "(default" not in rows["train.seed"] and "(default" not in rows["model.vocab_size"]  # unchanged
    assert "configs/default.yaml" in proc.stdout


def train_main(*argv):
    """train.py's main(), in this process: --help only reads configs, no need for a new interpreter."""
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(argv))


def test_help_after_a_config_shows_that_configs_values(capsys):
    assert train_main("configs/digits_cnn.yaml", "mesh=fsdp_tp", "mesh.tensor=4", "--help") == 0
    out = capsys.readouterr().out
    rows = help_rows(out)
    assert "cnn (default gpt)" in rows["model.name"] and "64 (default 32)" in rows["data.batch_size"]
    assert "[32, 64]" in rows["model.widths"] and "(default" not in rows["model.widths"]  # the cnn's own default
    assert "model.d_model" not in rows  # the gpt's arguments are not the cnn's
    assert "4 (default 2)" in rows["mesh.tensor"]  # mesh axes: compared with the preset's
    assert rows["mesh.fsdp"].split()[4] == "-1" and "(default" not in rows["mesh.fsdp"]  # fsdp_tp's own -1
    assert "configs/digits_cnn.yaml + 2 override(s)" in out


def test_help_with_a_config_that_does_not_load_shows_defaults_then_the_error(capsys):
    with pytest.raises(UserError, match="did you mean configs/digits_cnn.yaml"):
        train_main("digits_cnn", "--help")
    out = capsys.readouterr().out
    assert "built-in defaults" in out and "train.steps" in help_rows(out)


@pytest.mark.parametrize("width", [None, 160, 100, 72])
def test_help_columns_line_up_and_fit_the_width(width):
    from shard import config
    from shard.core import registry

    cfg = config.load(ROOT / "configs" / "default.yaml", ["run.dir=a/rather/long/run/folder/name", "model.d_model=64"])
    signature = [*registry.arguments(registry.resolve("gpt")), ("a_constructor_argument_with_a_long_name", "int", 1)]
    text = config.help_text(cfg, signature, "test", width)
    lines = text.splitlines()
    rows = help_rows(text)
    key_w = max(len(k) for k in rows)
    type_col = 2 + key_w + 2
    helps = {key: f.metadata["help"] for s in config.SECTIONS for key, f, _ in config.keys_of(s)}
    value_cols, help_cols = set(), set()
    for key, line in rows.items():
        assert line[:type_col] == f"  {key}".ljust(type_col) and line[type_col] != " ", line
        type_end = line.index("  ", type_col)
        value_cols.add(type_end + len(line[type_end:]) - len(line[type_end:].lstrip()))
        if key in helps and helps[key][:20] in line:
            help_cols.add(line.index(helps[key][:20]))
    assert len(value_cols) == 1  # every value starts in the same column
    # Help beside the values starts in one column, and so does every wrapped line of it.
    continued = {len(l) - len(l.lstrip()) for l in lines if l.startswith("      ") and l.split()[0] not in rows}
    assert len(help_cols | continued) <= 1 if width is None or width >= 160 else continued == {6}
    if width is not None:  # help and header wrap to the width; key, type and value only when they fit it
        too_wide = [l for l in lines if len(l) > width and (width >= 100 or l not in rows.values())]
        assert all("rather/long" in l for l in too_wide), too_wide


def test_print_config_resolves_preset_and_overrides():
    proc = run_cli("mesh=fsdp_tp", "mesh.tensor=4", "model.n_layers=2", "--print-config")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["mesh"] == {"preset": "fsdp_tp", "replica": 1, "stage": 1, "data": 1, "expert": 1, "fsdp": -1,
                           "context": 1, "tensor": 4, "rules": {}, "zero": 0, "auto_shard": True,
                           "auto_shard_min_size": 16384, "dcn_data": None, "dcn_replica": 1, "dcn_stage": 1,
                           "dcn_expert": 1, "dcn_fsdp": 1, "dcn_context": 1,
                           "dcn_tensor": 1}
    assert cfg["model"]["n_layers"] == 2 and cfg["model"]["vocab_size"] == 256  # signature default filled in
    assert cfg["train"]["steps"] == 640  # from configs/default.yaml


def test_help_and_print_config_show_the_run_folder_a_command_gets(capsys):
    from shard import config

    assert train_main("model.n_layers=8", "--help") == 0
    row = help_rows(capsys.readouterr().out)["run.dir"]
    assert " runs/default-" in row and "(default null)" in row  # this job's folder, derived
    help_ = next(f.metadata["help"] for f in config.schema_fields("run") if f.name == "dir")
    assert "runs/<config file name>" in help_ and "train.steps" in help_  # the rule, in words
    assert train_main(str(ROOT / "configs" / "digits_cnn.yaml"), "mesh=fsdp", "--print-config") == 0
    assert yaml.safe_load(capsys.readouterr().out)["run"]["dir"] == "runs/digits_cnn"


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


def test_train_py_joins_the_processes_once(tmp_path, monkeypatch):
    """train.py starts the devices (and a multi-process job's join) once and hands them to the trainer."""
    from shard.run import distributed
    calls, start = [], distributed.start
    monkeypatch.setattr(distributed, "start", lambda *a, **k: calls.append(a) or start(*a, **k))
    assert train_main(*TINY_MLP, "train.steps=2", "run.progress=false", f"run.dir={tmp_path}") == 0
    assert len(calls) == 1 and (tmp_path / "metrics.jsonl").exists()


def test_default_config_trains(tmp_path):
    proc = run_cli("train.steps=3", "train.sample_len=5", "train.eval_batches=2", f"run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "model gpt" in proc.stdout and "sample:" in proc.stdout
    # piped, not a terminal: the progress is a line per log point, never a bar redrawn with \r
    assert "[1/3] loss " in proc.stdout and "[3/3] loss " in proc.stdout and "\r" not in proc.stdout + proc.stderr
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG") and any((tmp_path / "tensorboard").iterdir())
