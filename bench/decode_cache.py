"""The decode cache of a real-size Gemma 2 or 3 (issue 47): its bytes for one sequence at a context, with each
local layer keeping a ring of its window (shard/nn/decoding.py's Kinds) against every layer keeping every
position (what a stack that mixes local and global layers kept before). Shapes only: the model is built
abstractly and the generator's prefill traced (jax.eval_shape), nothing allocated or compiled; the cache in
bfloat16 (train.dtype=bfloat16's compute dtype), batch 1. The server's slots hold the same per slot.

  python bench/decode_cache.py                       # gemma-2-9b, gemma-3-1b, gemma-3-12b at 8k and 32k
  python bench/decode_cache.py --only gemma-2-9b --contexts 4096,131072

Each family's config.json as bench/family_plans.py has it (its published one, or the fixture's real one), read
by the framework's own reader (shard.hf.arch.to_gpt). Not imported by the tests.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from family_plans import family_config  # noqa: E402  (bench/ is this script's folder)
from shard.core import state as state_lib  # noqa: E402
from shard.hf import arch  # noqa: E402
from shard.models.gpt import GPT  # noqa: E402
from shard.use import generate  # noqa: E402

FAMILIES = ["gemma-2-9b", "gemma-3-1b", "gemma-3-12b"]


def cache_bytes(kwargs: dict, context: int) -> int:
    """Bytes of one sequence's cache after a prefill into `context` positions (abstract)."""
    model = nnx.eval_shape(lambda: state_lib.build_model(GPT, dict(kwargs, max_len=context), 0))
    g = generate.Generator(model, dtype=jnp.bfloat16)
    one = jnp.zeros(1, jnp.int32)
    cache = jax.eval_shape(lambda s: g.forward(s, jnp.zeros((1, 1), jnp.int32), one, one, None, context)[1], g.state)
    return state_lib.shard_bytes(cache)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(FAMILIES))
    parser.add_argument("--contexts", default="8192,32768")
    args = parser.parse_args(argv)
    print("| family | layers (local window) | context | every position | rings for local layers | saved |")
    print("|---|---|---|---|---|---|")
    for name in args.only.split(","):
        where, config = family_config(name)
        kwargs = arch.to_gpt(config, where)
        windows = kwargs["windows"]
        local = sorted({w for w in windows if w})
        for context in (int(c) for c in args.contexts.split(",")):
            before = cache_bytes(dict(kwargs, windows=None), context)
            after = cache_bytes(kwargs, context)
            print(f"| {name} | {len(windows)} ({sum(map(bool, windows))} of window {','.join(map(str, local))}) | "
                  f"{context:,} | {before / 2**30:.2f} GiB | {after / 2**30:.2f} GiB | {1 - after / before:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
