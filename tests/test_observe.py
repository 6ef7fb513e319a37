"""Seeing a run: TensorBoard event files, curves.png and `python -m shard.plot`, the profiler's trace,
the input wait, and the --compare picture."""

import gzip
import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, TINY_GPT, TINY_MLP, overrides, subprocess_env

PNG = b"\x89PNG\r\n\x1a\n"
RUN = [*TINY_GPT, "train.steps=8", "run.log_every=2", "run.cpu_devices=1", "checkpoint.enabled=true",
       "checkpoint.every=4", "run.tensorboard=true", "run.plot=true"]


def train(run_dir, *extra):
    from shard import config
    from shard.run import trainer

    return trainer.run(config.load(None, overrides(run_dir, *RUN, *extra)))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run of 8 steps that loses its step-8 checkpoint (as if it had crashed after logging steps 6
    and 8), then resumed from step 4 with another learning rate, so steps 5-8 log other losses."""
    run_dir = tmp_path_factory.mktemp("observed")
    first = train(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "8")
    second = train(run_dir, "optimizer.lr=1e-2")
    assert second.start_step == 4
    return run_dir, first, second


def scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events, [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_has_the_logged_values_and_a_resume_duplicates_no_step(resumed):
    run_dir, first, second = resumed
    expected = {r["step"]: r["loss"] for r in first.history if r["step"] <= 4}
    expected |= {r["step"]: r["loss"] for r in second.history}
    assert sorted(expected) == [1, 2, 4, 5, 6, 8]
    assert expected[8] != next(r["loss"] for r in first.history if r["step"] == 8)  # the resume changed it
    events, loss = scalars(run_dir, "train/loss")
    assert [s for s, _ in loss] == [1, 2, 4, 5, 6, 8]  # steps 6 and 8 of the lost run were purged
    np.testing.assert_allclose([v for _, v in loss], [expected[s] for s, _ in loss], rtol=1e-6)
    _, eval_loss = scalars(run_dir, "eval/loss")
    assert [s for s, _ in eval_loss] == [8] and eval_loss[0][1] == pytest.approx(second.eval["eval_loss"])
    tags = set(events.Tags()["scalars"])
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s", "perf/data_wait_s",
            "perf/tflops_per_device", "eval/bits_per_byte", "model/parameters"} <= tags
    from shard.core import state as state_lib

    assert scalars(run_dir, "model/parameters")[1][0][1] == state_lib.count_params(second.state.params)
    text = events.Tensors("config/text_summary")
    assert len(text) == 2 and [t.step for t in text] == [0, 4]  # the run's config, and the resumed one's
    assert b"d_model: 32" in text[-1].tensor_proto.string_val[0] and b"lr: 0.01" in text[-1].tensor_proto.string_val[0]


def test_two_runs_opened_in_the_same_second_keep_their_own_event_files(tmp_path):
    from shard.observe.board import Board

    boards = [Board(tmp_path, 0), Board(tmp_path, 0)]  # event files are named by second and host
    for i, board in enumerate(boards):
        board.write({"step": 1, "loss": float(i)})
        board.close()
    assert len(list(tmp_path.iterdir())) == 2  # neither overwrote the other


def test_curves_png_shows_the_metrics_it_was_drawn_from(resumed):
    from shard.observe import plot

    run_dir, first, second = resumed
    assert (run_dir / "curves.png").read_bytes().startswith(PNG)
    run = plot.load_run(run_dir)
    steps, values = plot.series(run.records, "loss")
    assert steps == [1, 2, 4, 5, 6, 8]  # the resumed run's records win where steps repeat
    assert values[-1] == second.history[-1]["loss"] and values[0] == first.history[0]["loss"]
    assert plot.default_metrics([run]) == ["loss", "eval_loss", "tokens_per_s"]
    fig = plot.draw([run], ["loss", "eval_loss"])
    loss_panel, eval_panel = fig.axes
    np.testing.assert_array_equal(loss_panel.lines[0].get_xydata(), np.c_[steps, values])
    np.testing.assert_array_equal(eval_panel.lines[0].get_xydata(), [[8, second.eval["eval_loss"]]])


def test_labels_name_the_config_values_that_differ():
    from shard.observe.plot import Run, labels

    runs = [Run("a", [], {"optimizer.lr": 0.001, "mesh.preset": "dp", "run.dir": "runs/a", "train.steps": 9}),
            Run("b", [], {"optimizer.lr": 0.003, "mesh.preset": "dp", "run.dir": "runs/b", "train.steps": 9})]
    assert labels(runs) == ["a (optimizer.lr=0.001)", "b (optimizer.lr=0.003)"]
    assert labels(runs[:1]) == ["a"]


def plot_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "shard.plot", *map(str, args)], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)


def test_plot_cli_draws_several_runs_and_refuses_bad_input_in_one_line(resumed, tmp_path):
    run_dir, _, _ = resumed
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n')
    out = tmp_path / "both.png"
    proc = plot_cli(run_dir, other, "--metrics", "loss,grad_norm", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes().startswith(PNG) and f"wrote {out}" in proc.stdout
    # Without --out, several runs are drawn beside the working directory, never over the first run's own picture.
    own = (run_dir / "curves.png").read_bytes()
    proc = plot_cli(run_dir, other, cwd=tmp_path)
    assert proc.returncode == 0 and "wrote compare.png" in proc.stdout, proc.stderr
    assert (tmp_path / "compare.png").read_bytes().startswith(PNG) and (run_dir / "curves.png").read_bytes() == own
    for args, named in [((tmp_path / "nowhere",), "does not exist"),
                        ((tmp_path,), "no metrics.jsonl"),
                        ((other, "--metrics", "loss,bleu"), "bleu"),
                        ((other, "--out", tmp_path / "x.jpg"), "x.jpg"),
                        ((), "RUN_DIR")]:
        proc = plot_cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and named in lines[0], proc.stderr
    assert sorted(p.name for p in other.iterdir()) == ["metrics.jsonl"]  # nothing written on refusal


def test_profile_traces_the_range_of_steps_and_only_those(tmp_path, capsys):
    from shard import config
    from shard.run import trainer

    trainer.run(config.load(None, overrides(tmp_path, *TINY_MLP, "train.steps=5", "run.log_every=1",
                                            "run.cpu_devices=1", "run.profile_steps=2:4")))
    assert f"profile of steps 2-3: {tmp_path / 'profile'}" in capsys.readouterr().out
    assert len(list(tmp_path.glob("profile/plugins/profile/*/*.xplane.pb"))) == 1  # TensorBoard / XProf
    (trace,) = tmp_path.glob("profile/plugins/profile/*/perfetto_trace.json.gz")
    events = json.load(gzip.open(trace))["traceEvents"]
    assert sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train") == [2, 3]


def test_data_wait_is_the_time_the_loop_waits_for_input(tmp_path, monkeypatch):
    from shard import config
    from shard.run import trainer
    from shard import data as data_lib

    real = data_lib.device_batches

    def slow(*args, **kwargs):  # an input pipeline that takes 50 ms a batch
        for batch in real(*args, **kwargs):
            time.sleep(0.05)
            yield batch

    monkeypatch.setattr(data_lib, "device_batches", slow)
    result = trainer.run(config.load(None, overrides(tmp_path, *TINY_MLP, "train.steps=4", "run.log_every=1",
                                                     "run.cpu_devices=1")))
    for r in result.history:
        assert 0.05 <= r["data_wait_s"] <= r["step_time_s"], r


def test_the_compare_picture_marks_the_chosen_mesh():
    from shard.observe.plot import draw_comparison

    def row(label, ms, mb):
        return {"label": label, "devices": 8, "estimated_step_s": ms / 1e3, "wire_bytes_per_device": 1,
                "memory_per_device": {"total": mb * 1e6, "capacity": 80e6, "fits": mb < 80}}

    rows = [row("dp", 5.0, 90), row("fsdp", 6.0, 30), {"label": "tp", "skipped": "heads"}]
    ax = draw_comparison(rows, "fsdp").axes[0]
    np.testing.assert_allclose(ax.collections[0].get_offsets(), [[5.0, 90], [6.0, 30]])
    np.testing.assert_allclose(ax.collections[1].get_offsets(), [[6.0, 30]])  # the ring round the chosen one
    assert ax.lines[0].get_ydata()[0] == pytest.approx(80)  # device memory
