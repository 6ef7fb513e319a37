"""Pipeline parallelism (`stage` axis): the loss curve of one device under GPipe and circular
schedules mixed with the other axes, checkpoints that move between pipelined and other meshes, and
the plan's account of the schedule (bubble, memory per stage, bytes passed between stages)."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, TINY_GPT, TINY_MODELS, one_device_runs, overrides, run_cli
from shard import config
from shard.plan import analysis
from shard.plan import hlo
from shard.strategies import pipeline

DEEP = [*TINY_GPT, "model.n_layers=8"]  # 8 layers: 4 stages of 2, or 2 stages x 2 repeats of 2
STEPS = ["train.steps=8", "run.log_every=1"]
MESHES = {
    "stage=4 x data=2": ["mesh=pp", "mesh.stage=4", "mesh.data=2"],
    # interleaved 1F1B (the step's loss and gradient computed by the schedule), fsdp splitting each stage's layers
    "stage=2 x fsdp=4, interleaved 1f1b": ["mesh=pp", "mesh.stage=2", "mesh.fsdp=4", "pipeline.repeats=2",
                                           "pipeline.schedule=1f1b"],
    "stage=2 x tensor=2 x data=2": ["mesh=pp", "mesh.stage=2", "mesh.tensor=2", "mesh.data=2"],
    "stage=2 x data=4, circular": ["mesh=pp", "mesh.stage=2", "mesh.data=4", "pipeline.repeats=2"],
    # every row on every stage outside the stack (the rule without `stage`): the stages gather nothing
    "stage=4 x data=2, rows on every stage": ["mesh=pp", "mesh.stage=4", "mesh.data=2",
                                              "mesh.rules.batch=[replica,data,expert,fsdp]"],
}


def losses(result) -> np.ndarray:
    return np.array([r["loss"] for r in result.history])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_device_runs(tmp_path_factory, {"deep": DEEP}, *STEPS)("deep")


@pytest.mark.parametrize("mesh", list(MESHES))
def test_pipelined_runs_give_the_one_device_curve(train, reference, mesh):
    result = train(*DEEP, *STEPS, "run.cpu_devices=8", *MESHES[mesh])
    expected = losses(reference)
    assert expected[-1] < expected[0]  # it learns, so the comparison means something
    np.testing.assert_allclose(losses(result), expected, rtol=1e-5)
    # the stacked layers are split over the stages: each stage's devices hold only theirs
    w = result.state.params["blocks"]["ffn"]["w_in"].get_value()
    stages = result.mesh.shape["stage"]
    assert w.sharding.spec[0] == "stage" and w.addressable_shards[0].data.shape[0] == 8 // stages


def test_a_mixture_of_experts_pipelined_over_expert_parallel_devices_gives_the_one_device_curve(train,
                                                                                                 tmp_path_factory):
    """Its balancing loss is a product of batch means: each layer records the means, which a pipeline
    averages over equal microbatches into the whole batch's, and the model multiplies them after."""
    moe = [*TINY_MODELS["moe"], *STEPS]
    reference = one_device_runs(tmp_path_factory, {"moe": moe})("moe")
    result = train(*moe, "run.cpu_devices=8", "mesh=pp", "mesh.stage=2", "mesh.expert=4")
    np.testing.assert_allclose(losses(result), losses(reference), rtol=1e-5)
    np.testing.assert_allclose([r["aux_loss"] for r in result.history], [r["aux_loss"] for r in reference.history],
                               rtol=1e-5)


def test_checkpoints_move_between_pipelined_and_other_meshes(train, tmp_path, reference):
    save = ["checkpoint.enabled=true", "checkpoint.async=false", "checkpoint.every=4"]
    train(*DEEP, *STEPS, *save, "run.cpu_devices=8", *MESHES["stage=4 x data=2"], subdir="staged")
    shutil.rmtree(tmp_path / "staged" / "checkpoints" / "8")  # as if it had stopped after step 4
    expected = losses(reference)[4:]
    for devices, mesh in (("8", ["mesh=fsdp"]), ("4", ["mesh=pp", "mesh.stage=2", "mesh.data=2"])):
        result = train(*DEEP, *STEPS, *save, f"run.cpu_devices={devices}", *mesh,
                       f"checkpoint.restore_from={tmp_path / 'staged'}", subdir=f"on{devices}")
        assert result.start_step == 4
        np.testing.assert_allclose(losses(result), expected, rtol=1e-4)


