"""Tiny tokenizers of each kind shard reads, trained here offline in a second: a byte-level BPE's tokenizer.json
(with BOS before every text, as Llama 3's), the same BPE as GPT-2's two files (vocab.json + merges.txt, no config:
what AutoTokenizer cannot read alone), and a SentencePiece .model alone (converted as transformers converts it)."""

import io
import json
from pathlib import Path

KINDS = ("json", "bpe", "sentencepiece")
WORDS = ("le fromage est bon", "the cat sat on the mat", "naïve café déjà vu", "def f(x):\n    return x + 1",
         "Question: what is 2 + 2?\nAnswer: 4", "red green blue yellow", "one two three four five six")
TEXTS = ["  héllo\tworld", "the cat sat", " le fromage 🧀", "Question: 2 + 3?\nAnswer:", "a  b\n\n  c", ""]


def corpus(n: int = 40) -> list[str]:
    return [f"{WORDS[i % len(WORDS)]} {i}. {WORDS[(i * 3 + 1) % len(WORDS)]}" for i in range(n)]


def make(kind: str, out: Path) -> Path:
    """A folder holding a tokenizer of `kind` (KINDS), made from `corpus()`."""
    out.mkdir(parents=True, exist_ok=True)
    if kind == "sentencepiece":
        import sentencepiece

        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus()), model_writer=model, vocab_size=64, model_type="unigram",
            hard_vocab_limit=False, character_coverage=1.0, num_threads=1, minloglevel=2)
        (out / "tokenizer.model").write_bytes(model.getvalue())
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if kind == "bpe":
        tok.model.save(str(out))
        return out
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|endoftext|>"}))
    return out


def reference(kind: str, folder: Path):
    """transformers' tokenizer of `make`'s folder: AutoTokenizer's, or GPT-2's class for the two files it cannot
    read alone."""
    import transformers

    if kind == "bpe":
        return transformers.GPT2Tokenizer.from_pretrained(str(folder))
    return transformers.AutoTokenizer.from_pretrained(str(folder))


LLAMA_SHAPED = ["model.name=gpt", "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32",
                "model.max_len=32", "model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu"]


def trained(tokenizer: Path, tmp_path: Path, *extra: str, steps: int = 1) -> Path:
    """A tiny Llama-shaped run (the exporter writes it as llama) trained `steps` steps on documents of `corpus()`
    through `tokenizer`, its checkpoint saved: tmp_path/run."""
    from shard import config
    from shard.run import trainer

    from conftest import overrides

    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in corpus()))
    run = tmp_path / "run"
    trainer.run(config.load(None, overrides(run, *LLAMA_SHAPED, "data.name=documents", f"data.path={data}",
                                            f"data.tokenizer={tokenizer}", "data.seq_len=16", "data.batch_size=4",
                                            f"train.steps={steps}", "checkpoint.enabled=true", "run.cpu_devices=1",
                                            *extra)))
    return run
