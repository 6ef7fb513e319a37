"""Low-rank adapters (train.lora.*): only the adapters train and hold optimizer state, the weights stay bitwise
as loaded, the adapters shard like the weights they adapt, and every reader of the model sees the merged weights."""

import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import shard
from conftest import TINY_GPT, overrides, same_curve_as_one_device, run_cli
from shard import config
from shard.plan import analysis
from shard.errors import UserError

LORA = ["train.lora.rank=4", "train.lora.targets=[q,k,v,o,mlp]", "optimizer.lr=3e-2"]
BASE = [*TINY_GPT, "train.steps=4", "run.log_every=1", "model.mlp=swiglu", "model.n_kv_heads=4", *LORA]


def saved(run_dir, step: int) -> dict:
    manager = ocp.CheckpointManager(run_dir / "checkpoints", item_handlers={
        "model": ocp.PyTreeCheckpointHandler(), "optimizer": ocp.PyTreeCheckpointHandler()})
    got = manager.restore(step, args=ocp.args.Composite(model=ocp.args.PyTreeRestore(),
                                                        optimizer=ocp.args.PyTreeRestore()))
    manager.close()
    return got


def _at(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def leaves(tree) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture
def base_run(train, tmp_path):
    """A trained model to fine-tune (train.init_from): 2 steps without adapters."""
    train(*BASE, "train.lora.rank=0", "train.steps=2", "checkpoint.enabled=true", subdir="base")
    return tmp_path / "base"


def test_only_the_adapters_train_and_the_weights_stay_bitwise(train, tmp_path, base_run, capsys):
    result = train(*BASE, f"train.init_from={base_run}", "checkpoint.enabled=true", "checkpoint.every=1",
                   "checkpoint.keep=5")
    assert "model gpt: 36,160 parameters (4,096 trained, the rest frozen)" in capsys.readouterr().out
    start = saved(base_run, 2)["model"]["params"]
    for step in (1, 4):
        got = saved(tmp_path / "run", step)
        for a, b in zip(leaves(start), leaves(got["model"]["params"])):
            np.testing.assert_array_equal(a, b)  # the weights: bitwise as loaded
        adapters = got["optimizer"]["extra"]["lora"]
        assert len(leaves(adapters)) == 2 * 7  # (q, k, v, o, gate, in, out) pairs, stacked over the layers
        n_adapter = sum(a.size for a in leaves(adapters))
        n_opt = sum(a.size for a in leaves(got["optimizer"]["opt_state"]) if a.ndim)
        assert n_opt == 2 * n_adapter  # Adam's two moments (besides its scalar counters), the adapters' alone
    b = leaves(_at(saved(tmp_path / "run", 4)["optimizer"]["extra"]["lora"], ("blocks", "attn", "q", "lora_b")))[0]
    assert np.abs(b).max() > 0  # B starts at zero and has moved
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_the_first_step_is_the_base_models_and_readers_see_the_merged_weights(train, tmp_path, base_run):
    plain = train(*BASE, "train.lora.rank=0", f"train.init_from={base_run}", "train.steps=1", subdir="plain")
    tuned = train(*BASE, f"train.init_from={base_run}", "checkpoint.enabled=true", subdir="tuned")
    assert tuned.history[0]["loss"] == plain.history[0]["loss"]  # B = 0: the adapted model is the base one
    model = shard.load_model(str(tmp_path / "tuned"))
    got = saved(tmp_path / "tuned", 4)
    params, ad = got["model"]["params"], got["optimizer"]["extra"]["lora"]
    scale = 8 / 4  # alpha defaults to 2 x rank
    one = lambda tree, *keys: leaves(_at(tree["blocks"]["attn"], keys))[0]
    w, a, b = one(params, "q"), one(ad, "q", "lora_a"), one(ad, "q", "lora_b")
    np.testing.assert_allclose(model.blocks.attn.q[...], w + scale * np.einsum("lir,lrhd->lihd", a, b), rtol=1e-5,
                               atol=1e-6)
    kv, ka, kb = one(params, "kv"), one(ad, "kv", "v", "lora_a"), one(ad, "kv", "v", "lora_b")
    np.testing.assert_allclose(model.blocks.attn.kv[...][:, :, 1], kv[:, :, 1] + scale * np.einsum(
        "lir,lrhd->lihd", ka, kb), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(model.blocks.attn.kv[...][:, :, 0] == kv[:, :, 0], False)  # k has its own pair
    np.testing.assert_array_equal(model.tok[...], leaves(params["tok"])[0])  # not a target: as it was
    # the run's eval is the merged model's (the frozen weights alone evaluate as the base run: 5.56)
    assert tuned.eval["eval_loss"] < plain.eval["eval_loss"] - 0.5


def test_resume_is_bitwise(train, tmp_path):
    whole = train(*BASE, "checkpoint.enabled=true", "checkpoint.every=2")
    ad = leaves(saved(tmp_path / "run", 4)["optimizer"])
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")  # as if stopped after step 2
    resumed = train(*BASE, "checkpoint.enabled=true", "checkpoint.every=2")
    assert resumed.start_step == 2
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history][2:]
    assert resumed.eval == whole.eval
    for a, b in zip(ad, leaves(saved(tmp_path / "run", 4)["optimizer"])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mesh", [["mesh=fsdp_tp", "mesh.tensor=2", "run.cpu_devices=4"],  # (fsdp and tp each in it)
                                  # 1F1B: the schedule differentiates the merged weights (QLoRA's test runs GPipe)
                                  ["mesh=pp", "model.n_layers=4", "run.cpu_devices=2", "pipeline.schedule=1f1b"],
                                  ["mesh=dp", "train.grad_accum=2", "run.cpu_devices=4"]],
                         ids=["fsdp_tp", "pipeline_1f1b", "accumulation"])
