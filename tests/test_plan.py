"""The plan's figures against the published analyses (ZeRO, Megatron) and against the trained step."""

import json

import jax
import pytest

from conftest import TINY_GPT, overrides, run_cli
from shard import config
from shard.plan import analysis, meshes
from shard.plan import hlo
from shard.core import mesh as mesh_lib


def analyse(tmp_path, *extra):
    cfg = config.load(None, overrides(tmp_path, *TINY_GPT, "run.cpu_devices=8", *extra))
    return analysis.analyse(cfg, jax.devices()[:8])


def test_data_parallel_all_reduces_one_fp32_copy_of_the_gradients(tmp_path):
    p = analyse(tmp_path, "mesh=dp")
    psi = 4 * p["param_count"]  # gradient bytes
    n = 8
    assert p["collectives"]["all-gather"]["count"] == 0
    # the all-reduced bytes are the gradients plus a few scalars (loss, norms)
    assert psi <= p["collectives"]["all-reduce"]["bytes"] <= psi + 1024
    assert p["wire_bytes_per_device"] == pytest.approx(2 * (n - 1) / n * psi, rel=0.01)  # ZeRO's 2 Psi
    assert p["memory_per_device"]["params"] == psi  # every device a full copy


def test_fsdp_divides_the_state_and_stays_within_the_zero3_volume(tmp_path):
    p, dp = analyse(tmp_path, "mesh=fsdp"), analyse(tmp_path, "mesh=dp")
    psi, n = 4 * p["param_count"], 8
    mem = p["memory_per_device"]
    assert mem["params"] == pytest.approx(psi / n, rel=0.10)
    assert mem["optimizer"] == pytest.approx(dp["memory_per_device"]["optimizer"] / n, rel=0.10)
    # ZeRO-3: all-gather parameters (forward, backward) and reduce-scatter gradients, 3 Psi in all.
    # XLA's CPU backend lowers the gradient reduce-scatter to an all-reduce followed by a slice
    # (2 Psi instead of 1 by the ring model), so here the volume is up to 4 Psi (n-1)/n.
    gathered = p["collectives"]["all-gather"]["bytes"]
    assert psi <= gathered <= 2 * psi * 1.05
    assert p["wire_bytes_per_device"] <= 4 * psi * (n - 1) / n * 1.05
    assert p["wire_bytes_per_device"] >= 3 * psi * (n - 1) / n * 0.95


def test_tensor_parallel_all_reduces_activations_twice_forward_and_twice_backward_per_block(tmp_path):
    cfg = config.load(None, overrides(tmp_path, *TINY_GPT, "model.n_layers=3", "run.cpu_devices=8", "mesh=tp"))
    from shard.run.trainer import prepare

    step = prepare(cfg, jax.devices()[:8], training=False).train_step
    ops = hlo.collectives(step.as_text(), 8)
    in_blocks = [op for op in ops if op.kind == "all-reduce" and op.count == 3]  # inside the scanned blocks
    activation = 16 * 32 * 32 * 4  # (batch, length, d_model) float32
    # Megatron: f and g once each in attention and in the MLP, forward and backward. The compiler
    # merges the backward all-reduces of q's and kv's input gradients into one tuple op: still one
    # collective, of two activations' bytes.
    assert len(in_blocks) == 4
    assert sorted(op.bytes for op in in_blocks) == [activation] * 3 + [2 * activation]


