"""The README's "Fine-tune a Hugging Face model", end to end on a CPU, offline (needs the test extra: torch and
transformers build the model):

    python bench/finetune_example.py prepare runs/hf-example     # a tiny random Llama folder and a JSONL of pairs
    python train.py ... train.init_from=runs/hf-example/model ...  # LoRA fine-tuning (the README's command)
    python -m shard.export runs/hf-example/lora --format hf --out runs/hf-example/merged
    python bench/finetune_example.py check runs/hf-example         # transformers loads the export: same logits

`prepare` writes OUT/model (config.json, model.safetensors, tokenizer.json and tokenizer_config.json: a
byte-level BPE trained on the pairs, a random 2-layer Llama with grouped-query attention) and OUT/pairs.jsonl
(prompt/completion pairs: the completion names the partner of the prompt's word, a fixed pairing of 16
words that a tiny model learns).
`check` compares the logits of `transformers.AutoModelForCausalLM.from_pretrained(OUT/merged)` with the
fine-tuned run's own (`shard.load_model`, adapters merged) on one prompt, and prints both models' greedy
answer to it.
"""

import argparse
import json
import random
import sys
from pathlib import Path

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "lemon", "piano", "ember", "frost",
         "honey", "raven", "cedar", "amber", "delta"]


def pairs(n: int, seed: int = 0) -> list[dict]:
    """Each word has a partner (the next one in WORDS); the prompt names a word, the completion its partner."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        i = rng.randrange(len(WORDS))
        rows.append({"prompt": f"The partner of {WORDS[i]} is", "completion": f" {WORDS[(i + 1) % len(WORDS)]}."})
    return rows


def prepare(out: Path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rows = pairs(4000)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([r["prompt"] + r["completion"] for r in rows],
                            trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"], show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=bpe.token_to_id("<s>"),
                                      eos_token_id=bpe.token_to_id("</s>"), tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(out / "model")
    bpe.save(str(out / "model" / "tokenizer.json"))
    # add_bos_token as Llama's own folders say it: transformers, and so the run, put BOS before every text
    (out / "model" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                      "add_bos_token": True}))
    size = sum(p.numel() for p in model.parameters())
    print(f"{out / 'model'}: a random Llama of {size:,} parameters; {out / 'pairs.jsonl'}: {len(rows)} pairs")


def check(out: Path) -> int:
    import numpy as np
    import torch
    import transformers

    import shard

    prompt = pairs(1, seed=1)[0]["prompt"]
    tokenizer = shard.load_tokenizer(str(out / "lora"))
    ids = tokenizer.prompt(prompt)  # the tokens training put before the completion
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = theirs_model(torch.tensor([ids])).logits[0].numpy()
    ours = np.asarray(shard.load_model(str(out / "lora"))(np.array([ids], np.int32))[0])
    error = float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))
    answer = theirs_model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):]
    print(f"prompt: {prompt!r}\ntransformers' greedy answer: {tokenizer.decode(answer.tolist())!r}\n"
          f"largest logit difference, relative to the largest logit: {error:.2e}")
    return 0 if error < 1e-4 else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("prepare", "check"))
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.action == "prepare":
        prepare(args.out)
        return 0
    return check(args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
