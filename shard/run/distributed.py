"""Joining the processes of a multi-host job into one JAX runtime, before anything else touches JAX.

One process runs per host (or per GPU under SLURM); `jax.distributed.initialize` connects them, after
which `jax.devices()` lists every device of every process and one mesh spans them all. When to join:

- `run.distributed=on`: always; JAX detects the cluster itself (Cloud TPU VM pods, GKE, SLURM, MPI).
- `run.distributed=auto` (default): when the environment says the job has several processes: an
  explicit coordinator (`run.coordinator` or `JAX_COORDINATOR_ADDRESS`, with `run.num_processes` /
  `JAX_NUM_PROCESSES` and `run.process_id` / `JAX_PROCESS_ID`), a SLURM step with several tasks, or
  a TPU pod or multislice environment.
- `run.distributed=off`: never (one process, whatever the environment says).

Simulated CPU devices (`run.cpu_devices`, per process) use the gloo collectives, so that several
local processes form one mesh: that is how the multi-host path is tested on one machine.
"""

import contextlib
import dataclasses
import functools
import hashlib
import glob
import importlib.util
import os
import sys
import threading

import jax

from shard.errors import UserError, first_line


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def explicit_settings(run) -> dict | None:
    """coordinator_address / num_processes / process_id from the config or JAX's variables, or None."""
    coordinator = run.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = run.num_processes if run.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = run.process_id if run.process_id is not None else _env_int("JAX_PROCESS_ID")
    if coordinator is None and num is None and pid is None:
        return None
    if coordinator is None or num is None or pid is None:
        raise UserError("run.coordinator, run.num_processes and run.process_id go together (or the variables "
                        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); "
                        f"got coordinator={coordinator!r}, num_processes={num}, process_id={pid}")
    if ":" not in coordinator:
        raise UserError(f"run.coordinator={coordinator!r}: give host:port of process 0, e.g. 10.0.0.2:8476")
    if not 0 <= pid < num:
        raise UserError(f"run.process_id={pid} must be between 0 and run.num_processes-1={num - 1}")
    return {"coordinator_address": coordinator, "num_processes": num, "process_id": pid}


def detected_cluster() -> str | None:
    """The multi-process environment JAX can configure itself from, if this is one."""
    if "SLURM_JOB_ID" in os.environ and (_env_int("SLURM_STEP_NUM_TASKS") or _env_int("SLURM_NTASKS") or 1) > 1:
        return "slurm"
    if len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "tpu pod"
    if (_env_int("MEGASCALE_NUM_SLICES") or 1) > 1:
        return "tpu multislice"
    return None


def tpu_library_without_chips() -> bool:
    """libtpu is installed, no TPU chip is attached (no /dev/accel* or /dev/vfio/N) and nobody chose the
    platforms (JAX_PLATFORMS)."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return False
    return not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def start(run, deterministic: bool = False) -> list:
    """Join the job's processes when there are several, and return the devices to lay the mesh over:
    every device of every process (or, single-process, the first `run.cpu_devices` CPU devices).
    `deterministic` (train.deterministic) asks XLA for deterministic GPU kernels, before it starts."""
    if deterministic and "--xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()
    if run.cpu_devices is not None:
        try:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", run.cpu_devices)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except RuntimeError:
            pass  # backends already started (tests, notebooks): use what is there
    elif tpu_library_without_chips():
        try:  # libtpu installed (for run.target's compiles) on a machine without TPUs: not a backend to start,
            # which would only print pages of warnings about cloud metadata it cannot find
            gpu = os.path.exists("/dev/nvidia0") and any(
                importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
            jax.config.update("jax_platforms", "cuda,cpu" if gpu else "cpu")
        except RuntimeError:
            pass
    settings = explicit_settings(run) if run.distributed != "off" else None
    multi = settings is not None or run.distributed == "on" or (run.distributed == "auto" and detected_cluster())
    if multi and not jax.distributed.is_initialized():
        if settings and settings["num_processes"] == 1:
            settings = None  # one process: nothing to join
        else:
            join(settings or {}, run)

    return _devices(run)


def _devices(run) -> list:
    if jax.process_count() > 1 or run.cpu_devices is None:
        return jax.devices()
    devices = jax.devices("cpu")
    if len(devices) < run.cpu_devices:
        raise UserError(f"run.cpu_devices={run.cpu_devices} but JAX already started with {len(devices)} CPU "
                        "devices; set it before JAX initialises (a fresh process)")
    return devices[:run.cpu_devices]


def finished(tree):
    """`tree`, once the program that made it has finished on every device, where the backend needs that.

    XLA's CPU runtime (jaxlib 0.10) runs every device's work on one thread pool of max(cores, devices)
    threads, and a collective holds its thread until all its peers arrive. When a program with collectives
    starts on some devices while the one before it still runs on others (the inputs it reads were ready
    early), the two programs' collectives can hold every thread the other needs: the process hangs, or
    XLA aborts it. On CPU with several local devices each program therefore ends before the next is
    dispatched; elsewhere (GPU, TPU, one device) this returns at once and dispatch stays asynchronous."""
    if _cpu_with_several_devices():
        jax.block_until_ready(tree)
    return tree


@functools.cache
def _cpu_with_several_devices() -> bool:
    return jax.local_devices()[0].platform == "cpu" and jax.local_device_count() > 1


def join(settings: dict, run) -> None:
    """jax.distributed.initialize, given run.init_timeout_s to succeed. JAX's own timeout aborts the
    process with pages of C++ logs, so a watchdog ends it first with one line (exit status 1)."""
    where = settings.get("coordinator_address", "the detected coordinator")
    watchdog = threading.Timer(run.init_timeout_s, _die, args=(
        f"not every process joined within run.init_timeout_s={run.init_timeout_s} s (coordinator {where}); "
        "check that all were started with the same run.coordinator and run.num_processes",))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**settings, initialization_timeout=run.init_timeout_s + 60,
                                   heartbeat_timeout_seconds=run.heartbeat_timeout_s)
    except Exception as e:  # e.g. a coordinator address that cannot be bound or resolved
        watchdog.cancel()
        raise UserError(f"could not start the distributed runtime at {where}: {first_line(e)}") from None
    watchdog.cancel()


@contextlib.contextmanager
def exit_cleanly_if_a_peer_fails():
    """A collective that fails in a multi-process job almost always means another process died.
    Say so in one line and exit at once (status 1): a normal exit would wait in JAX's shutdown
    barrier for the dead peer and then abort with pages of runtime logs."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        _die(f"process {jax.process_index()}: a collective with the other processes failed, most likely "
             f"because one of them died ({first_line(e)})")


