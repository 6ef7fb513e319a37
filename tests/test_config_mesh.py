"""Config loading and precedence, mesh sizes, and the logical-axis mapping."""

import pytest
from jax.sharding import PartitionSpec as P

from conftest import ROOT
from shard import config
from shard.errors import UserError
from shard.mesh import resolve_sizes
from shard.partition import RULES, logical_to_spec, merged_rules

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
    from shard import registry

    cfg = config.load(path, [])
    registry.check_kwargs(registry.resolve(cfg.model.name), cfg.model.kwargs, cfg.model.name)


def test_deterministic_asks_xla_for_deterministic_gpu_kernels(monkeypatch):
    import os

    from shard import config, distributed

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
