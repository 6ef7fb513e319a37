"""Run the same `train.py` job as one process per host: `python -m shard.launch TARGET [options] -- ARGS`.

  local --processes N    N processes on this machine joined into one mesh (simulated CPU devices)
  tpu --name --zone      every worker of a Cloud TPU VM pod slice, through gcloud
  slurm --nodes N        an sbatch script: one process per node (or per GPU) started by srun
  gke --cluster          prints the xpk command for a GKE TPU or GPU cluster

ARGS are train.py's own arguments (a config file and key=value overrides); the launcher runs
train.py itself, so a leading `train.py` (or a path ending in train.py, the torchrun habit) is
dropped from them. On several hosts, give a run.dir that every host reaches (a bucket such as
gs://BUCKET/RUN, or a shared file system): each host writes only its own shards of a checkpoint.
`--dry-run` (local, tpu, slurm) prints the commands (or the script) instead of running them. Bad
options end with one line and exit status 2.
"""

import argparse
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from shard import cli as shard_cli  # not `cli`: the console script's function below has that name
from shard.errors import UserError, exit_from
from shard.run import restarts

ROOT = Path(__file__).resolve().parents[2]  # the repository: what the TPU hosts are sent
CODE_TARBALL = Path(tempfile.gettempdir()) / "shard-code.tar.gz"
SKIPPED = {".git", "runs", "__pycache__", ".pytest_cache", "shard.egg-info", ".venv"}
NOISE = re.compile(rb"\[Gloo\] Rank \d+ is connected|^\s*Expected number of connected peer ranks")  # gloo's chatter
GRACE_S = 5  # after a process fails: how long the others get to exit on SIGTERM before SIGKILL


class LaunchError(UserError):
    """Bad options or a missing tool: one line, exit status 2 (a UserError; its own type so that callers tell
    the launcher's refusals apart)."""


# ----------------------------------------------------------------------------- local

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_commands(processes: int, args: list[str], port: int) -> list[list[str]]:
    """One train.py command line per process; each process gets run.cpu_devices (default 1)."""
    if not any(a.startswith("run.cpu_devices=") for a in args):
        args = [*args, "run.cpu_devices=1"]
    joined = [f"run.coordinator=127.0.0.1:{port}", f"run.num_processes={processes}"]
    return [[sys.executable, str(ROOT / "train.py"), *args, *joined, f"run.process_id={i}"] for i in range(processes)]


def _relay(index: int, stream, lock: threading.Lock) -> None:
    """Copy a process's output to ours, each line prefixed with its index (a progress bar's \\r too)."""
    buffer = b""
    for chunk in iter(lambda: stream.read1(4096), b""):
        buffer += chunk
        *lines, buffer = buffer.replace(b"\r", b"\n").split(b"\n")
        with lock:
            for line in lines:
                if line.strip() and not NOISE.search(line):
                    sys.stdout.write(f"[{index}] {line.decode(errors='replace')}\n")
            sys.stdout.flush()
    if buffer.strip():
        with lock:
            sys.stdout.write(f"[{index}] {buffer.decode(errors='replace')}\n")


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group still running, SIGKILL what is left after GRACE_S."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(p.pid, signal.SIGKILL)  # the group: nothing the process started survives it
        p.wait()


def _describe(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def run_local(processes: int, args: list[str], dry_run: bool, max_restarts: int = 0) -> int:
    """Every process started, watched and, when one fails, all stopped; with `max_restarts`, started again
    (up to that many times) on a fresh coordinator port: they resume from the newest complete checkpoint."""
    if dry_run:
        for command in local_commands(processes, args, free_port()):
            print(shlex.join(command))
        return 0
    signalled: list[int] = []
    for attempt in range(max_restarts + 1):
        code = _run_once(local_commands(processes, args, free_port()), signalled)
        if not restarts.again(code, attempt, max_restarts, bool(signalled)):
            return code
    return code


def _run_once(commands: list[list[str]], signalled: list[int]) -> int:
    lock = threading.Lock()
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for c in commands]
    relays = [threading.Thread(target=_relay, args=(i, p.stdout, lock), daemon=True) for i, p in enumerate(procs)]
    for t in relays:
        t.start()

    def forward(signum, frame):  # a signal to the launcher goes to every process (train.py checkpoints and exits)
        signalled.append(signum)  # and is never a reason to restart
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                _stop(procs)
                for t in relays:
                    t.join(timeout=2)
                what = "; ".join(f"process {i} {_describe(c)}" for i, c in failed)
                print(f"launch: {what}; stopped the others", file=sys.stderr, flush=True)
                code = failed[0][1]
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                for t in relays:
                    t.join(timeout=2)
                return 0
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(procs)