def bytes_on(tree, device) -> int:
    """Bytes of the shards of a live tree's arrays that sit on this device."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


@pytest.mark.parametrize("mesh", ["fsdp", "tp"])
def test_plan_memory_is_what_the_live_state_holds_on_every_device(train, tmp_path, mesh):
    """The plan's parameter and optimizer bytes per device against the shards a real run's state holds
    on each device (read from the arrays, not from another compile of the same program)."""
    p = analyse(tmp_path / "plan", f"mesh={mesh}")["memory_per_device"]
    state = train(*TINY_GPT, "train.steps=1", "run.cpu_devices=8", f"mesh={mesh}").state
    devices = jax.devices()[:8]
    params = {d: bytes_on((state.params, state.rest), d) for d in devices}
    optimizer = {d: bytes_on(state.opt_state, d) for d in devices}
    assert params == {d: p["params"] for d in devices}
    assert optimizer == {d: p["optimizer"] for d in devices}
    total = sum(x.nbytes for x in jax.tree.leaves((state.params, state.rest)))
    assert p["params"] < total  # the mesh does split the parameters: not a comparison of whole copies


def test_dry_run_writes_plan_json_and_trains_nothing(tmp_path):
    done = run_cli(*TINY_GPT, "run.cpu_devices=8", "mesh=hybrid", f"run.dir={tmp_path}", "--dry-run",
                   "run.peak_tflops=100", "run.link_gbps=50", "run.device_memory_gb=0.0001")
    assert done.returncode == 0, done.stderr
    p = json.loads((tmp_path / "plan.json").read_text())
    assert (p["mesh"] == {"replica": 1, "stage": 1, "data": 4, "expert": 1, "fsdp": 1, "context": 1, "tensor": 2}
            and p["devices"] == 8)
    assert set(p["memory_per_device"]) >= {"params", "optimizer", "arguments", "temp", "total", "fits"}
    assert p["memory_per_device"]["fits"] is False  # 100 kB is too little
    assert p["estimated_step_s"] == pytest.approx(p["flops_per_device"] / 100e12 + p["wire_bytes_per_device"] / 50e9)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert "does NOT fit" in done.stdout


def test_compare_and_auto_pick_the_fastest_mesh_that_fits(tmp_path):
    cfg = config.load(None, overrides(tmp_path, *TINY_GPT, "run.cpu_devices=2", "run.peak_tflops=100",
                                      "run.link_gbps=50"))
    rows = meshes.compare(cfg, jax.devices()[:2])
    shapes = {tuple(r["mesh"].values()) for r in rows if "skipped" not in r}
    # every factorization of 2 (stage, data, expert, fsdp, context, tensor) but expert=2: the GPT has no
    # experts, so that is data parallel renamed; stage=2 cuts its 2 layers into 2 stages; context=2 splits
    # its sequences (language-model data)
    assert shapes == {(1, 2, 1, 1, 1, 1, 1), (1, 1, 2, 1, 1, 1, 1), (1, 1, 1, 1, 2, 1, 1), (1, 1, 1, 1, 1, 2, 1),
                      (1, 1, 1, 1, 1, 1, 2)}  # replica, stage, data, expert, fsdp, context, tensor
    staged = next(r for r in rows if r.get("mesh", {}).get("stage") == 2)
    assert staged["pipeline"]["stages"] == 2 and staged["pipeline"]["bubble"] == pytest.approx(1 / 5)
    assert any(r.get("skipped") == "no parameter is split on expert" for r in rows)
    chosen, why = meshes.chosen_config(cfg, rows)
    fastest = min((r for r in rows if "skipped" not in r), key=lambda r: r["estimated_step_s"])
    assert tuple(getattr(chosen.mesh, a) for a in mesh_lib.AXES) == \
        tuple(fastest["mesh"].values())
    assert why.startswith("mesh=auto chose ") and "fastest estimated step" in why
    assert "mesh" in meshes.comparison_table(rows)
    written = meshes.write_comparison(str(tmp_path), rows)
    assert [p.name for p in written] == ["compare.json", "compare.png"]
    assert json.loads(written[0].read_text()) == rows and written[1].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_identical_meshes_are_one_candidate_and_unknown_memory_is_said():
    """On one device every preset is the same mesh: one candidate under all its names. Where the
    device reports no memory limit, mesh=auto does not claim the meshes fit."""
    candidates = meshes.candidate_meshes(1)
    assert len(candidates) == 1 and candidates[0][0].startswith("cp = dp = ")
    assert candidates[0][0] == "cp = dp = ep = fsdp = pp = tp = zero1 = zero2"  # hybrid, fsdp_tp: tensor=2
    assert len({label for label, _ in meshes.candidate_meshes(8)}) == len(meshes.candidate_meshes(8))
    row = {"label": "dp", "preset": "dp", "mesh": {}, "estimated_step_s": None, "wire_bytes_per_device": 0,
           "memory_per_device": {"total": 1, "fits": None}}
    _, why = meshes.choose([row])
    assert "meshes that fit" not in why and "set run.device_memory_gb" in why
    _, why = meshes.choose([{**row, "memory_per_device": {"total": 1, "fits": True}}])
    assert "of 1 meshes that fit" in why
    skipped = {"label": "x", "skipped": "y" * 200}
    assert "y" * 200 in meshes.comparison_table([row, skipped])  # a reason is never cut


def test_collective_bytes_and_groups_in_every_hlo_notation():
    text = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups=[2,4]<=[8], to_apply=%add
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %ag = (f32[16]{0}, bf16[4]{0}) all-gather(%a, %b), replica_groups={{0,1},{2,3}}, dimensions={0}
  %rs = f32[2]{0} reduce-scatter(%a), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  %cp = f32[8]{0} collective-permute(%a), source_target_pairs={{0,1},{1,0}}
  %cq = f32[4]{0} collective-permute(%a), source_target_pairs={{0,0},{4,2},{2,4},{6,6}}
  %aa = f32[8]{0} all-to-all(%a), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}
}
"""
    found = hlo.collectives(text, 8)
    fixing = [op for op in found if op.kind == "collective-permute" and op.bytes == 16]
    assert fixing[0].senders == 2 / 8  # devices 0 and 6 keep their shard: only 4 and 2 send
    ops = {op.kind: op for op in found if op not in fixing}
    assert (ops["all-reduce"].count, ops["all-reduce"].group, ops["all-reduce"].bytes) == (5, 4, 32)
    assert (ops["all-gather"].group, ops["all-gather"].bytes) == (2, 16 * 4 + 4 * 2)
    assert ops["reduce-scatter"].group == 4 and ops["reduce-scatter"].wire_bytes == 3 * 8
    assert ops["collective-permute"].wire_bytes == 32 * 2 / 8  # devices 0 and 1 send, of 8: averaged per device
    assert ops["all-to-all"].group == 4
    table, wire = hlo.summary([op for op in ops.values() if op.kind != "all-to-all"])
    assert table["all-reduce"] == {"count": 5, "bytes": 160}
    assert wire == pytest.approx(5 * 2 * 3 / 4 * 32 + 1 / 2 * 72 + 24 + 8)


