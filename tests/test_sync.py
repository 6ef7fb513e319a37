"""Replicas that meet every H steps (train.sync=local_sgd/diloco over mesh.replica): the limits where they
equal synchronous data parallelism, DiLoCo's outer step by hand, bitwise resume between syncs, the plan's
cross-replica bytes (1/H of a sync's, each fragment 1/F), 2 processes as 2 replicas, and bad input."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shard
from conftest import TINY_GPT, overrides
from shard import config
from shard.plan import analysis
from shard.strategies import sync
from shard.run import trainer
from shard.errors import UserError
from shard.core.state import TrainState

STEPS = ["train.steps=6", "run.log_every=1"]
PLAIN_SGD = ["optimizer.name=sgd", "optimizer.lr=0.5", "optimizer.clip_norm=0", "optimizer.weight_decay=0"]


def losses(result):
    return [r["loss"] for r in result.history]


def test_allreduce_over_replicas_is_data_parallelism_and_local_sgd_every_step_is_too(train):
    data = losses(train(*TINY_GPT, *STEPS, "run.cpu_devices=4", "mesh.data=4", subdir="data"))
    replicas = losses(train(*TINY_GPT, *STEPS, "run.cpu_devices=4", "mesh.replica=4", subdir="replica"))
    assert replicas == data  # exactly: the same reduction over the same 4 devices
    # SGD is linear in the gradient: averaging the replicas' parameters after every step is averaging gradients
    sgd = losses(train(*TINY_GPT, *STEPS, *PLAIN_SGD, "run.cpu_devices=8", "mesh.data=8", subdir="sgd"))
    local = train(*TINY_GPT, *STEPS, *PLAIN_SGD, "run.cpu_devices=8", "mesh.replica=4", "mesh.data=2",
                  "train.sync=local_sgd", "train.sync_every=1", subdir="local")
    np.testing.assert_allclose(losses(local), sgd, rtol=1e-5)
    assert sgd[-1] < sgd[0]


def test_diloco_outer_step_by_hand():
    s = sync.Sync("diloco", replicas=2, every=4, fragments=(((0, None),),), outer_lr=0.7, outer_momentum=0.9)
    anchor = jnp.array([1.0, 2.0, 3.0])
    state = sync.init(s, lambda: TrainState(jnp.zeros((), jnp.int32), {"w": anchor}, {}, ()))()
    momentum, expected = np.zeros(3), np.asarray(anchor)
    for replicas in ([[0.5, 2.5, 3.0], [1.5, 1.0, 2.0]], [[0.0, 1.0, 1.0], [0.2, 1.2, 2.0]]):
        state = state.replace(params={"w": jnp.array(replicas)})
        state = jax.jit(sync.sync_program(s, 0))(state)
        outer_gradient = expected - np.mean(replicas, axis=0)  # the last sync's parameters minus the replicas'
        momentum = 0.9 * momentum + outer_gradient
        expected = expected - 0.7 * (outer_gradient + 0.9 * momentum)  # Nesterov
        np.testing.assert_allclose(np.asarray(state.outer["anchor"]["w"]), expected, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(state.params["w"]), [expected, expected], rtol=1e-6)


DILOCO = [*TINY_GPT, "train.steps=10", "run.log_every=1", "run.cpu_devices=8", "mesh.replica=4", "mesh.data=2",
          "train.sync=diloco", "train.sync_every=4", "train.sync_fragments=2", "checkpoint.enabled=true",
          "checkpoint.every=6"]


def test_diloco_resumes_bitwise_between_two_syncs(tmp_path):
    whole = trainer.run(config.load(None, overrides(tmp_path / "whole", *DILOCO)))
    assert whole.history[-1]["loss"] < whole.history[0]["loss"]
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "10")  # stopped after step 6: syncs at 2, 4 behind, 6, 8 ahead
    resumed = trainer.run(config.load(None, overrides(tmp_path / "resumed", *DILOCO)))
    assert resumed.start_step == 6
    assert losses(resumed) == losses(whole)[6:]  # bitwise
    model = shard.load_model(str(tmp_path / "whole"))  # DiLoCo's outer model (steps 9-10 ran apart since the sync at 8)
    anchor = np.asarray(whole.state.outer["anchor"]["tok"].get_value())
    np.testing.assert_allclose(np.asarray(model.tok.get_value()), anchor, rtol=1e-6)
    assert not np.allclose(anchor, np.mean(np.asarray(whole.state.params["tok"].get_value()), axis=0))


def test_the_plan_counts_what_crosses_between_replicas(tmp_path):
    def costs(*extra):
        cfg = config.load(None, overrides(tmp_path, *TINY_GPT, "run.cpu_devices=8", "mesh.replica=4", "mesh.data=2",
                                          *extra))
        return analysis.analyse(cfg, jax.devices())

    every, fourth = (costs("train.sync=local_sgd", "train.sync_every=1"),
                     costs("train.sync=local_sgd", "train.sync_every=4"))
    synced = every["sync"]["cross_replica_bytes_per_step"]
    psi = every["param_count"] * 4
    assert synced == pytest.approx(2 * 3 / 4 * psi, rel=0.3)  # one all-reduce of the parameters over 4 replicas
    assert fourth["sync"]["cross_replica_bytes_per_step"] == pytest.approx(synced / 4)
    assert fourth["sync"]["bytes_per_sync_peak"] == pytest.approx(synced)
    streaming = costs("train.sync=diloco", "train.sync_every=4", "train.sync_fragments=3")["sync"]
    assert streaming["cross_replica_bytes_per_step"] == pytest.approx(synced / 4, rel=0.05)
    assert streaming["bytes_per_sync_peak"] < 0.6 * synced
    allreduce = costs()["sync"]
    assert allreduce["mode"] == "allreduce" and allreduce["cross_replica_bytes_per_step"] > 0.9 * synced
    # the local steps themselves send nothing across replicas: only the inner data axis's reduction
    assert fourth["wire_bytes_per_device"] - fourth["sync"]["cross_replica_bytes_per_step"] < 0.6 * allreduce[
        "cross_replica_bytes_per_step"]


@pytest.mark.parametrize("extra,message", [
    (["train.sync=diloco"], "needs replicas to sync: set mesh.replica > 1"),
    (["train.sync=local_sgd", "mesh.replica=2", "train.grad_accum=2"], "train.grad_accum cannot run in"),
    (["train.sync=diloco", "mesh.replica=2", "train.sync_every=2", "train.sync_fragments=4"],
     "at most train.sync_every=2"),
])
def test_bad_sync_settings_are_one_line(tmp_path, extra, message):
    with pytest.raises(UserError, match=message):
        analysis.analyse(config.load(None, overrides(tmp_path, *TINY_GPT, "run.cpu_devices=8", *extra)), jax.devices())


def test_two_processes_as_two_replicas_give_the_one_process_curve(train, tmp_path):
    from test_multihost import losses as logged, train_processes

    args = [*STEPS, "mesh.replica=2", "mesh.data=-1", "train.sync=diloco", "train.sync_every=2"]
    one = train(*TINY_GPT, *args, "run.cpu_devices=8")
    train_processes(tmp_path / "two", 2, *args, "mesh.dcn_replica=2")
    np.testing.assert_allclose(logged(tmp_path / "two"), losses(one), rtol=1e-5)


# ----------------------------------------------------------------------------- checkpoints of another layout

PLAIN = [*TINY_GPT, "train.steps=8", "checkpoint.enabled=true", "checkpoint.every=8"]
QUIET = ["optimizer.lr=1e-7", "optimizer.warmup_steps=0"]  # the inner steps move nothing visible
TWO = ["train.steps=10", "run.cpu_devices=4", "mesh.replica=2", "mesh.data=2", "train.sync=diloco",
       "train.sync_every=2", "checkpoint.enabled=true", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    return folder, trainer.run(config.load(None, overrides(folder, *PLAIN)))


def test_diloco_from_a_plain_checkpoint_starts_at_its_eval_loss(plain_run, tmp_path):
    folder, plain = plain_run
    seeded = trainer.run(config.load(None, overrides(tmp_path / "init", *TINY_GPT, *TWO, *QUIET, "train.steps=2",
                                                     f"train.init_from={folder}")))
    # the anchor starts at the loaded model: the outer step after step 2 keeps it there (a random anchor would
    # pull it back toward a random model's loss)
    assert seeded.eval["eval_loss"] == pytest.approx(plain.eval["eval_loss"], abs=1e-3)
    restored = trainer.run(config.load(None, overrides(tmp_path / "restored", *TINY_GPT, *TWO, *QUIET,
                                                       f"checkpoint.restore_from={folder}")))
    assert restored.start_step == 8
    assert restored.eval["eval_loss"] == pytest.approx(plain.eval["eval_loss"], abs=1e-3)


def test_changing_mesh_replica_resumes_from_the_global_view(plain_run, tmp_path, capsys):
    folder, plain = plain_run
    args = [*TINY_GPT, *TWO, *QUIET, f"train.init_from={folder}"]
    trainer.run(config.load(None, overrides(tmp_path, *args, "train.steps=2")))
    more = trainer.run(config.load(None, overrides(tmp_path, *args, "train.steps=4", "mesh.replica=4", "mesh.data=1")))
    assert more.start_step == 2 and "not a bitwise resume" in capsys.readouterr().err
    assert more.eval["eval_loss"] == pytest.approx(plain.eval["eval_loss"], abs=1e-3)


def test_streaming_fragments_cut_stacked_layers_into_equal_shares(tmp_path):
    f = 4  # the stacked MLP weights are each ~40% of this model: cut by arrays, the peak was 2.1/F
    costs = lambda *extra: analysis.analyse(config.load(None, overrides(
        tmp_path, *TINY_GPT, "model.n_layers=8", "model.d_ff=512", "run.cpu_devices=8", "mesh.replica=4", "mesh.data=2",
        "train.sync=diloco", "train.sync_every=4", *extra)), jax.devices())["sync"]
    full, streaming = costs()["bytes_per_sync_peak"], costs(f"train.sync_fragments={f}")
    assert streaming["bytes_per_sync_peak"] <= 1.2 / f * full
    assert streaming["cross_replica_bytes_per_step"] == pytest.approx(full / 4, rel=0.05)


def test_a_fragment_of_layers_is_the_outer_step_of_those_layers():
    # b, w in tree order
    s = sync.Sync("diloco", replicas=2, every=2, fragments=(((1, (0, 1)),), ((1, (1, 2)), (0, None))))
    w, b = jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([5.0])
    state = sync.init(s, lambda: TrainState(jnp.zeros((), jnp.int32), {"w": w, "b": b}, {}, ()))()
    moved = state.replace(params={"w": jnp.stack([w + 1, w - 3]), "b": jnp.stack([b, b + 2])})
    first = jax.jit(sync.sync_program(s, 0))(moved)
    whole = sync.Sync("diloco", replicas=2, every=2, fragments=(((0, None), (1, None)),))
    both = jax.jit(sync.sync_program(whole, 0))(moved)
    np.testing.assert_allclose(first.outer["anchor"]["w"][0], both.outer["anchor"]["w"][0])  # layer 0 synced
    np.testing.assert_allclose(first.outer["anchor"]["w"][1], w[1])                          # layer 1 not yet
    np.testing.assert_allclose(first.params["w"][:, 1], moved.params["w"][:, 1])
    second = jax.jit(sync.sync_program(s, 1))(first)
    np.testing.assert_allclose(second.outer["anchor"]["w"], both.outer["anchor"]["w"], rtol=1e-6)
    np.testing.assert_allclose(second.params["b"], both.params["b"], rtol=1e-6)


def test_local_sgd_keeps_no_anchor_and_resumes_a_checkpoint_that_has_one(tmp_path):
    from shard.run.checkpoint import Checkpoints

    args = [*TINY_GPT, "train.steps=2", "run.log_every=1", "run.cpu_devices=4", "mesh.replica=2", "mesh.data=2",
            "train.sync=local_sgd", "train.sync_every=2"]
    half = trainer.run(config.load(None, overrides(tmp_path / "half", *args)))
    assert half.state.outer is None
    curves = []
    for name, outer in (("now", None), ("before", {"anchor": sync.global_view(half.state).params, "opt": None})):
        saved = Checkpoints(tmp_path / name / "checkpoints", keep=2, use_async=False)  # "before": as local SGD saved
        saved.save(half.state.replace(outer=outer), 2, 0, 2, wait=True)
        saved.close()
        resumed = trainer.run(config.load(None, overrides(tmp_path / name, *args, "train.steps=4",
                                                          "checkpoint.enabled=true")))
        assert resumed.start_step == 2
        curves.append(losses(resumed))
    assert curves[1] == curves[0]  # the same state read back, the anchor left behind
