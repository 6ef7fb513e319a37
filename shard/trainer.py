"""The training run, top to bottom: devices and mesh, model, data, sharded state, compiled steps, loop.

Everything that can be wrong with the user's input is checked (and compiled) before the run
directory is touched, so a bad config never overwrites anything.
"""

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from shard import checkpoint as ckpt_lib
from shard import config as config_lib
from shard import distributed
from shard import data as data_lib
from shard import flops as flops_lib
from shard import losses, optim, registry
from shard import mesh as mesh_lib
from shard import partition, paths, plan, stopping
from shard import state as state_lib
from shard import step as step_lib
from shard.errors import NonFiniteLoss, UserError, warn
from shard.generate import sample
from shard.metrics import MetricsLog, peak_flops, peak_memory_gb, seconds_since_process_start


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
    start_step: int = 0                          # where this run began (>0 after a resume)
    preempted: bool = False                      # stopped early by SIGTERM/SIGINT, checkpoint written


def run(cfg: config_lib.Config) -> Result:
    """The whole run. SIGTERM/SIGINT are honoured in every phase (shard/stopping.py)."""
    with stopping.StopRequest() as stop:
        return _run(cfg, stop)


def _run(cfg: config_lib.Config, stop: stopping.StopRequest) -> Result:
    run_dir = paths.resolve(cfg.run.dir)
    if not paths.is_remote(run_dir) and run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run.dir={cfg.run.dir!r} is a file; it must be a directory (new or from an earlier run)")

    # ---- devices, mesh, model, data, and the steps compiled (nothing allocated yet)
    if cfg.run.compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(Path(cfg.run.compile_cache).expanduser()))
    devices = distributed.start(cfg.run, deterministic=cfg.train.deterministic)  # joins the other processes first
    main = stop.main = jax.process_index() == 0
    say = print if main else (lambda *a, **k: None)
    cfg = plan.apply_auto(cfg, devices, say)  # mesh=auto: the fastest estimated mesh that fits
    model_cls = registry.resolve(cfg.model.name)
    model_kwargs = registry.with_defaults(model_cls, registry.check_kwargs(model_cls, cfg.model.kwargs, cfg.model.name))
    distributed.check_same_config(cfg, model_kwargs)  # before compiling: every process the same job
    resolved = config_lib.to_yaml(cfg, model_kwargs=model_kwargs)
    job = prepare(cfg, devices)
    data, graphdef = job.data, job.graphdef

    # ---- run directory: only now, with the input known to be good
    try:
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(resolved)
        checkpoints = None
        if cfg.checkpoint.enabled:
            checkpoints = ckpt_lib.Checkpoints(job.checkpoint_dir, keep=cfg.checkpoint.keep, use_async=cfg.checkpoint.async_)
    except OSError as e:
        raise UserError(f"run.dir={cfg.run.dir!r}: cannot write there ({e.strerror or e})") from None
    log = MetricsLog(run_dir)

    say(f"model {cfg.model.name}: {state_lib.count_params(job.abstract.params):,} parameters | mesh "
        f"{mesh_lib.describe(job.mesh)} on {len(devices)} {devices[0].platform} device(s) | task {data.task} | "
        f"{cfg.train.dtype}")
    say(state_lib.split_summary(job.split))
    if idle := state_lib.idle_axes(job.split, dict(job.mesh.shape)):
        warn(state_lib.idle_axis_warning(idle, job.split, dict(job.mesh.shape), cfg.mesh.auto_shard))

    # ---- state: resumed, restored from another run, or freshly initialised (always sharded)
    try:
        state = start_state(cfg, checkpoints, job.init, job.shardings, job.target, say)
        result = Result(graphdef=graphdef, shardings=job.shardings, mesh=job.mesh, train_step=job.train_step,
                        start_step=int(state.step))
        if result.start_step >= cfg.train.steps:
            say(f"the model is at step {result.start_step}, already past train.steps={cfg.train.steps}: nothing "
                f"to train; evaluating the step-{result.start_step} model (raise train.steps to train on)")
        else:
            stop.enter_phase("loop", "")
            state = train_loop(cfg, state, job, checkpoints, log, result, devices, main, stop)
    finally:
        if checkpoints:
            checkpoints.close()
    result.state = state
    if result.preempted:
        return result

    # ---- final eval and sample; every process takes part (the arrays are split across them)
    step = int(state.step)
    kept = f"checkpoint at step {step} is written" if checkpoints else "checkpoints are disabled"
    stop.enter_phase("the final eval and sample", f"{kept}; the final eval and sample were skipped", exit_code=0)
    result.eval = evaluate(job.eval_step, state, data, job.eval_shardings, cfg)
    log.write({"step": step, **result.eval})
    summary = " | ".join(f"{k} {v:.4f}" for k, v in result.eval.items())
    if result.history:
        summary = f"loss {result.history[0]['loss']:.4f} -> {result.history[-1]['loss']:.4f} | " + summary
    say(f"step {step}: {summary}")
    if data.task == "lm" and cfg.train.sample_len > 0:
        prompt = list(cfg.train.sample_prompt.encode())
        tokens = sample(graphdef, state.params, state.rest, prompt, cfg.train.sample_len,
                        window=cfg.data.seq_len, seed=cfg.train.seed)
        result.sample = bytes(t % 256 for t in tokens).decode("utf-8", errors="replace")
        say(f"sample:\n{cfg.train.sample_prompt}{result.sample}")
    return result