def test_on_any_mesh_the_curve_is_one_devices(train, mesh):
    same_curve_as_one_device(train, BASE, mesh)


def test_adapters_shard_like_their_weights(tmp_path):
    from shard.run import job as job_lib

    cfg = config.load(None, overrides(tmp_path, *BASE, "mesh=fsdp_tp", "mesh.tensor=2", "run.cpu_devices=4"))
    job = job_lib.prepare(cfg, jax.devices()[:4], training=False)
    spec = lambda v: tuple(jax.tree.leaves(v)[0].spec) + (None,) * 8
    params, ad = job.shardings.params, job.shardings.extra["lora"]
    q, out = spec(params["blocks"]["attn"]["q"]), spec(params["blocks"]["attn"]["out"])
    assert any(q) and any(out)
    assert spec(ad["blocks"]["attn"]["q"]["lora_a"])[:3] == (*q[:2], None)           # layers, embed | rank
    assert spec(ad["blocks"]["attn"]["q"]["lora_b"])[:4] == (q[0], None, *q[2:4])    # layers | rank | heads, head_dim
    assert spec(ad["blocks"]["attn"]["out"]["lora_a"])[:4] == (*out[:3], None)        # layers, heads, head_dim | rank
    assert spec(ad["blocks"]["attn"]["out"]["lora_b"])[:3] == (out[0], None, out[3])


def test_the_plan_counts_adapters_and_their_optimizer_state(tmp_path):
    args = [*BASE, "run.cpu_devices=4", "mesh=fsdp"]
    full = analysis.analyse(config.load(None, overrides(tmp_path, *args, "train.lora.rank=0")), jax.devices()[:4])
    tuned = analysis.analyse(config.load(None, overrides(tmp_path, *args)), jax.devices()[:4])
    lora = tuned["lora"]
    assert lora["trainable_params"] > 0 and lora["frozen_params"] == full["param_count"]
    mem, full_mem = tuned["memory_per_device"], full["memory_per_device"]
    share = lora["adapter_bytes_per_device"] / full_mem["params"]
    # Adam's two moments of the adapters alone; gradients of the adapters alone
    assert mem["optimizer"] == pytest.approx(2 * lora["adapter_bytes_per_device"], rel=0.01)
    assert mem["optimizer"] == pytest.approx(full_mem["optimizer"] * share, rel=0.05)
    assert mem["gradients"] == lora["adapter_bytes_per_device"]
    assert mem["params"] == full_mem["params"]
    assert mem["temp"] < full_mem["temp"]  # no gradient buffer for the frozen weights that are not adapted
    assert any(line.strip().startswith("lora: rank 4, alpha 8") for line in analysis.report(tuned).splitlines())


@pytest.mark.parametrize("extra, message", [
    (["train.lora.targets=[q,nothing]"], "train.lora.targets: 'nothing' matches no weight of model 'gpt'; its "
                                         "targets are: q, k, v, o, mlp, head, pos, tok"),
    (["train.lora.rank=-1"], "train.lora.rank=-1: the adapters' rank must be positive"),
    (["train.lora.alpha=0"], "train.lora.alpha=0: must be positive"),
    (["mesh=zero1", "run.cpu_devices=2"], "train.lora.rank=4 with mesh.zero=1: ZeRO splits optimizer state"),
    (["train.ema=0.5"], "train.lora.rank=4 with train.ema=0.5: train.ema averages the frozen weights"),
])
def test_bad_input_is_one_line(tmp_path, extra, message):
    with pytest.raises(UserError, match="^" + message.replace("[", r"\[")):
        analysis.analyse(config.load(None, overrides(tmp_path, *BASE, *extra)), jax.devices()[:2])


def test_a_whole_state_without_adapters_is_refused(train, tmp_path, base_run):
    with pytest.raises(UserError, match=r"holds no adapters .* start from its weights with train.init_from="):
        train(*BASE, f"checkpoint.restore_from={base_run}")


def test_the_command_line_refuses_targets_that_match_nothing(tmp_path):
    proc = run_cli(*overrides(tmp_path, *BASE, "train.lora.targets=[qq]"), "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("its targets are: q, k, v, o, mlp, head, pos, tok")


def test_every_adapter_is_a_matrix_to_weight_decay():
    from shard.core import optim
    from shard.core import state as state_lib
    from shard.models.gpt import GPT
    from shard.strategies import adapters

    model = nnx.eval_shape(lambda: state_lib.build_model(GPT, dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                                                   d_ff=64, mlp="swiglu"), 0))
    site_list = adapters.sites(GPT, nnx.state(model, nnx.Param), ("q", "k", "v", "o", "mlp"), "gpt")
    ad = jax.eval_shape(lambda: adapters.create(site_list, 4, 0))
    assert len(jax.tree.leaves(ad)) == 14 and all(jax.tree.leaves(optim.decay_mask(ad)))


def test_any_models_weights_are_targets_by_name(train):
    from conftest import TINY_MODELS

    result = train(*TINY_MODELS["mlp"], "train.steps=3", "run.log_every=1", "train.lora.rank=2",
                   "train.lora.targets=[kernel]")
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_a_stock_flax_models_adapters_train_the_one_device_curve_under_fsdp(train):
    """A model of Flax's stock layers (no logical names): its nnx.Linear kernels are targets by name, and their
    adapters, split by the automatic rule like the kernels, train as on one device."""
    stock = ["model.name=stock_models:StockTransformer", "model.d=64", "data.name=text", "data.seq_len=32",
             "data.batch_size=16", "train.steps=3", "run.log_every=1", "train.lora.rank=4",
             "train.lora.targets=[kernel]"]
    same_curve_as_one_device(train, stock, ["mesh=fsdp", "run.cpu_devices=4"])