def test_an_instruction_whose_attributes_span_lines_keeps_the_rest_of_its_computation():
    """A Pallas kernel's custom-call prints its backend_config and frontend_attributes over several lines, some
    starting with `}`: the collectives after it in the loop body still count, with the loop's trip count."""
    text = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %k = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":
{"body": "a } b {", "cost_estimate": {"flops": 10}}
}, frontend_attributes={kernel_name="splash_mha_fwd",
kernel_metadata="{\\"block_q\\": 512}"
}
  %ar = f32[8]{0} all-reduce(f32[8]{0} %k), replica_groups=[2,4]<=[8], to_apply=%add
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"20"}}
}
"""
    comps, entry = hlo.computations(text)
    assert entry == "main" and len(comps["body"]) == 2 and comps["body"][0].count("splash_mha_fwd") == 1
    (reduce,) = hlo.collectives(text, 8)
    assert (reduce.kind, reduce.count, reduce.group) == ("all-reduce", 20, 4)


def test_mesh_auto_trains_with_the_chosen_mesh_and_says_why(tmp_path):
    done = run_cli(*TINY_GPT, "run.cpu_devices=2", "mesh=auto", f"run.dir={tmp_path}", "train.steps=2",
                   "run.progress=false", "train.sample_len=0", "train.eval_batches=1", "checkpoint.enabled=false")
    assert done.returncode == 0, done.stderr
    why = [line for line in done.stdout.splitlines() if line.startswith("mesh=auto chose")]
    assert len(why) == 1 and "fewest bytes sent per device" in why[0]  # a CPU: speed unknown
    saved = (tmp_path / "config.yaml").read_text()
    assert "preset: auto" not in saved
