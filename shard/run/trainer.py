"""The training run, top to bottom: devices and mesh, model, data, sharded state, compiled steps, loop.

Everything that can be wrong with the user's input is checked (and compiled) before the run
directory is touched, so a bad config never overwrites anything.
"""

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from shard.run import checkpoint as ckpt_lib
from shard import config as config_lib
from shard import data as data_lib
from shard.data import tokenizer as tokenizer_lib
from shard.run import badsteps, distributed, host_malloc, lm_eval_hook, stopping, watchdog
from shard.use import generate
from shard.plan import hardware
from shard.plan import target as target_lib
from shard import hf, paths
from shard.hf import read as hf_read
from shard.observe import goodput, profiling, wandb_log
from shard.core import mesh as mesh_lib
from shard.core import state as state_lib
from shard.observe.outputs import draw_curves, metrics_log
from shard.errors import NonFiniteLoss, UserError, warn
from shard.run.job import Job, prepare
from shard.run.evaluation import evaluate, prefetch_depth
from shard.observe.metrics import peak_memory_gb, run_began, seconds_of_startup


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


def run(cfg: config_lib.Config, devices: list | None = None) -> Result:
    """The whole run. SIGTERM/SIGINT are honoured in every phase (shard/run/stopping.py). `devices`: those
    distributed.start returned where the caller has joined the processes already (train.py); None joins here."""
    run_began()
    with stopping.StopRequest() as stop:
        return _run(cfg, stop, devices)