# ----------------------------------------------------------------------------- Cloud TPU VM

def pack_code(path: Path = CODE_TARBALL) -> Path:
    """The project's files (not runs, caches or git history) as one tarball to copy to the workers."""
    def keep(info: tarfile.TarInfo):
        return None if set(Path(info.name).parts) & SKIPPED else info

    with tarfile.open(path, "w:gz") as tar:
        for item in sorted(ROOT.iterdir()):
            tar.add(item, arcname=item.name, filter=keep)
    return path


def tpu_commands(name: str, zone: str, project: str | None, args: list[str], workdir: str = "shard",
                 install: bool = True, max_restarts: int = 0) -> list[list[str]]:
    where = [f"--zone={zone}"] + ([f"--project={project}"] if project else [])
    remote = f"mkdir -p {workdir} && tar -xzf {CODE_TARBALL.name} -C {workdir} && cd {workdir}"
    if install:
        remote += " && pip install -q -e '.[tpu]'"
    # The workers' own python3, which the line above installs the project into (not this machine's path).
    # Restarts loop on every host: a host whose process died makes the others fail at their next collective
    # (or heartbeat), so all of them start again together and resume from the same checkpoint.
    remote += " && " + restarts.shell_loop(["python3", "train.py", *args, "run.distributed=on"], max_restarts)
    return [
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(CODE_TARBALL), f"{name}:~/", "--worker=all", *where],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, "--worker=all", *where, f"--command={remote}"],
    ]


def run_commands(commands: list[list[str]], dry_run: bool) -> int:
    for command in commands:
        if dry_run:
            print(shlex.join(command))
            continue
        try:
            code = subprocess.call(command)
        except FileNotFoundError:  # gcloud or sbatch not installed
            raise LaunchError(f"{command[0]} not found; install it or use --dry-run to see the commands") from None
        if code:
            print(f"launch: {command[0]} exited with status {code}: {shlex.join(command[:6])} ...", file=sys.stderr)
            return code
    return 0


# ----------------------------------------------------------------------------- SLURM

def slurm_script(nodes: int, gpus_per_node: int | None, per_gpu: bool, partition: str | None, time_limit: str | None,
                 job_name: str, args: list[str], python: str | None = None, max_restarts: int = 0,
                 tasks_per_node: int | None = None) -> str:
    """The sbatch script. Every node runs `python` (default: the interpreter running this, sys.executable)
    in ROOT: both paths must be the same on the compute nodes, as they are when the project and its
    virtualenv lie on the cluster's shared file system. Unlike tpu and gke, whose workers run their own
    python3 (on a copy of the code, or in an image), SLURM nodes run the project where it is, so the
    launching interpreter is the one known to have it (and its JAX build) installed. --python names
    another, e.g. `python3` for an environment the nodes load themselves."""
    python = python or sys.executable
    tasks = tasks_per_node or (gpus_per_node if per_gpu and gpus_per_node else 1)
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={tasks}"]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    lines += [f"#SBATCH --output={job_name}-%j.out", "",
              "# JAX reads the job's layout from SLURM's variables: process ids, the coordinator (the first",
              "# node) and, with one task per GPU, which GPU each process owns.",
              "# Every node runs the interpreter that ran the launcher (or --python's) in the project folder:",
              "# both must exist at these paths there, as they do on a shared file system with the project's",
              "# virtualenv.",
              f"cd {shlex.quote(str(ROOT))}",
              *(["# --max-restarts: a task that fails ends the step (--kill-on-bad-exit) and the step runs again,",
                 "# resuming from the newest complete checkpoint."] if max_restarts else []),
              restarts.shell_loop(["srun", *(["--kill-on-bad-exit=1"] if max_restarts else []), python, "train.py",
                                   *args, "run.distributed=on"], max_restarts), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- GKE (xpk)

