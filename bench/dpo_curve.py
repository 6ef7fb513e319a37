"""A short DPO curve on a CPU, offline (issue 49): preference pairs whose chosen answer names the partner of
the prompt's word (finetune_example.py's fixed pairing of 16 words) and whose rejected answer names another
word. A tiny byte-level GPT is first fine-tuned on the chosen answers alone (OUT/sft: prompt/completion rows,
150 steps), as DPO usually starts from a fine-tuned model; then trained with train.objective=dpo from it,
in full fine-tuning (the reference a frozen copy) and with LoRA (the reference the weights under the adapters):

    python bench/dpo_curve.py OUT [key=value ...]    # writes OUT/prefs.jsonl, runs OUT/sft, OUT/full, OUT/lora

Prints, per run and log step, the loss, the margin, the accuracy and both answers' log-likelihoods, and the
held-out pairs' eval at the end.
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_example import WORDS  # noqa: E402

MODEL = ["model.name=gpt", "model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
         "model.d_ff=128", "model.max_len=48"]


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = rng.randrange(len(WORDS))
        other = rng.choice([w for j, w in enumerate(WORDS) if j != (i + 1) % len(WORDS)])
        out.append({"prompt": f"The partner of {WORDS[i]} is", "chosen": f" {WORDS[(i + 1) % len(WORDS)]}.",
                    "rejected": f" {other}."})
    return out


def main(out: Path, extra: list[str]) -> None:
    from shard import config
    from shard.run import trainer

    out.mkdir(parents=True, exist_ok=True)
    (out / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(640)))
    quiet = ["train.sample_len=0", "run.plot=false", "run.tensorboard=false", "train.eval_batches=0"]
    sft = [*MODEL, "data.name=documents", f"data.path={out / 'prefs.jsonl'}", "data.seq_len=40", "data.batch_size=16",
           "data.prompt_field=prompt", "data.completion_field=chosen", "train.steps=150", "run.log_every=50",
           "optimizer.lr=3e-3", "optimizer.warmup_steps=10", f"run.dir={out / 'sft'}", *quiet]
    done = trainer.run(config.load(None, [*sft, *extra]))
    print(f"sft: loss {done.history[0]['loss']:.4f} -> {done.history[-1]['loss']:.4f}, "
          f"eval {done.eval['eval_loss']:.4f}")
    common = [*MODEL, "data.name=documents", f"data.path={out / 'prefs.jsonl'}", "data.seq_len=40",
              "data.batch_size=16", "data.prompt_field=prompt", "data.chosen_field=chosen",
              "data.rejected_field=rejected", "train.objective=dpo", "train.steps=60", "run.log_every=10",
              "checkpoint.enabled=false", "optimizer.warmup_steps=5", f"train.init_from={out / 'sft'}", *quiet]
    for name, more in (("full", ["optimizer.lr=1e-3"]), ("lora", ["train.lora.rank=8", "optimizer.lr=1e-2",
                                                                  "train.lora.targets=[q,k,v,o,mlp]"])):
        result = trainer.run(config.load(None, [*common, *more, f"run.dir={out / name}", *extra]))
        print(f"\n{name}: step | loss | dpo/margin | dpo/accuracy | chosen logp | rejected logp | step s")
        for r in result.history:
            print(f"  {r['step']:3d} | {r['loss']:.4f} | {r['dpo/margin']:+.3f} | {r['dpo/accuracy']:.3f} | "
                  f"{r['dpo/chosen_logp']:.2f} | {r['dpo/rejected_logp']:.2f} | {r['step_time_s']:.3f}")
        e = result.eval
        print(f"  eval (held-out pairs): loss {e['eval_loss']:.4f}, margin {e['eval_dpo/margin']:+.3f}, accuracy "
              f"{e['eval_dpo/accuracy']:.3f}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