def _run(cfg: config_lib.Config, stop: stopping.StopRequest, devices: list | None) -> Result:
    run_dir = paths.resolve(cfg.run.dir)
    if cfg.run.wandb:
        wandb_log.require()  # missing: one line, before anything starts
    if not paths.is_remote(run_dir) and run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run.dir={cfg.run.dir!r} is a file; it must be a directory (new or from an earlier run)")

    # ---- devices, mesh, model, data, and the steps compiled (nothing allocated yet)
    if cfg.run.compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(Path(cfg.run.compile_cache).expanduser()))
    if devices is None:  # joins the other processes first
        devices = distributed.start(cfg.run, deterministic=cfg.train.deterministic)
    host_malloc.for_training(cfg.run, devices)
    main = stop.main = jax.process_index() == 0
    say = print if main else (lambda *a, **k: None)
    lm_eval_hook.check(cfg)  # train.lm_eval's tasks exist: before the job is compiled
    job = prepare(cfg, devices, flags=target_lib.compiler_flags(cfg.run, devices[0]))
    work, data = job.work, job.work.data
    lm_eval_hook.check_task(cfg, data.task)
    # Each process reads the batch rows its devices hold (all of them where an axis such as `stage`
    # copies the batch across processes).
    data_lib.use_rows(data, job.batch_shardings["inputs"], work.batch["inputs"].shape)

    # ---- run directory: only now, with the input known to be good
    try:
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(work.resolved)
            tokenizer_lib.keep(cfg.data, run_dir)  # the folder stays all a trained model needs
        checkpoints = None
        if cfg.checkpoint.enabled:
            checkpoints = ckpt_lib.Checkpoints(job.checkpoint_dir, keep=cfg.checkpoint.keep,
                                               use_async=cfg.checkpoint.async_)
    except OSError as e:
        raise UserError(f"run.dir={cfg.run.dir!r}: cannot write there ({e.strerror or e})") from None

    only = f" ({state_lib.count_params(t):,} trained, the rest frozen)" if (t := job.trained()) is not None else ""
    say(f"model {cfg.model.name}: {state_lib.count_params(work.abstract.params):,} parameters{only} | mesh "
        f"{mesh_lib.describe(job.mesh)} on {len(devices)} {devices[0].platform} device(s) | task {data.task} | "
        f"{cfg.train.dtype}")
    say(f"run folder: {run_dir}")
    say(state_lib.split_summary(job.split))
    if idle := state_lib.idle_axes(job.split, dict(job.mesh.shape)):
        warn(state_lib.idle_axis_warning(idle, job.split, dict(job.mesh.shape), cfg.mesh.auto_shard))
    for note in job.notes():  # what a strategy had to settle for
        warn(note)

    # ---- state: resumed, restored from another run, or freshly initialised (always sharded)
    log = None
    spent = goodput.Recorder(run_dir, main)  # where the wall time goes, across restarts
    spent.span("compile", job.compile_s)
    try:
        try:
            with spent.timed("restore"):  # e.g. a circular pipeline's layer order
                state = job.to_running(start_state(cfg, checkpoints, job, say))
                work.objective.start(job, state, run_dir, main)  # e.g. DPO's reference log-likelihoods, once
            result = Result(graphdef=work.graphdef, shardings=job.shardings, mesh=job.mesh,
                            train_step=job.train_step, start_step=int(state.step))
            plan = {"model": cfg.model.name, "parameters": state_lib.count_params(work.abstract.params),
                    "mesh": mesh_lib.describe(job.mesh), "devices": len(devices),
                    "split": state_lib.split_summary(job.split)}
            log = metrics_log(cfg, run_dir, result.start_step, work, main, plan)
            if result.start_step >= cfg.train.steps:
                say(f"the model is at step {result.start_step}, already past train.steps={cfg.train.steps}: nothing "
                    f"to train; evaluating the step-{result.start_step} model (raise train.steps to train on)")
            else:
                stop.enter_phase("loop", "")
                state = train_loop(cfg, state, job, checkpoints, log, result, devices, main, stop, spent)
        finally:
            if checkpoints:
                checkpoints.close()  # waits for the last save: a stop from here on finds it written
        result.state = job.to_stored(state)  # the model's own layout
        if result.preempted:
            spent.end()
            return result

        # ---- final eval and sample; every process takes part (the arrays are split across them)
        step = int(state.step)
        kept = f"checkpoint at step {step} is written" if checkpoints else "checkpoints are disabled"
        stop.enter_phase("the final eval and sample", f"{kept}; the final eval and sample were skipped", exit_code=0)
        with spent.timed("eval"):
            result.eval = evaluate(job.eval_step, state, data, job.eval_shardings, cfg, work.objective)
            if lm_eval_hook.wanted(cfg):
                result.eval |= lm_eval_hook.run(cfg, job, state)
        log.write({"step": step, **result.eval})
    finally:
        if log:
            log.close()
    if main and cfg.run.plot:
        draw_curves(run_dir)
    summary = " | ".join(f"{k} {v:.4f}" for k, v in result.eval.items())
    if result.history:
        summary = f"loss {result.history[0]['loss']:.4f} -> {result.history[-1]['loss']:.4f} | " + summary
    say(f"step {step}: {summary}")
    if data.task == "lm" and cfg.train.sample_len > 0:
        sample = end_sample(cfg, job, result.state)
        if sample is None:
            say("sample skipped: train.sample_prompt holds a token past the model's embedding")
        else:
            result.sample = sample
            say(f"sample:\n{cfg.train.sample_prompt}{sample}")
    if line := spent.end():
        say(line)
    return result


def end_sample(cfg, job: Job, state) -> str | None:
    """The end-of-run sample: `train.sample_len` tokens after `train.sample_prompt`, generated as
    `python -m shard.generate` does (a cache, on the run's mesh) and read back through the run's tokenizer. None
    where the prompt holds a token the model does not embed (its tokenizer may hold more: Gemma 3)."""
    state = job.model_view(state)  # e.g. the replicas' global view, the averaged weights
    model = nnx.merge(job.work.graphdef, state_lib.in_device_memory(state.params), state.rest)
    tok = tokenizer_lib.of_run(cfg.data)
    rows = generate.output_vocab(model)
    prompt = tok.prompt(cfg.train.sample_prompt or "\n")  # something to condition on, as training put it
    if tokenizer_lib.unembedded(tok, prompt, rows):
        return None
    generator = generate.Generator(model, job.mesh, job.rules, cfg.train.dtype, window=cfg.data.seq_len)
    tokens = generator(np.array([prompt[-generator.context:] if generator.context else prompt]), cfg.train.sample_len,
                       generate.Sampling(vocab=min(rows, tok.vocab_size)), seed=cfg.train.seed,
                       eos=generate.stop_ids(tok))
    return tok.continuation(prompt, generate.until_eos(tokens[0], generate.stop_ids(tok)))


