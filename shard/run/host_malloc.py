"""On CPU, glibc's malloc keeps the memory a step frees for the next step, instead of unmapping it.

XLA's CPU runtime allocates a step's buffers with malloc and frees them when the step ends. glibc
serves each request above its mmap threshold (at most 32 MiB) with fresh pages from mmap and hands
them back on free, so every step touched its big buffers' pages for the first time again: about
14,000 page faults a step on the default job, ~17% of its step time (bench/RESULTS.md, "The CPU step
against PyTorch, closer"). PyTorch's CPU steps fault far less (their buffers are smaller and glibc's dynamic
threshold soon serves them from the heap). With mmap off and trimming only past 2 GiB of free top,
freed blocks stay in the heap and the next step reuses them.

The cost: the process keeps its peak heap instead of returning freed memory (a training process
reaches its peak every step anyway). `run.reuse_host_memory=false`, any MALLOC_* variable or
GLIBC_TUNABLES in the environment (the user's own choice), or a C library other than glibc leave malloc
as it is.
"""

import ctypes
import os
import sys

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20))


def user_chose() -> bool:
    """Whether the environment already tunes malloc (left alone then)."""
    return "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ)


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve large blocks from the heap and keep what is freed; True when it took."""
    if not sys.platform.startswith("linux") or user_chose():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False  # not glibc (musl, ...): nothing to tune
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)


def for_training(run, devices: list) -> bool:
    """The training entry point's choice (`run.reuse_host_memory`, CPU devices only). Loading, generating or
    exporting a model in someone's process leaves their malloc alone."""
    return bool(run.reuse_host_memory and devices[0].platform == "cpu" and keep_freed_memory())