def _die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _client():
    """JAX's distributed-runtime client: barriers and a key-value store with timeouts, which need no
    device collectives (gloo gives up on a peer after a fixed 30 s; these wait as long as we say).

    JAX has no public accessor for it (multihost_utils' barrier is a device collective), so this is
    the one place that reaches into JAX's internals; if they move, it says so instead of failing
    somewhere deep in a barrier."""
    try:
        from jax._src import distributed as jax_distributed

        client = jax_distributed.global_state.client
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"jax {jax.__version__} moved its distributed-runtime client "
                           f"(jax._src.distributed.global_state.client: {first_line(e)}); shard/run/distributed.py "
                           "needs updating for this JAX version") from None
    if client is None:
        raise RuntimeError("the distributed runtime is not initialised (jax.distributed.initialize)")
    return client


_barriers: dict[str, int] = {}
# The last cross-process wait this process entered, and whether it came back: what a hang report names
# (shard/run/watchdog.py). Device collectives inside a step show in the step's name.
last_collective: str | None = None


@contextlib.contextmanager
def _entered(name: str):
    global last_collective
    last_collective = f"{name} (waiting)"
    yield
    last_collective = f"{name} (completed)"


def barrier(name: str, timeout_s: int) -> None:
    """Wait until every process gets here, e.g. after compiling, so no process enters the first
    collective while another is still compiling."""
    if jax.process_count() == 1:
        return
    _barriers[name] = _barriers.get(name, 0) + 1
    try:
        with _entered(f"barrier '{name}'"):
            _client().wait_at_barrier(f"shard/{name}/{_barriers[name]}", timeout_s * 1000)
    except Exception as e:
        _die(f"process {jax.process_index()}: not every process reached '{name}' within {timeout_s} s "
             f"({first_line(e)})")


def agreed_stop(step: int, mine: str | None, timeout_s: int) -> str | None:
    """Whether any process was asked to stop by step `step`, agreed by all: each process posts its own word
    (the signal's name, or nothing) to the distributed runtime's key-value store and reads every other's,
    so all of them stop after the same step and save the same checkpoint. A signal that reaches one host a
    step before another no longer leaves one in the checkpoint's barrier and the other in a collective.
    Host-side only (no device program): the step already dispatched keeps running meanwhile."""
    if jax.process_count() == 1:
        return mine
    client, me, n = _client(), jax.process_index(), jax.process_count()
    client.key_value_set(f"shard/stop/{step}/{me}", mine or "")
    words = []
    try:
        with _entered(f"the stop agreement after step {step}"):
            for other in range(n):
                words.append((mine or "") if other == me else
                             client.blocking_key_value_get(f"shard/stop/{step}/{other}", timeout_s * 1000))
    except Exception as e:
        _die(f"process {me}: not every process reached step {step} within {timeout_s} s ({first_line(e)})")
    if step > 1:  # every process has read step-1's words before posting step's: they can go
        client.key_value_delete(f"shard/stop/{step - 1}/{me}")
    if mine:
        return mine
    asked = [f"{w} on process {i}" for i, w in enumerate(words) if w]
    return ", ".join(asked) or None


def check_same_config(cfg, model_kwargs: dict) -> None:
    """Every process must run the same job: compare hashes of the resolved config (with the one key
    that differs by design, run.process_id, left out) across processes. On a mismatch every process
    raises, naming the processes that differ from process 0."""
    if jax.process_count() == 1:
        return
    from shard import config as config_lib

    shared = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, process_id=None))
    resolved = config_lib.to_yaml(shared, model_kwargs=model_kwargs)
    client, me = _client(), jax.process_index()
    client.key_value_set(f"shard/config/{me}", hashlib.sha256(resolved.encode()).hexdigest())
    try:
        hashes = [client.blocking_key_value_get(f"shard/config/{i}", cfg.run.init_timeout_s * 1000)
                  for i in range(jax.process_count())]
    except Exception as e:
        _die(f"process {me}: not every process reported its config within run.init_timeout_s ({first_line(e)})")
    differ = [i for i, h in enumerate(hashes) if h != hashes[0]]
    if differ:
        raise UserError(f"the resolved config differs between processes: processes {differ} disagree with "
                        "process 0; start every process with the same config file and overrides")
