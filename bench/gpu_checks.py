"""cuDNN's fused attention against XLA's on a real NVIDIA GPU: the paths no CPU test can run.

Each case calls shard.nn.attention.run twice on the same bf16 inputs, once with train.attention=cudnn and once
with xla (float32 logits and softmax), and compares outputs and the gradients of sum(sin(out)) with respect to
q, k and v. Cases: causal with grouped heads; a sliding window; a stack's per-layer windows as a traced value
(jax.lax.switch over one compiled call per window, Gemma's 5 local : 1 global); an explicit scale (Gemma 2's
query_pre_attn_scalar). Packed documents are not a case: cuDNN's path in jax.nn.dot_product_attention takes no
segment ids, so `auto` runs XLA's kernel for them and an explicit cudnn is refused in one line. Then each
kernel's time for the causal case at gpt_350m's shape (forward and backward).

Run on a GPU: `python bench/gpu_checks.py [--out FILE.jsonl]`. Exit status 1 if a case is off by more than
bf16's error (max |diff| over max |xla| above 2e-2).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shard.nn import attention  # noqa: E402

TOLERANCE = 2e-2


def inputs(batch, length, heads, kv_heads, dim, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = [(batch, length, heads, dim), (batch, length, kv_heads, dim), (batch, length, kv_heads, dim)]
    return [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]


def compare(name, q, k, v, **options) -> dict:
    def out_and_grads(kernel):
        f = lambda q, k, v: attention.run(q, k, v, kernel=kernel, **options)  # noqa: E731
        loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)))  # noqa: E731
        return jax.jit(lambda q, k, v: (f(q, k, v), *jax.grad(loss, (0, 1, 2))(q, k, v)))(q, k, v)

    got, want = out_and_grads("cudnn"), out_and_grads("xla")
    errors = {}
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        errors[label] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))
    worst = max(errors.values())
    return {"case": name, "relative_error": errors, "ok": worst <= TOLERANCE}


def timed(kernel, q, k, v, repeats=20) -> float:
    loss = lambda q, k, v: jnp.sum(attention.run(q, k, v, is_causal=True, kernel=kernel).astype(jnp.float32))  # noqa
    step = jax.jit(jax.grad(loss, (0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    start = time.perf_counter()
    for _ in range(repeats):
        out = step(q, k, v)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="append the results to this JSON-lines file")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    if attention.family(device) != "nvidia":
        print(f"error: bench/gpu_checks.py needs an NVIDIA GPU, found {device.device_kind}", file=sys.stderr)
        return 2
    q, k, v = inputs(2, 512, 8, 2, 64)
    stack = (128,) * 5 + (0,)  # Gemma 3's stack: five local layers of window 128 to one global
    mixed, glob = (jnp.int32(128), stack), (jnp.int32(0), stack)
    cases = [
        compare("causal, 8 heads over 2 key/value heads", q, k, v, is_causal=True),
        compare("causal, window 128", q, k, v, is_causal=True, window=128),
        compare("traced per-layer window, a local layer (128 of 5:1)", q, k, v, is_causal=True, window=mixed),
        compare("traced per-layer window, the global layer", q, k, v, is_causal=True, window=glob),
        compare("explicit scale 1/sqrt(256)", q, k, v, is_causal=True, scale=256 ** -0.5),
    ]
    big = inputs(16, 2048, 16, 16, 64, seed=1)  # gpt_350m's attention call: batch 16, 2048 tokens, 16 heads of 64
    speed = {kernel: timed(kernel, *big) for kernel in ("cudnn", "xla")}
    for case in cases:
        worst = max(case["relative_error"].values())
        print(f"{'ok  ' if case['ok'] else 'OFF '} {case['case']}: max relative error {worst:.2e} "
              f"({', '.join(f'{k} {e:.1e}' for k, e in case['relative_error'].items())})")
    print(f"forward + backward, batch 16 x 2048 tokens, 16 heads of 64, causal: cuDNN {speed['cudnn']:.2f} ms, "
          f"XLA {speed['xla']:.2f} ms ({speed['xla'] / speed['cudnn']:.2f}x)")
    if args.out:
        with open(args.out, "a") as f:
            record = {"device": device.device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
            for case in cases:
                f.write(json.dumps({**record, **case}) + "\n")
            f.write(json.dumps({**record, "case": "speed_ms", **speed}) + "\n")
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
