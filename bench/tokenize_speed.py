"""The token cache's build (shard/data/token_cache.py: read the files, tokenize in worker processes, write
the cache) against the `tokenizers` library's own `encode_batch` on the same texts already in memory, with
all its threads: tokens per second of each, and their ratio (target >= 0.8).

The corpus is the Python standard library's sources (repeated to MEGABYTES), as FILES JSON Lines files of
one document per module; the tokenizer is a byte-level BPE of VOCAB tokens trained on a slice of it. The
library's figure counts the texts' tokens only; the build's the same (its EOS separators are left out).

Run: `python bench/tokenize_speed.py [MEGABYTES] [FILES] [VOCAB]` (default 40 8 8192).
"""

import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH = 1024


def corpus(folder: Path, megabytes: int, files: int) -> list[str]:
    sources = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))]
    texts, size = [], 0
    while size < megabytes << 20:
        for t in sources:
            texts.append(t)
            size += len(t.encode())
            if size >= megabytes << 20:
                break
    per_file = -(-len(texts) // files)
    for i in range(files):
        with open(folder / f"part-{i:03d}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts[i * per_file:(i + 1) * per_file])
    return texts


def train_tokenizer(texts: list[str], vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts[:2000], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                              show_progress=False))
    tok.save(str(path))


def library(texts: list[str], path: Path) -> tuple[int, float]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), BATCH):
        tokens += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + BATCH], add_special_tokens=False))
    return tokens, time.perf_counter() - start


def cache_build(folder: Path, path: Path, cache_dir: Path) -> tuple[int, float]:
    from shard.data import documents, token_cache

    start = time.perf_counter()
    cache = token_cache.load(documents.corpus_files(str(folder)), "text", str(path), cache_dir)
    return cache.meta["tokens"] - cache.meta["documents"], time.perf_counter() - start


def main(argv: list[str]) -> None:
    megabytes, files, vocab = (int(a) for a in (argv + ["40", "8", "8192"][len(argv):]))
    import tokenizers

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        (scratch / "corpus").mkdir()
        texts = corpus(scratch / "corpus", megabytes, files)
        train_tokenizer(texts, vocab, scratch / "tokenizer.json")
        # The library first (its threads, this process), then the build (worker processes); each twice,
        # the better of two kept, the page cache warm for both.
        lib = min((library(texts, scratch / "tokenizer.json") for _ in range(2)), key=lambda r: r[1])
        ours = min((cache_build(scratch / "corpus", scratch / "tokenizer.json", scratch / f"cache{i}")
                    for i in range(2)), key=lambda r: r[1])
    assert lib[0] == ours[0], (lib, ours)  # the same tokens
    print(f"corpus: {megabytes} MB in {files} JSON Lines files, {len(texts):,} documents, {lib[0]:,} tokens; "
          f"BPE of {vocab}; {os.cpu_count()} cores; tokenizers {tokenizers.__version__}")
    print(f"tokenizers encode_batch (texts in memory): {lib[0] / lib[1]:,.0f} tokens/s ({lib[1]:.2f} s)")
    print(f"token cache build (read, tokenize, write): {ours[0] / ours[1]:,.0f} tokens/s ({ours[1]:.2f} s)")
    print(f"ratio: {lib[1] / ours[1]:.2f}x (target >= 0.8)")


if __name__ == "__main__":
    main(sys.argv[1:])