@dataclass
class Job:
    """Everything a run needs before it allocates anything: mesh, model, data, shardings, compiled steps."""
    mesh: object
    rules: dict
    model_cls: type
    kwargs: dict
    data: object
    schedule: object
    graphdef: object
    abstract: object     # the train state's shapes and dtypes
    init: object
    shardings: object
    batch_shardings: dict
    eval_shardings: dict
    target: object
    checkpoint_dir: object  # an etils.epath.Path: local, or a URL such as gs://
    train_step: object
    eval_step: object
    flops_per_step: float  # model FLOPs of one train step, all devices together (shard/flops.py)
    compile_s: float       # seconds to trace, lower and compile the train step
    split: list            # per parameter: shape, spec and how it was split (state.split_report)


def prepare(cfg: config_lib.Config, devices: list, training: bool = True) -> Job:
    """Mesh, model, data and the compiled steps for these devices. `training=False` (the plan)
    compiles only the train step and leaves checkpoints alone."""
    mesh = mesh_lib.build_mesh(cfg.mesh, devices)
    rules = partition.merged_rules(cfg.mesh.rules, mesh.axis_names)

    # ---- model, data, loss, optimizer
    model_cls = registry.resolve(cfg.model.name)
    kwargs = registry.check_kwargs(model_cls, cfg.model.kwargs, cfg.model.name)
    data = data_lib.build(cfg.data, cfg.train.seed)
    loss_fn = losses.resolve(cfg.train.loss, data.task)
    tx, schedule = optim.build(cfg.optimizer, cfg.train.steps)
    dtype = jnp.dtype(cfg.train.dtype)
    partition.check_attention(cfg.train.attention, devices[0], dtype)

    # ---- abstract state, shardings, checkpoints to read, compiled steps (nothing allocated yet)
    with partition.activate(mesh, rules, remat=cfg.train.remat, attention=cfg.train.attention):
        graphdef, abstract, init = state_lib.abstract_state(model_cls, kwargs, tx, cfg.train.seed, cfg.model.name)
        auto_min = state_lib.auto_min_size(cfg.mesh)
        shardings = state_lib.state_shardings(abstract, mesh, rules, auto_min)
        split = state_lib.split_report(abstract.params, dict(mesh.shape), rules, auto_min)
        batch = data.abstract_batch()
        batch_shardings = state_lib.batch_shardings(batch, mesh, rules)
        eval_batch = data.abstract_batch(eval=True)
        eval_shardings = state_lib.batch_shardings(eval_batch, mesh, rules)
        outputs = step_lib.model_outputs(graphdef, abstract, batch, cfg.model.name, data.num_classes)
        # Checkpoints to read must fit this model: checked before the (slower) compile.
        target = ckpt_lib.abstract_target(abstract, shardings)
        checkpoint_dir = paths.resolve(cfg.checkpoint.dir or paths.resolve(cfg.run.dir) / "checkpoints")
        if cfg.checkpoint.enabled and training:
            ckpt_lib.check_resumable(checkpoint_dir, target)
        for key, path in (("checkpoint.restore_from", cfg.checkpoint.restore_from),
                          ("train.init_from", cfg.train.init_from)):
            if path and training:
                ckpt_lib.check_path(path, key, target)
        context = (f"train.loss={loss_fn.__name__} does not fit outputs {tuple(outputs.shape)} and targets "
                   f"{tuple(batch['targets'].shape)} {batch['targets'].dtype} (task {data.task})")
        train_fn = step_lib.make_train_step(graphdef, tx, loss_fn, dtype, cfg.train.skip_nonfinite)
        compile_start = time.perf_counter()
        train_step, train_jaxpr = step_lib.compile_step(train_fn, abstract, shardings, batch, batch_shardings, mesh,
                                                        donate=True, returns_state=True, context=context)
        compile_s = time.perf_counter() - compile_start
        flops_per_step = flops_lib.jaxpr_flops(train_jaxpr.jaxpr)
        if cfg.train.remat != "none":  # MFU counts the model's FLOPs, not a recomputed forward: trace without.
            # A new function object: JAX caches traces by function, and the remat policy is not in its key.
            with partition.activate(mesh, rules, attention=cfg.train.attention):
                jaxpr = jax.make_jaxpr(lambda state, b: train_fn(state, b))(abstract, batch)
            flops_per_step = flops_lib.jaxpr_flops(jaxpr.jaxpr)
        eval_step = None if not training else step_lib.compile_step(
            step_lib.make_eval_step(graphdef, loss_fn, data.task, dtype), abstract, shardings, eval_batch,
            eval_shardings, mesh, donate=False, returns_state=False, context=context)[0]

    return Job(mesh, rules, model_cls, kwargs, data, schedule, graphdef, abstract, init, shardings,
               batch_shardings, eval_shardings, target, checkpoint_dir, train_step, eval_step, flops_per_step,
               compile_s, split)


