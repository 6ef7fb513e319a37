"""The training run, top to bottom: devices and mesh, model, data, sharded state, compiled steps, loop.

Everything that can be wrong with the user's input is checked (and compiled) before the run
directory is touched, so a bad config never overwrites anything.
"""

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from shard import config as config_lib
from shard import data as data_lib
from shard import losses, optim, registry
from shard import mesh as mesh_lib
from shard import partition
from shard.errors import UserError
from shard import state as state_lib
from shard import step as step_lib
from shard.generate import sample
from shard.metrics import MetricsLog, compiled_flops, peak_flops


@dataclass
class Result:
    """What a run leaves behind, for callers (tests, notebooks) beyond metrics.jsonl."""
    history: list = field(default_factory=list)  # the train records written to metrics.jsonl
    eval: dict = field(default_factory=dict)     # the final eval_* metrics
    sample: str = ""
    state: object = None
    graphdef: object = None                      # nnx.merge(graphdef, state.params, state.rest) is the model
    shardings: object = None
    mesh: object = None
    train_step: object = None                    # the compiled step (memory_analysis, as_text)


def run(cfg: config_lib.Config) -> Result:
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run.dir={cfg.run.dir!r} is a file; it must be a directory (new or from an earlier run)")

    # ---- devices, mesh and rules
    devices = mesh_lib.select_devices(cfg.run.cpu_devices)
    mesh = mesh_lib.build_mesh(cfg.mesh, devices)
    rules = partition.merged_rules(cfg.mesh.rules, mesh.axis_names)
    main = jax.process_index() == 0

    # ---- model, data, loss, optimizer
    model_cls = registry.resolve(cfg.model.name)
    kwargs = registry.check_kwargs(model_cls, cfg.model.kwargs, cfg.model.name)
    data = data_lib.build(cfg.data, cfg.train.seed)
    loss_fn = losses.resolve(cfg.train.loss, data.task)
    tx, schedule = optim.build(cfg.optimizer, cfg.train.steps)
    dtype = jnp.dtype(cfg.train.dtype)

    # ---- abstract state, shardings, compiled steps (nothing allocated yet)
    with partition.activate(mesh, rules):
        graphdef, abstract, init = state_lib.abstract_state(model_cls, kwargs, tx, cfg.train.seed, cfg.model.name)
        shardings = state_lib.state_shardings(abstract, mesh, rules)
        batch = data.abstract_batch()
        batch_shardings = state_lib.batch_shardings(batch, mesh, rules)
        train_step = step_lib.compile_step(
            step_lib.make_train_step(graphdef, tx, loss_fn, dtype), abstract, shardings, batch,
            batch_shardings, mesh, donate=True, returns_state=True, model_name=cfg.model.name)
        eval_step = step_lib.compile_step(
            step_lib.make_eval_step(graphdef, loss_fn, data.task, dtype), abstract, shardings, batch,
            batch_shardings, mesh, donate=False, returns_state=False, model_name=cfg.model.name)

    # ---- run directory: only now, with the input known to be good
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = config_lib.to_yaml(cfg, model_kwargs=registry.with_defaults(model_cls, kwargs))
        (run_dir / "config.yaml").write_text(resolved)
    log = MetricsLog(run_dir)

    n_params = state_lib.count_params(abstract.params)
    say = print if main else (lambda *a, **k: None)
    say(f"model {cfg.model.name}: {n_params:,} parameters | mesh {mesh_lib.describe(mesh)} on "
        f"{len(devices)} {devices[0].platform} device(s) | task {data.task} | {cfg.train.dtype}")

    # ---- sharded init
    state = state_lib.init_state(init, shardings)

    # ---- the loop
    result = Result(graphdef=graphdef, shardings=shardings, mesh=mesh, train_step=train_step)
    flops = compiled_flops(train_step)
    peak = peak_flops(devices[0], cfg.run.peak_tflops)
    per_step = cfg.data.batch_size * (data.tokens_per_example or 1)
    rate_key = "tokens_per_s" if data.tokens_per_example else "examples_per_s"
    batches = data_lib.device_batches(data.train, batch_shardings, start=0, prefetch=cfg.data.prefetch)
    bar = tqdm(total=cfg.train.steps, disable=not (cfg.run.progress and main), mininterval=1.0,
               dynamic_ncols=True, leave=False)
    jax.block_until_ready(state)
    t_last, steps_since = time.perf_counter(), 0
    for step in range(int(state.step), cfg.train.steps):
        state, out = train_step(state, next(batches))
        steps_since += 1
        bar.update(1)
        done = step + 1
        if done % cfg.run.log_every == 0 or done in (1, cfg.train.steps):
            out = jax.device_get(out)  # the only host sync: once per log step
            step_time = (time.perf_counter() - t_last) / steps_since
            record = {"step": done, "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
                      "lr": float(schedule(step)), "step_time_s": step_time, rate_key: per_step / step_time}
            if flops and peak:
                record["mfu"] = flops / step_time / peak
            log.write(record)
            result.history.append(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", **{rate_key: f"{record[rate_key]:,.0f}"})
            t_last, steps_since = time.perf_counter(), 0
        if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != cfg.train.steps:
            log.write({"step": done, **evaluate(eval_step, state, data, batch_shardings, cfg)})
            t_last = time.perf_counter()
    bar.close()

    # ---- final eval and sample
    result.eval = evaluate(eval_step, state, data, batch_shardings, cfg)
    log.write({"step": cfg.train.steps, **result.eval})
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    say(f"step {cfg.train.steps}: loss {first:.4f} -> {last:.4f} | "
        + " | ".join(f"{k} {v:.4f}" for k, v in result.eval.items()))
    if data.task == "lm" and cfg.train.sample_len > 0 and main:
        prompt = list(cfg.train.sample_prompt.encode())
        tokens = sample(graphdef, state.params, state.rest, prompt, cfg.train.sample_len,
                        window=cfg.data.seq_len, seed=cfg.train.seed)
        result.sample = bytes(t % 256 for t in tokens).decode("utf-8", errors="replace")
        say(f"sample:\n{cfg.train.sample_prompt}{result.sample}")
    result.state = state
    return result


def evaluate(eval_step, state, data: data_lib.Data, batch_shardings: dict, cfg) -> dict:
    """Mean of each eval metric over the first `train.eval_batches` batches of the eval split."""
    n = min(cfg.train.eval_batches, len(data.eval))
    totals: dict = {}
    for i in range(n):
        batch = next(data_lib.device_batches(data.eval, batch_shardings, start=i, prefetch=0))
        for k, v in jax.device_get(eval_step(state, batch)).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    metrics = {f"eval_{k}": v / n for k, v in totals.items()}
    if data.task == "lm" and data.tokens_per_example:
        metrics["eval_bits_per_byte"] = metrics["eval_loss"] / math.log(2)
    return metrics