def gke_command(cluster: str, workload: str, tpu_type: str | None, device_type: str | None, slices: int,
                nodes: int, image: str | None, project: str | None, zone: str | None, args: list[str],
                max_restarts: int = 0) -> list[str]:
    if (tpu_type is None) == (device_type is None):
        raise LaunchError("gke: give exactly one of --tpu-type (e.g. v5litepod-256) or --device-type "
                          "(e.g. h100-80gb-8)")
    extra = "[tpu]" if tpu_type else "[cuda]"
    command = shlex.join(["python3", "train.py", *args, "run.distributed=on"])
    if not image:  # xpk builds an image from this folder on a base image: install the project first
        command = f"pip install -q -e '.{extra}' && {command}"
    out = ["xpk", "workload", "create", f"--cluster={cluster}", f"--workload={workload}"]
    out += [f"--tpu-type={tpu_type}", f"--num-slices={slices}"] if tpu_type else \
        [f"--device-type={device_type}", f"--num-nodes={nodes}"]
    out += [f"--docker-image={image}"] if image else ["--base-docker-image=python:3.11", f"--script-dir={ROOT}"]
    out += [f"--project={project}"] if project else []
    out += [f"--zone={zone}"] if zone else []
    out += [f"--max-restarts={max_restarts}"] if max_restarts else []  # the JobSet restarts every pod together
    return out + [f"--command={command}"]


# ----------------------------------------------------------------------------- command line

class Parser(shard_cli.Parser):
    mistake = LaunchError

    def error(self, message):
        if message.startswith("unrecognized arguments"):
            message += " (train.py's arguments go after --)"
        super().error(message)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m shard.launch", usage="%(prog)s TARGET [options] -- [CONFIG.yaml] [key=value ...]",
               description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    add = lambda name, help: sub.add_parser(name, help=help, description=help, epilog=ARGS_HELP,
                                            prog=f"python -m shard.launch {name}",
                                            usage="%(prog)s [options] -- [CONFIG.yaml] [key=value ...]")
    local = add("local", "N processes on this machine")
    local.add_argument("--processes", type=int, required=True)
    tpu = add("tpu", "every worker of a Cloud TPU VM pod slice")
    tpu.add_argument("--name", required=True)
    tpu.add_argument("--zone", required=True)
    tpu.add_argument("--project")
    tpu.add_argument("--no-install", action="store_true", help="skip pip install on the workers")
    slurm = add("slurm", "an sbatch script, submitted")
    slurm.add_argument("--nodes", type=int, required=True)
    slurm.add_argument("--gpus-per-node", type=int)
    slurm.add_argument("--per-gpu", action="store_true", help="one process per GPU instead of per node")
    slurm.add_argument("--tasks-per-node", type=int, metavar="N",
                       help="processes per node (default: 1, or one per GPU with --per-gpu), e.g. on CPU nodes")
    slurm.add_argument("--partition")
    slurm.add_argument("--time", dest="time_limit", help="wall-clock limit, e.g. 04:00:00")
    slurm.add_argument("--job-name", default="shard")
    slurm.add_argument("--script", help="where to write the sbatch script (default: JOB_NAME.sbatch here)")
    slurm.add_argument("--python", metavar="PATH",
                       help=f"the interpreter srun starts on every node (default: this one, {sys.executable}); it "
                            "must exist at that path on the compute nodes, as a virtualenv on the shared file "
                            "system does; otherwise name the nodes' own, e.g. --python=python3")
    gke = add("gke", "print the xpk command for a GKE cluster")
    gke.add_argument("--cluster", required=True)
    gke.add_argument("--workload", default="shard-train")
    gke.add_argument("--tpu-type")
    gke.add_argument("--device-type")
    gke.add_argument("--num-slices", type=int, default=1)
    gke.add_argument("--num-nodes", type=int, default=1)
    gke.add_argument("--docker-image")
    gke.add_argument("--project")
    gke.add_argument("--zone")
    for s in (local, tpu, slurm):
        s.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    for s in (local, tpu, slurm, gke):
        s.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="when a process fails, stop the others and start all again (up to N times); they "
                            "resume from the newest complete checkpoint")
    return p


ARGS_HELP = ("ARGS after -- are train.py's own: [CONFIG.yaml] [key=value ...]. The launcher runs train.py "
             "itself, so a leading train.py (or a path ending in train.py, as torchrun takes it) is dropped.")


