"""lm-evaluation-harness on a run: python -m shard.eval's time against lm_eval's own `hf` model (transformers) on
the run's Hugging Face export, on the same multiple-choice task, and how far apart their per-item answers are.

    python bench/eval_speed.py OUT [--items 50] [--batch 8] [--steps 100] [key=value ...]

Offline, on a CPU: a small Llama-shaped run (its shape changed by the key=value overrides) is trained `--steps`
steps on tests/tiny_tokenizers.py's corpus through its tiny byte-level BPE, exported, and scored on a
`--items`-document task (tests/tiny_tasks.py's multiple choice: four choices a document, so 4 x items requests).
Each side's time is the whole evaluation: its model loaded, lm_eval's requests built and answered, the metrics.
The last line is the figures as JSON.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tiny_tasks  # noqa: E402
import tiny_tokenizers  # noqa: E402

SHAPE = ["model.name=gpt", "model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.d_ff=512",
         "model.max_len=128", "model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--items", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    args, overrides = parser.parse_known_args()
    tiny_tasks.offline()
    import lm_eval

    from shard import config
    from shard.run import trainer
    from shard.use import evaluate, export

    out = args.out
    tok = tiny_tokenizers.make("json", out / "tok")
    corpus = out / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in tiny_tokenizers.corpus()))
    run = out / "run"
    if not (run / "checkpoints").is_dir():
        trainer.run(config.load(None, [*SHAPE, "data.name=documents", f"data.path={corpus}", f"data.tokenizer={tok}",
                                       "data.seq_len=64", "data.batch_size=8", f"train.steps={args.steps}",
                                       "optimizer.lr=3e-3", f"run.dir={run}", "run.progress=false",
                                       "train.sample_len=0", "run.plot=false", *overrides]))
    hf = out / "hf"
    if not hf.is_dir():
        export.main([str(run), "--format", "hf", "--out", str(hf)])
    tasks = tiny_tasks.write(out / "tasks", n=args.items)
    manager = evaluate.task_manager(["tiny_mc"], str(tasks))  # indexed once, for both sides

    start = time.perf_counter()
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32,device=cpu",
                                     tasks=["tiny_mc"], task_manager=manager, log_samples=True,
                                     batch_size=args.batch, bootstrap_iters=0)
    hf_s = time.perf_counter() - start

    from shard.use import generate, load

    start = time.perf_counter()
    loaded = load.load(str(run), [], whole_mesh=False, key="RUN")
    lm = evaluate.model_of(loaded.model, generate.Generator(loaded.model), load.load_tokenizer(str(run)), args.batch)
    ours = evaluate.evaluate(lm, ["tiny_mc"], manager, log_samples=True, bootstrap_iters=0)
    shard_s = time.perf_counter() - start

    def answers(results):
        return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in results["samples"]["tiny_mc"]}

    a, b = answers(ours), answers(theirs)
    worst = max(abs(x - y) for d in a for x, y in zip(a[d], b[d]))
    figures = {"items": args.items, "requests": 4 * args.items, "batch": args.batch, "shard_eval_s": round(shard_s, 2),
               "hf_s": round(hf_s, 2), "acc_shard": ours["results"]["tiny_mc"]["acc,none"],
               "acc_hf": theirs["results"]["tiny_mc"]["acc,none"], "max_loglikelihood_difference": worst,
               "parameters": sum(x.size for x in __import__("jax").tree.leaves(loaded.model))}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
