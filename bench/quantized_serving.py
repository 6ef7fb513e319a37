"""Weight-only quantization at load time against the model as trained (issue 48): for a trained language model's
run, the held-out loss and perplexity and the greedy answers to a few prompts with its weights as trained, as int8
and as int4 (`--quantize`: shard/quant/serving.py, what python -m shard.generate and shard.serve load).

Run: `python bench/quantized_serving.py RUN [--batches N] [--new-tokens N] [--prompt TEXT ...]` (default: 64 eval
batches spread over the held-out split, 48 new tokens, three prompts). Prints a line per kind and the answers,
then a JSON line with every figure.
"""

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ("import ", "def __init__(self", "    for i in range(")


def main(argv: list[str]) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from shard import data as data_lib
    from shard.quant import serving
    from shard.run import job
    from shard.use import generate, load

    parser = argparse.ArgumentParser(prog="python bench/quantized_serving.py")
    parser.add_argument("run")
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt", action="append")
    args = parser.parse_args(argv)
    loaded = load.load(args.run, [], whole_mesh=False)
    data = data_lib.build(loaded.cfg.data, loaded.cfg.train.seed, cache_dir=job.token_cache_dir(loaded.cfg))
    picks = np.unique(np.linspace(0, len(data.eval) - 1, min(args.batches, len(data.eval))).astype(int))
    batches = [data.eval[int(i)] for i in picks]
    tok = load.load_tokenizer(args.run)
    rows = {}
    for kind in (None, "int8", "int4"):
        g = serving.quantize_generator(generate.Generator(loaded.model, dtype=loaded.cfg.train.dtype), kind)

        @jax.jit
        def sums(state, inputs, targets, mask):
            logits = g._model(state)(inputs).astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=1)
            return jnp.sum(losses * mask), jnp.sum(mask)

        total = count = 0.0
        for b in batches:
            s, c = sums(g.state, b["inputs"], b["targets"], b["mask"])
            total, count = total + float(s), count + float(c)
        answers = [tok.continuation(ids, generate.until_eos(row, generate.stop_ids(tok))) for ids, row in zip(
            [tok.prompt(p) for p in args.prompt or PROMPTS],
            [g([tok.prompt(p)], args.new_tokens, generate.Sampling(0, vocab=tok.vocab_size))[0]
             for p in args.prompt or PROMPTS])]
        weights = sum(leaf.size * jax.dtypes.itemsize_bits(leaf.dtype) for leaf in jax.tree.leaves(g.state)) / 8
        rows[kind or "as trained"] = {"eval_loss": total / count, "perplexity": math.exp(total / count),
                                      "weight_bytes": weights, "answers": answers}
    base = rows["as trained"]
    for name, r in rows.items():
        same = sum(a == b for a, b in zip(r["answers"], base["answers"]))
        print(f"{name:>10}: eval loss {r['eval_loss']:.4f} (perplexity {r['perplexity']:.3f}, "
              f"{(r['eval_loss'] / base['eval_loss'] - 1) * 100:+.2f}%), weights {r['weight_bytes'] / 2**20:.2f} MiB, "
              f"greedy answers equal to as trained: {same} of {len(r['answers'])}")
        for prompt, answer in zip(args.prompt or PROMPTS, r["answers"]):
            print(f"            {prompt + answer!r}")
    print(json.dumps({"run": args.run, "eval_batches": len(batches), **rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