def without_train_py(args: list[str]) -> list[str]:
    """ARGS less a leading `train.py` (`torchrun ... train.py CONFIG` habit): the launcher starts train.py itself."""
    if not args or "=" in args[0] or Path(args[0]).name != "train.py":
        return args
    given = Path(args[0])
    if given.is_file() and given.resolve() != (ROOT / "train.py").resolve():  # another project's script
        raise LaunchError(f"{args[0]!r} is not this project's train.py ({ROOT / 'train.py'}), which the launcher "
                          "always runs; give only its arguments after --")
    return args[1:]


def main(argv: list[str]) -> int:
    own, args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    opts = parser().parse_args(own)
    args = without_train_py(args)
    if opts.max_restarts < 0:
        raise LaunchError(f"--max-restarts={opts.max_restarts}: give 0 (no restarts) or a positive number")
    if opts.target == "local":
        if opts.processes < 1:
            raise LaunchError(f"--processes={opts.processes}: give a positive number of processes")
        return run_local(opts.processes, args, opts.dry_run, opts.max_restarts)
    if opts.target == "tpu":
        warn_if_local_run_dir(args, opts.target)
        commands = tpu_commands(opts.name, opts.zone, opts.project, args, install=not opts.no_install,
                                max_restarts=opts.max_restarts)
        if not opts.dry_run:
            pack_code()
        return run_commands(commands, opts.dry_run)
    if opts.target == "slurm":
        if opts.nodes < 1 or (opts.gpus_per_node is not None and opts.gpus_per_node < 1):
            raise LaunchError("--nodes and --gpus-per-node must be positive")
        if opts.per_gpu and not opts.gpus_per_node:
            raise LaunchError("--per-gpu needs --gpus-per-node")
        if opts.tasks_per_node is not None and (opts.tasks_per_node < 1 or opts.per_gpu):
            raise LaunchError("--tasks-per-node must be positive, and is not given with --per-gpu (one task per GPU)")
        if opts.nodes > 1:
            warn_if_local_run_dir(args, opts.target)
        script = slurm_script(opts.nodes, opts.gpus_per_node, opts.per_gpu, opts.partition, opts.time_limit,
                              opts.job_name, args, opts.python, opts.max_restarts,
                              opts.tasks_per_node)
        path = Path(opts.script or f"{opts.job_name}.sbatch")
        if opts.dry_run:
            print(f"# {path}\n{script}\n# then: sbatch {path}")
            return 0
        try:
            path.write_text(script)
        except OSError as e:
            raise LaunchError(f"--script {path}: {e.strerror or e}") from None
        return run_commands([["sbatch", str(path)]], dry_run=False)
    # GKE: print the command; submitting it needs the user's cluster credentials and xpk.
    print(shlex.join(gke_command(opts.cluster, opts.workload, opts.tpu_type, opts.device_type, opts.num_slices,
                                 opts.num_nodes, opts.docker_image, opts.project, opts.zone, args,
                                 opts.max_restarts)))
    return 0


def warn_if_local_run_dir(args: list[str], target: str) -> None:
    """Each host writes only its own shards of a checkpoint: with a run.dir on each host's local disk,
    no host holds a whole checkpoint and a restart on other hosts cannot resume."""
    from shard import config

    path = args[0] if args and "=" not in args[0] and not args[0].startswith("-") else config.CONFIGS / "default.yaml"
    try:  # the config train.py will load (configs/default.yaml when none is given), so the same run.dir
        cfg = config.load(path, [a for a in args if "=" in a])
    except UserError:
        return  # train.py says what is wrong, on every host
    local = [f"{key}={value}" for key, value in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir))
             if value and "://" not in value]
    if local:
        shared = "a file system every node mounts" if target == "slurm" else "a bucket"
        print(f"warning: {', '.join(local)} is a local path: each host writes only its own shards of every "
              f"checkpoint there, so no disk holds a whole one; unless it is on {shared}, use a shared or "
              "remote folder, e.g. run.dir=gs://BUCKET/RUN", file=sys.stderr)


def cli() -> None:
    """`shard-launch`, pyproject.toml's console script (which calls a function of no arguments): what `python -m
    shard.launch` runs."""
    exit_from(main, sys.argv[1:])