def test_a_circular_schedule_moves_no_weights_and_its_checkpoints_keep_the_layer_order(train, tmp_path, reference):
    """The state keeps the stacked layers in schedule order (each stage's groups its own rows), so the step
    has no all-to-all; the result and the checkpoints are in the model's order, resumable on any mesh."""
    save = ["checkpoint.enabled=true", "checkpoint.async=false", "checkpoint.every=4"]
    result = train(*DEEP, *STEPS, *save, "run.cpu_devices=8", *MESHES["stage=2 x data=4, circular"], subdir="circ")
    ops = hlo.collectives(result.train_step.as_text(), 8)
    assert not [op for op in ops if op.kind == "all-to-all"]
    # and the gradients are reduced over `data` once a step, not at every microbatch a layer group passes
    assert all(op.count == 1 for op in ops if op.kind == "all-reduce")
    weights = lambda r: np.asarray(r.state.params["blocks"]["ffn"]["w_in"].get_value())
    np.testing.assert_allclose(weights(result), weights(reference), rtol=1e-4, atol=1e-6)
    shutil.rmtree(tmp_path / "circ" / "checkpoints" / "8")
    for mesh in (["mesh=fsdp"], MESHES["stage=2 x data=4, circular"]):
        resumed = train(*DEEP, *STEPS, *save, "run.cpu_devices=8", *mesh,
                        f"checkpoint.restore_from={tmp_path / 'circ'}", subdir=f"on-{mesh[-1]}")
        assert resumed.start_step == 4
        np.testing.assert_allclose(losses(resumed), losses(reference)[4:], rtol=1e-4)


