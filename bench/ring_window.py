"""Ring attention under a sliding window (issue 47): the FLOPs per device XLA counts in the compiled forward and
backward of one causal attention call split over 8 context devices (load-balanced), with the blocks wholly
outside every query's window skipped (shard/nn/ring.py's ring_steps and the run-time skip) against
every block computed and masked (the skips turned off here, as the ring was before). Compile-only on 8
simulated CPU devices; batch 1, 8 heads (2 key/value heads) of 64.

  python bench/ring_window.py                     # 4096 tokens, windows 256, 1024 and 4096
  python bench/ring_window.py --length 8192 --windows 512,2048
"""

import argparse
import os
import sys
from unittest import mock

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from shard.nn import partition  # noqa: E402
from shard.core import flops  # noqa: E402
from shard.core import mesh as mesh_lib  # noqa: E402
from shard.nn import ring  # noqa: E402

N = 8


def step_flops(length: int, window: int | None, skip: bool) -> float:
    mesh = jax.make_mesh(tuple(N if a == "context" else 1 for a in mesh_lib.AXES), mesh_lib.AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_lib.AXES))
    q, k, v = (jax.ShapeDtypeStruct((1, length, h, 64), jnp.float32) for h in (8, 2, 2))
    order = ring.balanced_order(length, N)
    split = ring.Split(N, "ring", order)

    def loss(q, k, v):
        with partition.activate(mesh, partition.RULES):
            laid_out = (partition.constrain(x, ("batch", "length", "heads", "head_dim")) for x in (q, k, v))
            return jnp.sum(ring.attention(*laid_out, True, split, window=window))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    if skip:
        return flops.xla_flops(grad.lower(q, k, v).compile())
    every = lambda order, length, n, causal, window: tuple(range(1, n))  # noqa: E731
    always = lambda qpos, kpos, causal, win, fold, state: fold(state)  # noqa: E731
    with mock.patch.object(ring, "ring_steps", every), mock.patch.object(ring, "_if_seen", always):
        return flops.xla_flops(grad.lower(q, k, v).compile())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--windows", default="256,1024,4096")
    args = parser.parse_args(argv)
    print("| tokens | window | ring steps computed | every block | blocks outside the window skipped |")
    print("|---|---|---|---|---|")
    for window in (int(w) for w in args.windows.split(",")):
        steps = ring.ring_steps(ring.balanced_order(args.length, N), args.length, N, True, window)
        before, after = step_flops(args.length, window, False), step_flops(args.length, window, True)
        print(f"| {args.length:,} | {window:,} | {len(steps)} of {N - 1} | {before / 1e9:.2f} GFLOP | "
              f"{after / 1e9:.2f} GFLOP ({after / before - 1:+.0%}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
