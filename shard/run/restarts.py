"""`--max-restarts N`: when a process of the job fails, start the whole job again, up to N times.

Every target restarts all processes together (one that died cannot rejoin the others' collectives), and
each restarted process resumes from the newest complete checkpoint: the local launcher loops in Python,
SLURM and the TPU hosts loop in the shell, GKE asks its JobSet (xpk's own --max-restarts). A stop the
user asked for (SIGTERM/SIGINT to the launcher) checkpoints, exits and is never restarted.
"""

import shlex
import sys


def again(code: int, attempt: int, max_restarts: int, signalled: bool) -> bool:
    """Whether to start the job again after an attempt (0-based) ended with `code`; says so in one line."""
    if code == 0 or signalled:
        return False
    if code == 2 and max_restarts:  # train.py's bad-input status: every attempt would refuse it the same way
        print("launch: a process refused its input (exit status 2); not restarting", file=sys.stderr, flush=True)
        return False
    if attempt >= max_restarts:
        if max_restarts:
            print(f"launch: the job failed {attempt + 1} times; no restarts left (--max-restarts={max_restarts})",
                  file=sys.stderr, flush=True)
        return False
    print(f"launch: restarting every process from the newest complete checkpoint (restart {attempt + 1} of "
          f"{max_restarts})", file=sys.stderr, flush=True)
    return True


def shell_loop(command: list[str] | str, max_restarts: int) -> str:
    """`command` as a shell line that runs it up to 1 + max_restarts times, until it succeeds (SLURM's
    srun, a TPU host's train.py). A run stopped by SIGTERM exits 0 after its checkpoint and ends the loop."""
    line = command if isinstance(command, str) else shlex.join(command)
    if not max_restarts:
        return line
    return (f"(for attempt in $(seq 0 {max_restarts}); do {line} && exit 0; status=$?; "
            f"echo \"launch: attempt $attempt exited with status $status\" >&2; "
            f"[ $attempt -lt {max_restarts} ] && echo \"launch: restarting from the newest complete checkpoint\" >&2; "
            "done; exit $status)")