def start_state(cfg, checkpoints, job: Job, say) -> state_lib.TrainState:
    """This run's newest checkpoint wins; else `checkpoint.restore_from`; else a fresh init (plus
    `train.init_from` parameters). Every array is read or created straight into its sharding. A checkpoint
    of another layout than the job's (e.g. a plain one for a DiLoCo run) is read as the strategy that knows it
    says (`job.take`); a strategy's state the checkpoint lacks is set from its model (`job.filled`)."""
    resumed = None
    if checkpoints and checkpoints.steps():
        resumed = (job.take(checkpoints.directory, checkpoints.steps()[-1], True)
                   or checkpoints.restore_latest(job.target))
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
        return job.filled(state)
    if cfg.checkpoint.restore_from:
        named = ckpt_lib.open_named(cfg.checkpoint.restore_from, "checkpoint.restore_from")
        state, meta = job.take(*named, True) or ckpt_lib.restore_path(
            cfg.checkpoint.restore_from, "checkpoint.restore_from", job.target, model_only=False)
        say(f"restored step {meta['step']} from {cfg.checkpoint.restore_from}")
        return job.filled(state)
    if hf.is_folder(cfg.train.init_from):  # a Hugging Face folder: each process reads its slices
        state = state_lib.init_state(job.init, job.shardings)
        # read in the model's own dtypes: a strategy that stores them otherwise (QLoRA's base) does so in `filled`
        weights = jax.tree.map(lambda t, a: t if t.dtype == a.dtype else jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=t.sharding), job.target.params, job.work.abstract.params)
        params, rest = hf_read.load_params(hf_read.Folder(cfg.train.init_from), weights, cfg.model.kwargs, state.rest)
        say(f"parameters from the Hugging Face folder {cfg.train.init_from}")
        return job.filled(state.replace(params=params, rest=rest), always=True)
    if cfg.train.init_from and (taken := job.take(*ckpt_lib.open_named(cfg.train.init_from, "train.init_from"), False)):
        state, meta = taken  # e.g. every replica and DiLoCo's anchor start from the loaded model
        say(f"parameters from step {meta['step']} of {cfg.train.init_from}")
        return state
    state = state_lib.init_state(job.init, job.shardings)
    if cfg.train.init_from:
        loaded, meta = ckpt_lib.restore_path(cfg.train.init_from, "train.init_from", job.target, model_only=True)
        state = job.filled(state.replace(params=loaded.params, rest=loaded.rest), always=True)
        say(f"parameters from step {meta['step']} of {cfg.train.init_from}")
    return state


def train_loop(cfg, state, job: Job, checkpoints, log, result, devices, main, stop, spent) -> state_lib.TrainState:
    """The steps from the state's to train.steps. Under train.nonfinite=rollback a bad step restores the newest
    checkpoint and the loop goes on from it, past the batches that led to the bad step (shard/run/badsteps.py)."""
    at = int(state.step)
    offset = checkpoints.meta(at).get("data_offset", 0) if checkpoints and at in checkpoints.steps() else 0
    bad = badsteps.Rollbacks(cfg.train.max_rollbacks, offset)
    while True:
        try:
            return _train_span(cfg, state, job, checkpoints, log, result, devices, main, stop, bad, spent)
        except badsteps.Rollback as e:
            say = print if main else (lambda *a, **k: None)
            spent.rolled_back(e.step)
            with spent.timed("restore"):
                checkpoints.manager.wait_until_finished()  # a save in flight may be the step to go back to
                state = job.to_running(start_state(cfg, checkpoints, job, say))
            record = bad.plan(e, int(state.step))
            log.keep_until(record["step"])  # the steps after it are trained again (on other batches): logged once
            log.write(record)
            result.history = [r for r in result.history if r["step"] <= record["step"]]
            say(f"rollback: {e}; restored step {record['step']} and skipped batches {record['skipped_batches_first']}"
                f"..{record['skipped_batches_last']} of the data order; going on", flush=True)