def test_the_plan_shows_the_schedule_its_memory_and_what_stages_pass(tmp_path):
    cfg = config.load(None, overrides(tmp_path, *DEEP, *MESHES["stage=4 x data=2"]))
    devices = jax.devices()[:8]
    p = analysis.analyse(cfg, devices)
    S, R, M = 4, 1, 8  # microbatches default to twice the stages
    assert p["pipeline"] == {"schedule": "gpipe", "stages": S, "repeats": R, "microbatches": M, "layers_per_stage": [2],
                             "bubble": pytest.approx((S - 1) / (R * M + S - 1))}
    assert "bubble (S-1)/(R*M+S-1) = 27.3%" in analysis.report(p)
    # parameters and Adam's moments per device: the stacked layers' 1/S, the rest whole (data only copies)
    from shard.run import job

    prepared = job.prepare(cfg, devices, training=False)
    stacked = sum(a.size * 4 for path, a in jax.tree_util.tree_leaves_with_path(prepared.work.abstract.params)
                  if "blocks" in jax.tree_util.keystr(path))
    one = analysis.analyse(config.load(None, overrides(tmp_path, *DEEP)), devices[:1])["memory_per_device"]
    assert p["memory_per_device"]["params"] == one["params"] - stacked + stacked // S
    assert p["memory_per_device"]["optimizer"] - 2 * (one["params"] - stacked + stacked // S) < 64  # Adam: m, v, counts
    # What the stages pass: one microbatch's activations (per device: its data-parallel share) for each
    # of the R*M+S-1 iterations, forward and backward.
    micro_bytes = (16 // M // 2) * 32 * 32 * 4  # examples per device x length x width x float32
    ops = hlo.collectives(prepared.train_step.as_text(), 8)
    passed = [op for op in ops if op.kind == "collective-permute" and op.bytes == micro_bytes]
    assert sum(op.count * op.wire_bytes for op in passed) == pytest.approx(2 * (R * M + S - 1) * micro_bytes)
    # Each stage holds its own rows outside the stack: stage s sends its K = M/S microbatches to stage 0,
    # which sends each stage its outputs at the end, forward and backward; nothing broadcasts the batch to
    # every stage (XLA's shift of a padded block also sends from stages that hold only padding).
    rows = [op for op in ops if op.kind == "collective-permute" and op.bytes == M // S * micro_bytes]
    ideal = 4 * (S - 1) / S * M // S * micro_bytes
    assert ideal <= sum(op.count * op.wire_bytes for op in rows) <= 1.5 * ideal
    assert not [op for op in ops if op.kind in ("all-reduce", "all-gather") and op.bytes == M * micro_bytes]
    # The bubble in the executed work: matrix-product FLOPs the compiled program runs (loops counted
    # through their trip counts) against one device's, per layer (from 8 and 4 layers) and outside the
    # stack. Each stage's devices run their layers' share stretched by 1/(1 - bubble), and what lies
    # outside the stack (embedding, output layer) for their rows: 1/(data x stage) of the batch.
    def executed(*args, devices=devices[:1]):
        return hlo.dot_flops(job.prepare(config.load(None, overrides(tmp_path, *TINY_GPT, *args)), devices,
                                         training=False).train_step.as_text())

    per_layer = (executed("model.n_layers=8") - executed("model.n_layers=4")) / 4
    outside = executed("model.n_layers=8") - 8 * per_layer
    expected = outside / (2 * S) + 8 * per_layer / 8 / (1 - p["pipeline"]["bubble"])  # data=2 copies of each stage
    assert hlo.dot_flops(prepared.train_step.as_text()) == pytest.approx(expected, rel=0.03)


def test_1f1b_holds_the_activations_of_fewer_microbatches_than_gpipe(tmp_path):
    """4 stages, 16 microbatches, every activation kept (train.remat=none): GPipe's temporaries hold each layer's
    activations for all R M + S - 1 = 19 iterations, 1F1B's for at most 2 S - 1 = 7 visits in flight."""
    from shard.run import job

    base = [*TINY_GPT, "model.n_layers=4", "model.max_len=64", "data.seq_len=64", "data.batch_size=32", "mesh=pp",
            "mesh.stage=4", "pipeline.microbatches=16", "train.remat=none"]
    gpipe, one = (job.prepare(config.load(None, overrides(tmp_path, *base, *extra)), jax.devices()[:4], training=False)
                  for extra in ([], ["pipeline.schedule=1f1b"]))
    temp = lambda prepared: prepared.train_step.memory_analysis().temp_size_in_bytes
    assert temp(one) <= 0.6 * temp(gpipe)
    strategy = one.strategy("pipeline")
    p = strategy.plan(one, [], 4)["pipeline"]
    assert (p["held"]["slots"], p["held"]["gpipe_iterations"]) == (7, 19)
    assert p["bubble"] == pytest.approx(3 / 19)
    lines = strategy.report({"pipeline": p})
    assert "(1F1B), 16 microbatches" in lines[0] and "at most 7 microbatch visits" in lines[1]


# A stack of residual layers with dropout inside them: random state the pipeline must advance per microbatch.
DROPOUT = ["model.name=stock_models:StackedResidual", "model.layers=4", "data.name=synthetic", "data.features=[16]",
           "data.classes=8", "data.batch_size=16", "optimizer.lr=1e-2", "train.steps=6", "run.log_every=1"]


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory):
    return one_device_runs(tmp_path_factory, {"dropout": DROPOUT}, "train.grad_accum=4")("dropout")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_model_with_dropout_pipelined_gives_the_curve_of_one_device_with_as_many_microbatches(
        train, dropout_reference, schedule):
    """A pipelined step is a step over M microbatches, each layer drawing its masks microbatch after microbatch
    from its own stream: the random numbers of `train.grad_accum=M` on one device, so the same curve. Without
    the accumulation the curve cannot be equal: one device draws each layer's mask for the whole batch at once.
    1F1B runs a microbatch's backward between later forwards: the same masks (its head runs per microbatch too)."""
    reference = dropout_reference
    result = train(*DROPOUT, "run.cpu_devices=2", "mesh=pp", "mesh.stage=2", "pipeline.microbatches=4",
                   f"pipeline.schedule={schedule}")
    np.testing.assert_allclose(losses(result), losses(reference), rtol=1e-5)
    # each layer's stream advanced once per microbatch and step, as on one device
    count = lambda r: np.asarray(r.state.rest["blocks"]["norm"]["rngs"]["count"].get_value())
    np.testing.assert_array_equal(count(result), count(reference))
    assert (count(result) == 4 * 6).all()


def test_pipelined_dropout_masks_differ_between_microbatches_layers_and_steps():
    """The masks themselves: a stack of bare Dropout layers over ones shows each example's mask product."""
    from flax import nnx

    from shard.models.layers import stacked
    from shard.nn import hooks, partition

    layers = stacked(4, lambda r: nnx.Dropout(0.5, rngs=r), nnx.Rngs(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    x = jnp.ones((8, 64))

    @nnx.jit
    def step(layers, x):
        with partition.activate(mesh, partition.merged_rules({}, mesh.axis_names)), \
                hooks.use(pipeline=pipeline.Schedule(2, 2, 4)):
            return hooks.stack(layers, x)

    first, second = np.asarray(step(layers, x)), np.asarray(step(layers, x))
    micro = first.reshape(2, 4, 64).swapaxes(0, 1)  # microbatch m holds examples m, m + 4
    assert all(not np.array_equal(micro[0], micro[m]) for m in range(1, 4))
    assert not np.array_equal(first, second)  # the next step draws new masks
    kept = (first != 0).mean()
    assert 0.03 < kept < 0.1  # four layers each keeping half: 1/16 of the entries survive
    assert np.asarray(nnx.state(layers, nnx.RngCount)["rngs"]["count"].get_value()).tolist() == [8] * 4


def test_a_model_with_batch_statistics_in_its_stacked_layers_is_refused_under_a_pipeline(tmp_path):
    proc = run_cli(*overrides(tmp_path, *DROPOUT, "model.norm=batchnorm", "run.cpu_devices=2", "mesh=pp",
                              "mesh.stage=2"), cwd=ROOT / "tests")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "batch statistics" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert "mesh.stage" in lines[0]


@pytest.mark.parametrize("stages,repeats,micro", [(4, 1, 8), (4, 2, 8), (2, 3, 4), (3, 2, 6)])
def test_the_1f1b_table_keeps_every_dependency_and_gpipes_bubble(stages, repeats, micro):
    """Tick by tick: each visit's forward one tick after the stage before it ran it (stage S-1's output feeds stage 0's
    next repeat), its backward one tick after the stage after it, its slot untouched in between; the bubble, each tick
    as long as its slowest stage (a backward twice a forward), is (S-1)/(R M + S - 1), smaller with more repeats."""
    from shard.strategies.pipeline_1f1b import Table

    S, R, M = stages, repeats, micro
    table = Table(S, R, M)
    fwd, bwd, cost = {}, {}, 0
    for t in range(table.ticks):
        busy = [0] * S
        for s in range(S):
            ok, m, r, slot = table.forward(t, s)
            if ok:
                fwd[m, r, s] = (t, slot)
                busy[s] += 1
            ok, m, r, slot = table.backward(t, s)
            if ok:
                bwd[m, r, s] = (t, slot)
                busy[s] += 2
        cost += max(busy)
    assert len(fwd) == len(bwd) == M * R * S
    order = [(r, s) for r in range(R) for s in range(S)]  # the groups a microbatch passes, in the model's order
    for m in range(M):
        for (r0, s0), (r1, s1) in zip(order, order[1:]):
            assert fwd[m, r1, s1][0] == fwd[m, r0, s0][0] + 1
            assert bwd[m, r0, s0][0] == bwd[m, r1, s1][0] + 1
        assert bwd[m, R - 1, S - 1][0] == fwd[m, R - 1, S - 1][0]  # the loss's tick: forward, head, backward
        for (r, s), (t0, slot) in ((k[1:], v) for k, v in fwd.items() if k[0] == m):
            t1, read = bwd[m, r, s]
            assert read == slot and not [k for k, v in fwd.items() if k[2] == s and t0 < v[0] <= t1 and v[1] == slot]
    assert cost == (M * R + S - 1) * 3 and 1 - M * R * 3 / cost == pytest.approx(pipeline.bubble(S, R, M))
    assert R == 1 or pipeline.bubble(S, R, M) < pipeline.bubble(S, 1, M)


def test_1f1b_refuses_what_it_cannot_average_or_pipeline_in_one_line():
    """Float state the stacked layers update (a mixture of experts' recorded loads) and a second stack, each one
    line naming the setting and what to use instead."""
    from flax import nnx

    from shard.errors import UserError
    from shard.strategies.pipeline_1f1b import Stack, refuse

    loads = nnx.State({"ffn": {"load": nnx.Variable(jnp.zeros(3))}})
    for found, words in ((Stack(rest=loads, calls=1), "float state (ffn/load"),
                         (Stack(rest=nnx.State({}), calls=2), "runs 2 stacks")):
        with pytest.raises(UserError) as e:
            refuse(found, 2, 4)
        assert words in str(e.value) and "pipeline.schedule=gpipe" in str(e.value) and "\n" not in str(e.value)