def start_state(cfg, checkpoints, init, shardings, target, say) -> state_lib.TrainState:
    """This run's newest checkpoint wins; else `checkpoint.restore_from`; else a fresh init (plus
    `train.init_from` parameters). Every array is read or created straight into its sharding."""
    resumed = checkpoints.restore_latest(target) if checkpoints else None
    if resumed:
        state, meta = resumed
        say(f"resuming from step {meta['step']} of {checkpoints.directory}")
        planned = meta.get("train_steps", cfg.train.steps)
        if planned != cfg.train.steps and meta["step"] < cfg.train.steps:
            warn(f"train.steps={cfg.train.steps} but this run was started with {planned}: the learning-rate "
                 f"schedule (warmup, cosine decay) now spans {cfg.train.steps} steps, so from step {meta['step']} "
                 "on it differs from both runs; a bitwise resume needs the same train.steps")
        if meta.get("seed", cfg.train.seed) != cfg.train.seed:
            warn(f"train.seed={cfg.train.seed} but the checkpoint was trained with seed {meta['seed']}: "
                 "the data order from here on differs from the original run's")
        return state
    if cfg.checkpoint.restore_from:
        state, meta = ckpt_lib.restore_path(cfg.checkpoint.restore_from, "checkpoint.restore_from", target,
                                            model_only=False)
        say(f"restored step {meta['step']} from {cfg.checkpoint.restore_from}")
        return state
    state = state_lib.init_state(init, shardings)
    if cfg.train.init_from:
        loaded, meta = ckpt_lib.restore_path(cfg.train.init_from, "train.init_from", target, model_only=True)
        state = state.replace(params=loaded.params, rest=loaded.rest)
        say(f"parameters from step {meta['step']} of {cfg.train.init_from}")
    return state