def _train_span(cfg, state, job: Job, checkpoints, log, result, devices, main, stop,
                bad: badsteps.Rollbacks, spent: goodput.Recorder) -> state_lib.TrainState:
    data, train_step = job.work.data, job.train_step
    flops = job.work.flops_per_step / len(devices)  # per device: the step's work is split evenly over the mesh
    peak = hardware.peak_flops(devices[0], cfg.run.peak_tflops)
    per_step = cfg.data.batch_size * (data.tokens_per_example or 1)
    rate_key = "tokens_per_s" if data.tokens_per_example else "examples_per_s"
    start = int(state.step)
    prefetch = prefetch_depth(cfg, devices)
    batches = data_lib.device_batches(data.train, job.batch_shardings, start=start + bad.offset, prefetch=prefetch,
                                      batch_size=data.batch_size)
    # A bar that redraws itself on a terminal; elsewhere (a log file, the launcher's prefixed pipes) a
    # line per log record, since every redraw there would be a line of its own.
    on_terminal = sys.stderr.isatty()
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not (cfg.run.progress and main and on_terminal),
               mininterval=1.0, dynamic_ncols=True, leave=False)
    progress_lines = cfg.run.progress and main and not on_terminal
    profiler = profiling.StepProfiler(config_lib.step_range(cfg.run.profile_steps, cfg.train.steps), cfg.run.dir,
                                      print if main else (lambda *a, **k: None))
    saved = checkpoints.steps() if checkpoints else []
    last_saved = saved[-1] if saved else None
    # Steps whose outputs (on the device) the host has not looked at yet, and the log records waiting
    # for them. A log point's record is written at the next sync point, once its step is long done,
    # so logging never waits for the step just dispatched and the device never runs dry.
    pending: list = []   # (step, device outputs)
    records: dict = {}   # step -> the host-side part of its log record (timing)
    skipped = 0
    policy = badsteps.policy(cfg.train)

    def look_at(upto: int) -> None:
        """Fetch the outputs of the pending steps up to `upto`; stop (or count skips) at the first
        non-finite loss, before any checkpoint of that state is written; write their due log records."""
        nonlocal pending, skipped
        ready = [(s, o) for s, o in pending if s <= upto]
        pending = [(s, o) for s, o in pending if s > upto]
        for (s, _), o in zip(ready, jax.device_get([o for _, o in ready])):
            if not o["finite"]:
                if policy == "rollback":
                    raise badsteps.Rollback(s, float(o["loss"]), float(o["grad_norm"]))
                if policy == "stop":
                    kept = f"the last checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
                    raise NonFiniteLoss(f"loss is {float(o['loss'])} (gradient norm {float(o['grad_norm'])}) at "
                                        f"step {s}; stopped, {kept}. Lower optimizer.lr, or set "
                                        "train.nonfinite=skip to skip such updates (rollback: go back to the last "
                                        "checkpoint and past the batches since it)")
                skipped += 1
            if s in records:
                record = {"step": s, "loss": float(o["loss"]), "grad_norm": float(o["grad_norm"]),
                          **records.pop(s)}
                record |= {k: float(v) for k, v in o.items() if k not in ("loss", "grad_norm", "finite")}
                if skipped:
                    record["skipped_steps"] = skipped
                log.write(record)
                result.history.append(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", **{rate_key: f"{record[rate_key]:,.0f}"})
                if progress_lines:
                    print(progress_line(record, cfg.train.steps, rate_key), flush=True)

    jax.block_until_ready(state)
    # Processes enter the first step together: its collectives give a late peer only 30 s (gloo).
    distributed.barrier("first step", cfg.run.init_timeout_s)
    t_last, steps_since, waited = time.perf_counter(), 0, 0.0
    spent.loop_starts()
    dog = watchdog.Watchdog(cfg.run.step_timeout_s, devices[0].platform, cfg.run.dir)
    # (the bar too: a rollback leaves the loop by an exception and starts another)
    with contextlib.closing(batches), contextlib.closing(profiler), contextlib.closing(dog), contextlib.closing(bar):
        for step in range(start, cfg.train.steps):
            done = step + 1
            with profiler.step(done, before=pending[-1][1] if pending else state):
                t_wait = time.perf_counter()
                batch = next(batches)  # the time the loop waits for input, apart from the step's own
                waited += time.perf_counter() - t_wait
                state, out = distributed.finished(train_step(state, batch))
                state = job.after_step(state, done)  # e.g. local SGD / DiLoCo: the replicas meet
            profiler.after(done, out)
            # At most one step waits behind the running one: the device never idles, and a stop request
            # is seen (and the state checkpointed) within a step or two, not after a queue of them.
            if pending:
                jax.block_until_ready(pending[-1][1]["loss"])
                dog.beat(pending[-1][0])
            pending.append((done, out))
            steps_since += 1
            bar.update(1)
            # Read once (a signal may land mid-iteration), and agreed by every process: all stop after this step.
            stopping = distributed.agreed_stop(done, stop.received, cfg.run.init_timeout_s)
            log_now = done % cfg.run.log_every == 0 or done in (start + 1, cfg.train.steps)
            save_now = checkpoints is not None and (
                done == cfg.train.steps or stopping or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0))
            eval_now = cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != cfg.train.steps
            lm_eval_now = lm_eval_hook.due(cfg, done)
            if log_now:
                # Every step before `done` has finished: the time since the last log point is device time.
                # Step 1 (of this run) is timed to its end: with nothing before it, its dispatch alone says nothing.
                if done == start + 1:
                    jax.block_until_ready(out["loss"])
                step_time, data_wait = (time.perf_counter() - t_last) / steps_since, waited / steps_since
                spent.steps(done, steps_since, step_time * steps_since, waited)
                # The next interval starts now. Nothing here waits for the running step: the learning rate
                # comes with the step's outputs (a computation of its own would queue behind the step on
                # a CPU, and the device would idle while the host logs: ~2% of the default job's time).
                t_last, steps_since, waited = time.perf_counter(), 0, 0.0
                dog.beat(done - 1, step_time)
                record = {"step_time_s": step_time, "data_wait_s": data_wait,
                          rate_key: per_step / step_time}
                if flops:
                    record["tflops_per_device"] = flops / step_time / 1e12  # model FLOPs achieved
                    if peak:
                        record["mfu"] = flops / step_time / peak
                if (memory := peak_memory_gb()) is not None:
                    record["peak_memory_gb"] = memory
                if done == start + 1:  # start-up costs, once: process start to the end of the first step
                    record |= {"compile_s": job.compile_s, "startup_s": seconds_of_startup()}
                records[done] = record
            if not (save_now or eval_now or lm_eval_now or stopping or done == cfg.train.steps):
                if log_now:  # the finished steps only (no wait for the one just dispatched), but step 1's
                    look_at(done if done == start + 1 else done - 1)  # record at once: the run is alive
                continue
            look_at(done)  # a checkpoint, an eval or the end needs this step's state anyway
            if save_now:
                with dog.paused(), spent.timed("checkpoint"):
                    checkpoints.save(job.to_stored(state), done, seed=cfg.train.seed,
                                     train_steps=cfg.train.steps, wait=bool(stopping), data_offset=bad.offset)
                last_saved = done
                bad.saved()
            if stopping:
                bar.close()
                where = (f"checkpoint at step {done} in {checkpoints.directory}" if checkpoints
                         else "no checkpoint (disabled)")
                if main:
                    print(f"{stopping}: stopped after step {done}; {where}; run again to resume", flush=True)
                result.preempted = True
                return state
            if eval_now or lm_eval_now:
                with dog.paused(), spent.timed("eval"):
                    record = evaluate(job.eval_step, state, data, job.eval_shardings, cfg,
                                      job.work.objective) if eval_now else {}
                    log.write({"step": done, **record, **(lm_eval_hook.run(cfg, job, state) if lm_eval_now else {})})
            t_last, steps_since, waited = time.perf_counter(), 0, 0.0  # checkpoints and evals are not step time
    bar.close()
    return state


def progress_line(record: dict, total: int, rate_key: str) -> str:
    """The progress bar's content as one line, for output that is not a terminal."""
    return (f"[{record['step']}/{total}] loss {record['loss']:.4f} | {record[rate_key]:,.0f} {rate_key} | "
            f"{record['step_time_s'] * 1e3:.1f} ms/step")
