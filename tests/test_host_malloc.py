"""On CPU the framework has glibc's malloc keep freed memory for reuse (shard/run/host_malloc.py): a big block
freed and asked for again costs no page faults. Each case runs in a fresh process, since the setting is
the process's and the environment can veto it."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# Start the framework's devices as a run does, then allocate and free 64 MiB six times: the page faults
# of the last five allocations, per allocation.
SCRIPT = """
import ctypes, json, resource, sys
from shard import config
from shard.run import distributed, host_malloc
run = config.load(None, sys.argv[2:]).run
devices = distributed.start(run)  # all that load_model, generate and export do
if sys.argv[1] == "train":
    host_malloc.for_training(run, devices)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
def block():  # as XLA's CPU runtime allocates a buffer (numpy's would get transparent huge pages)
    address = libc.malloc(64 << 20)
    ctypes.memset(address, 1, 64 << 20)
    libc.free(address)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block()
before = faults()
for _ in range(5):
    block()
print(json.dumps((faults() - before) / 5))
"""


def faults_per_block(*overrides, env=None, entry="train"):
    out = subprocess.run([sys.executable, "-c", SCRIPT, entry, "run.cpu_devices=1", *overrides], cwd=ROOT, text=True,
                         capture_output=True, check=True,
                         env=dict(env or os.environ) | {"PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_block_is_reused_without_page_faults_unless_turned_off():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    assert faults_per_block(env=env) < 0.05 * pages  # reused: the pages stay mapped
    assert faults_per_block("run.reuse_host_memory=false", env=env) > 0.9 * pages  # glibc unmaps, maps anew
    # The user's own malloc settings win.
    assert faults_per_block(env=env | {"MALLOC_ARENA_MAX": "4"}) > 0.9 * pages
    # Only training tunes it: a model loaded into someone's process leaves their malloc as it was.
    assert faults_per_block(env=env, entry="load") > 0.9 * pages
