"""Config loading and precedence, mesh sizes, and the logical-axis mapping."""

import pytest
from jax.sharding import PartitionSpec as P

from conftest import ROOT
from shard import config
from shard.errors import UserError
from shard.core.mesh import resolve_sizes
from shard.nn.partition import RULES, logical_to_spec, merged_rules

AXES = ("data", "fsdp", "tensor")


def test_yaml_then_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {name: gpt, d_model: 64}\ntrain: {steps: 7, seed: 3}\nmesh: fsdp\n")
    cfg = config.load(path, ["train.steps=9", "model.n_layers=1", "mesh.tensor=2"])
    assert (cfg.train.steps, cfg.train.seed) == (9, 3)
    assert cfg.model.kwargs == {"d_model": 64, "n_layers": 1}
    assert (cfg.mesh.preset, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == ("fsdp", 1, -1, 2)


def test_changing_the_model_drops_the_old_models_arguments():
    cfg = config.load(ROOT / "configs" / "default.yaml", ["model.name=mlp", "model.hidden=[8]"])
    assert cfg.model.kwargs == {"hidden": [8]}


def test_defaults_come_from_the_schema_alone():
    cfg = config.load(None, [])
    assert cfg.train.dtype == "float32" and cfg.mesh.preset == "dp" and cfg.mesh.data == -1


DEFAULT = ROOT / "configs" / "default.yaml"


def run_dir(*overrides, path=DEFAULT) -> str:
    return config.load(path, list(overrides)).run.dir


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_each_shipped_config_runs_in_a_folder_named_after_it(path):
    assert "dir" not in ((config._read_yaml(path).get("run")) or {})  # the folder is derived, not written down
    assert run_dir(path=path) == f"runs/{path.stem}"


def test_what_is_trained_picks_the_folder_and_nothing_else_does():
    deeper = run_dir("model.n_layers=8", "train.dtype=bfloat16")
    assert deeper.startswith("runs/default-") and len(deeper) == len("runs/default-") + 8
    assert deeper == run_dir("train.dtype=bfloat16", "model.n_layers=8")  # order does not matter
    assert deeper == run_dir("model.n_layers=8", "train.dtype=bfloat16", "model.n_heads=4")  # the file's own value
    # Continuing or inspecting the same job, on any mesh: the same folder.
    same = ["train.steps=5000", "train.eval_every=5", "train.sample_len=0", "train.remat=none", "train.attention=xla",
            "train.skip_nonfinite=true", "train.deterministic=true", "data.prefetch=2", "mesh=fsdp", "mesh.tensor=2",
            "run.cpu_devices=8", "run.log_every=1", "checkpoint.every=5", "checkpoint.keep=1", "optimizer.lr=3e-3"]
    assert all(run_dir(o) == "runs/default" for o in same)
    assert run_dir(*same) == "runs/default"
    # Another job: another folder, each its own.
    other = ["model.n_layers=8", "model.d_ff=128", "model.name=mlp", "data.batch_size=16", "data.name=digits",
             "optimizer.lr=1e-3", "optimizer.clip_norm=0", "train.seed=1", "train.dtype=bfloat16", "train.loss=mse",
             "train.init_from=runs/x", "checkpoint.restore_from=runs/default"]
    folders = [run_dir(o) for o in other]
    assert len(set(folders)) == len(other) and "runs/default" not in folders
    assert run_dir("model.n_layers=8") == run_dir("model.n_layers=8")  # the same command, the same folder


def test_every_train_and_checkpoint_key_is_decided_one_way_or_the_other():
    """A new key must be placed: what is trained (its own folder) or a way to continue the same job."""
    continuing = {"train.steps", "train.remat", "train.attention", "train.deterministic", "train.skip_nonfinite",
                  "train.nonfinite", "train.max_rollbacks",
                  "train.grad_accum", "train.offload", "train.context_strategy",
                  "train.eval_every", "train.eval_batches", "train.sample_len", "train.sample_prompt",
                  "train.attention_precision", "train.grouped_matmul", "train.expert_exchange", "train.scan_layers",
                  "train.grpo.trust_code",
                  *(f"train.lm_eval.{k}" for k in ("tasks", "every", "include_path", "limit", "num_fewshot",
                                                    "batch_size")),
                  "checkpoint.enabled", "checkpoint.every", "checkpoint.keep", "checkpoint.async", "checkpoint.dir"}
    keys = {key for s in ("train", "checkpoint") for key, _, _ in config.keys_of(s)}
    assert keys == continuing | (config.JOB_KEYS & keys) and not continuing & config.JOB_KEYS


def test_an_explicit_run_dir_wins_and_null_asks_for_the_derived_one(tmp_path):
    assert run_dir("model.n_layers=8", "run.dir=runs/mine") == "runs/mine"
    assert run_dir("run.dir=null", "model.n_layers=8") == run_dir("model.n_layers=8")
    path = tmp_path / "fixed.yaml"
    path.write_text("model: {name: gpt, d_model: 64}\nrun: {dir: somewhere}\n")
    assert run_dir("model.n_layers=2", path=path) == "somewhere"


def test_a_config_outside_configs_is_told_apart_by_what_it_trains(tmp_path):
    """Two files of one name (experiments/a/config.yaml, experiments/b/config.yaml) never share a folder;
    the same file always gives the same one, and one like configs/default.yaml is not runs/default."""
    for name in "ab":
        (tmp_path / name).mkdir()
    (tmp_path / "a" / "default.yaml").write_text(DEFAULT.read_text())
    (tmp_path / "b" / "default.yaml").write_text(DEFAULT.read_text().replace("n_layers: 4", "n_layers: 2"))
    a, b = (run_dir(path=tmp_path / x / "default.yaml") for x in "ab")
    assert a.startswith("runs/default-") and b.startswith("runs/default-") and len({a, b, "runs/default"}) == 3
    assert (a == run_dir(path=tmp_path / "a" / "default.yaml")
            == run_dir("mesh=fsdp", path=tmp_path / "a" / "default.yaml"))
    assert config.load(None, []).run.dir == "runs/builtin"


def test_preset_rules_sit_under_user_rules():
    cfg = config.load(None, ["mesh.rules.embed=null", "mesh.rules.mlp=[fsdp,tensor]"])
    assert cfg.mesh.rules == {"embed": None, "mlp": ["fsdp", "tensor"]}
    rules = merged_rules(cfg.mesh.rules, AXES)
    assert rules["embed"] is None and rules["mlp"] == ("fsdp", "tensor")
    with pytest.raises(UserError, match="mesh.rules.embed"):
        merged_rules({"embed": "pipeline"}, AXES)


@pytest.mark.parametrize("sizes,n,expected", [
    ({"data": -1, "fsdp": 1, "tensor": 1}, 8, {"data": 8, "fsdp": 1, "tensor": 1}),
    ({"data": 1, "fsdp": -1, "tensor": 2}, 8, {"data": 1, "fsdp": 4, "tensor": 2}),
    ({"data": 2, "fsdp": 2, "tensor": 2}, 8, {"data": 2, "fsdp": 2, "tensor": 2}),
])
def test_mesh_sizes(sizes, n, expected):
    assert resolve_sizes(sizes, n) == expected


@pytest.mark.parametrize("sizes,match", [
    ({"data": -1, "fsdp": -1, "tensor": 1}, "at most one axis may be -1"),
    ({"data": 3, "fsdp": 1, "tensor": 1}, "needs 3 devices but 8"),
    ({"data": -1, "fsdp": 3, "tensor": 1}, "does not divide"),
    ({"data": 0, "fsdp": 1, "tensor": 1}, "positive integers or -1"),
])
def test_bad_mesh_sizes(sizes, match):
    with pytest.raises(UserError, match=match):
        resolve_sizes(sizes, 8)


def test_logical_names_drop_size_one_and_reused_axes():
    fsdp = {"data": 1, "expert": 1, "fsdp": 8, "tensor": 1}
    assert logical_to_spec(("embed", "mlp"), RULES, fsdp) == P("fsdp", None)
    assert logical_to_spec(("batch", "length", "embed"), RULES, fsdp) == P("fsdp", None, None)  # fsdp used by batch
    hybrid = {"data": 4, "expert": 1, "fsdp": 1, "tensor": 2}
    assert logical_to_spec(("batch", "length", "heads", "head_dim"), RULES, hybrid) == P("data", None, "tensor", None)
    both = {"data": 2, "expert": 1, "fsdp": 2, "tensor": 2}
    assert logical_to_spec(("batch", "vocab"), RULES, both) == P(("data", "fsdp"), "tensor")
    experts = {"data": 2, "expert": 4, "fsdp": 1, "tensor": 1}
    assert logical_to_spec(("experts", "embed", "mlp"), RULES, experts) == P("expert", None, None)
    assert logical_to_spec(("batch", "length"), RULES, experts) == P(("data", "expert"), None)
    with pytest.raises(UserError, match="logical axis 'widgets' has no rule"):
        logical_to_spec(("widgets",), RULES, both)


def test_text_values_stay_text_and_an_explicit_minus_one_wins():
    cfg = config.load(None, ["run.dir=off", "train.sample_prompt=2024-01-01", "mesh=dp", "mesh.tensor=-1"])
    assert cfg.run.dir == "off" and cfg.train.sample_prompt == "2024-01-01"
    assert (cfg.mesh.data, cfg.mesh.tensor) == (1, -1)


def test_a_single_text_file_is_split_by_bytes(tmp_path):
    from shard.data.sources import text_splits

    (tmp_path / "corpus.txt").write_bytes(bytes(range(256)) * 40)
    train, held_out = text_splits(str(tmp_path / "corpus.txt"), seq_len=16, eval_fraction=0.25)
    assert len(train.tokens) == 7680 and len(held_out.tokens) == 2560
    assert train[0]["targets"][0] == train[0]["inputs"][1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_names_real_model_arguments(path):
    from shard.core import registry

    cfg = config.load(path, [])
    registry.check_kwargs(registry.resolve(cfg.model.name), cfg.model.kwargs, cfg.model.name)


def test_deterministic_asks_xla_for_deterministic_gpu_kernels(monkeypatch):
    import os

    from shard import config
    from shard.run import distributed

    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    cfg = config.load(None, ["train.deterministic=true"])
    distributed.start(cfg.run, deterministic=cfg.train.deterministic)
    assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0 --xla_gpu_deterministic_ops=true"


@pytest.mark.parametrize("given,suggested", [("digits_cnn", "configs/digits_cnn.yaml"),
                                             ("digits_cnn.yaml", "configs/digits_cnn.yaml"),
                                             ("digit_cnn", "configs/digits_cnn.yaml"),  # a typo: the closest
                                             ("no/such/thing.yaml", None)])
def test_a_missing_config_file_suggests_one_in_configs(monkeypatch, given, suggested):
    monkeypatch.chdir(ROOT)
    with pytest.raises(UserError) as error:
        config.load(given, [])
    message = str(error.value)
    assert len(message.splitlines()) == 1 and f"config file {given!r} does not exist" in message
    assert (f"did you mean {suggested}?" in message) if suggested else "did you mean" not in message
    assert "configs/ holds: " in message and "default.yaml, digits_cnn.yaml, digits_mlp.yaml" in message


@pytest.mark.parametrize("text, value", [("1e5", 1e5), ("1E-4", 1e-4), ("1.5e+3", 1500.0), ("3e-3", 3e-3),
                                         ("1_000", 1000), (".5", 0.5), ("-2e3", -2000.0), ("1.0", 1.0)])
def test_numbers_read_in_every_usual_notation(tmp_path, text, value):
    """YAML 1.1 reads `1e5` as a string: model arguments (typed by the class, not the schema) were rejected."""
    cfg = config.load(None, [f"model.rope_theta={text}", f"optimizer.lr={text.lstrip('-')}"])
    assert cfg.model.kwargs["rope_theta"] == value and isinstance(cfg.model.kwargs["rope_theta"], type(value))
    assert cfg.optimizer.lr == abs(value)
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{name: gpt, rope_theta: {text}}}\n")
    assert config.load(path, []).model.kwargs["rope_theta"] == value


def test_text_that_looks_like_a_number_stays_text_where_the_key_is_text():
    cfg = config.load(None, ["train.sample_prompt=1e5", "model.activation=e5", "run.dir=1e3"])
    assert (cfg.train.sample_prompt, cfg.model.kwargs["activation"], cfg.run.dir) == ("1e5", "e5", "1e3")
