"""Generation speed: tokens per second with the cache (shard/generate.py: one prefill, then one token per
step in a jitted scan) against re-running the model on the whole sequence for every token (the recompute
loop the tests check the cache against). Both greedy, on the same model and prompt, each timed after a
warm-up call that compiles it; the tokens of both must be equal.

Run: `python bench/generate.py [CONFIG.yaml] [key=value ...] [--new-tokens N] [--prompt-len P] [--batch B]`
(default: configs/default.yaml's model with max_len = P + N, freshly initialised: speed does not depend on
the weights). Prints one line per method and a JSON line with every figure.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn) -> tuple[float, object]:
    fn()  # compiles
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/generate.py")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    args, rest = parser.parse_known_args(argv)
    path = Path(rest[0]) if rest and rest[0].endswith(".yaml") else ROOT / "configs" / "default.yaml"
    overrides = [a for a in rest if not a.endswith(".yaml")]

    import jax
    import numpy as np

    from shard import config
    from shard.use import generate
    from shard.core import registry
    from shard.core import state as state_lib

    n, p = args.new_tokens, args.prompt_len
    cfg = config.load(path, [f"model.max_len={p + n}", *overrides])
    model = state_lib.build_model(*registry.load(cfg.model), seed=0)
    prompt = np.random.default_rng(0).integers(0, 256, (args.batch, p), dtype=np.int32)
    greedy = generate.Sampling(temperature=0, vocab=generate.BYTES)
    generator = generate.Generator(model, dtype=cfg.train.dtype)
    cached_s, cached = timed(lambda: generator(prompt, n, greedy))
    full_s, full = timed(lambda: generate.recompute(model, prompt, n, vocab=generate.BYTES))
    if not np.array_equal(cached, full):
        print(f"the cache's tokens differ from the recompute loop's at {int(np.sum(cached != full))} places",
              file=sys.stderr)
        return 1
    rows = {"cache": cached_s, "recompute": full_s}
    for name, seconds in rows.items():
        print(f"{name:>9}: {args.batch * n / seconds:10,.0f} tokens/s ({seconds:.2f} s for {args.batch} x {n} tokens)")
    print(f"speed-up: {full_s / cached_s:.1f}x")
    print(json.dumps({"model": cfg.model.name, "params": state_lib.count_params(nnx_params(model)), "prompt": p,
                      "new_tokens": n, "batch": args.batch, "device": jax.devices()[0].device_kind,
                      **{f"{k}_tokens_per_s": args.batch * n / s for k, s in rows.items()}}))
    return 0


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