def train_loop(cfg, state, job: Job, checkpoints, log, result, devices, main, stop) -> state_lib.TrainState:
    data, train_step, schedule = job.data, job.train_step, job.schedule
    flops = job.flops_per_step / len(devices)  # per device: the step's work is split evenly over the mesh
    peak = peak_flops(devices[0], cfg.run.peak_tflops)
    per_step = cfg.data.batch_size * (data.tokens_per_example or 1)
    rate_key = "tokens_per_s" if data.tokens_per_example else "examples_per_s"
    start = int(state.step)
    prefetch = prefetch_depth(cfg, devices)
    batches = data_lib.device_batches(data.train, job.batch_shardings, start=start, prefetch=prefetch)
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not (cfg.run.progress and main), mininterval=1.0,
               dynamic_ncols=True, leave=False)
    saved = checkpoints.steps() if checkpoints else []
    last_saved = saved[-1] if saved else None
    pending: list = []  # (step, device metrics) not yet looked at: no host transfer between log points
    skipped = 0
    jax.block_until_ready(state)
    # Processes enter the first step together: its collectives give a late peer only 30 s (gloo).
    distributed.barrier("first step", cfg.run.init_timeout_s)
    t_last, steps_since = time.perf_counter(), 0
    with contextlib.closing(batches):
        for step in range(start, cfg.train.steps):
            state, out = train_step(state, next(batches))
            done = step + 1
            # At most one step waits behind the running one: the device never idles, and a stop request
            # is seen (and the state checkpointed) within a step or two, not after a queue of them.
            if pending:
                jax.block_until_ready(pending[-1][1]["loss"])
            pending.append((done, out))
            steps_since += 1
            bar.update(1)
            stopping = stop.received  # read once: a signal may land mid-iteration
            log_now = done % cfg.run.log_every == 0 or done in (start + 1, cfg.train.steps)
            save_now = checkpoints is not None and (
                done == cfg.train.steps or stopping or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0))
            eval_now = cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != cfg.train.steps
            if not (log_now or save_now or eval_now or stopping):
                continue
            # Look at every step's loss since the last sync: stop (or count skips) at the first non-finite one,
            # before any checkpoint of that state could be written.
            fetched = jax.device_get([o for _, o in pending])
            for (s, _), o in zip(pending, fetched):
                if not o["finite"]:
                    if not cfg.train.skip_nonfinite:
                        kept = f"the last checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
                        raise NonFiniteLoss(f"loss is {float(o['loss'])} (gradient norm {float(o['grad_norm'])}) at "
                                            f"step {s}; stopped, {kept}. Lower optimizer.lr, or set "
                                            "train.skip_nonfinite=true to skip such updates")
                    skipped += 1
            pending.clear()
            if log_now:
                out = fetched[-1]
                step_time = (time.perf_counter() - t_last) / steps_since
                record = {"step": done, "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
                          "lr": float(schedule(step)), "step_time_s": step_time, rate_key: per_step / step_time}
                record |= {k: float(v) for k, v in out.items() if k not in ("loss", "grad_norm", "finite")}
                if flops:
                    record["tflops_per_device"] = flops / step_time / 1e12  # model FLOPs achieved
                    if peak:
                        record["mfu"] = flops / step_time / peak
                if (memory := peak_memory_gb()) is not None:
                    record["peak_memory_gb"] = memory
                if skipped:
                    record["skipped_steps"] = skipped
                if done == start + 1:  # start-up costs, once: process start to the end of the first step
                    record |= {"compile_s": job.compile_s, "startup_s": seconds_since_process_start()}
                log.write(record)
                result.history.append(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", **{rate_key: f"{record[rate_key]:,.0f}"})
            if save_now:
                checkpoints.save(state, done, data_position=done, seed=cfg.train.seed, train_steps=cfg.train.steps,
                                 wait=bool(stopping))
                last_saved = done
            if stopping:
                bar.close()
                where = f"checkpoint at step {done} in {checkpoints.directory}" if checkpoints else "no checkpoint (disabled)"
                if main:
                    print(f"{stopping}: stopped after step {done}; {where}; run again to resume", flush=True)
                result.preempted = True
                return state
            if eval_now:
                log.write({"step": done, **evaluate(job.eval_step, state, data, job.eval_shardings, cfg)})
            t_last, steps_since = time.perf_counter(), 0
    bar.close()
    return state


def prefetch_depth(cfg, devices) -> int:
    """data.prefetch, or by default 2 on accelerators and 0 on CPU: there JAX's asynchronous dispatch
    already reads the next batch while the step runs, and a thread would compete with XLA's."""
    if cfg.data.prefetch is not None:
        return cfg.data.prefetch
    return 0 if devices[0].platform == "cpu" else 2


def evaluate(eval_step, state, data: data_lib.Data, shardings: dict, cfg) -> dict:
    """Each eval metric over the eval split (its first `train.eval_batches` batches; 0 = all of it)."""
    n = len(data.eval) if cfg.train.eval_batches == 0 else min(cfg.train.eval_batches, len(data.eval))
    batches = data_lib.device_batches(data.eval, shardings, start=0,
                                      prefetch=min(2, prefetch_depth(cfg, jax.devices())))
    totals: dict = {}
    for _ in range(n):
        for k, v in jax.device_get(eval_step(state, next(batches))).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    batches.close()
    count = totals.pop("count")
    metrics = {"eval_loss": totals["loss"] / count}
    if "accuracy" in totals:
        metrics["eval_accuracy"] = totals["accuracy"] / count
    if "sse" in totals:
        variance = totals["y2"] - totals["y"] ** 2 / totals["values"]
        metrics["eval_r2"] = 1.0 - totals["sse"] / max(variance, 1e-12)
    if data.task == "lm":
        metrics["eval_bits_per_byte"] = metrics["eval_loss"] / math.log(2)
    return metrics
