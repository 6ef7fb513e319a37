"""data.name=documents: every file format, the three tokenizers (a BPE and a SentencePiece model trained
here on a few KB), the token cache (its stream, reuse, rebuild, interrupted builds, parallel build), a
training run through train.py that learns and reports bits per byte, generation through the tokenizer,
a bitwise resume and the one-line refusals. Everything offline, in tmp_path."""

import gzip
import importlib.util
import json
import math
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, run_cli, subprocess_env
from shard.data import documents, packing, token_cache
from shard.data import tokenizer as tokenizer_lib
from shard.errors import UserError

GPT = ["model.name=gpt", "model.d_model=32", "model.n_layers=2", "model.n_heads=8", "model.d_ff=64",
       "model.max_len=32", "data.name=documents", "data.seq_len=32", "data.batch_size=16"]
QUIET = ["run.progress=false", "run.tensorboard=false", "run.plot=false", "train.eval_batches=0",
         "optimizer.warmup_steps=2"]


def _docs() -> list[str]:
    """~40 documents of real text (the starts of the standard library's modules), two of them not ASCII."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:38]
    return [f.read_text(errors="replace")[:1500] for f in files] + ["héllo wörld, naïve café ☃ 日本語\n" * 8,
                                                                    "Ωμέγα — “quotes” 😀 and tabs\t\tend"]


DOCS = _docs()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tokenizers and corpora, once for the module."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("documents")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(root / "bpe.json"))
    (root / "spm.txt").write_text("\n".join(DOCS))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "spm.txt"), model_prefix=str(root / "spm"),
                                             vocab_size=200, character_coverage=1.0, hard_vocab_limit=False,
                                             minloglevel=2)
    half = len(DOCS) // 2
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    (root / "jsonl").mkdir()
    (root / "jsonl" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:half]))
    with gzip.open(root / "jsonl" / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[half:])
    (root / "one.json").write_text(json.dumps(rows))
    (root / "lines.json").write_text("".join(json.dumps(r) + "\n\n" for r in rows))  # JSON Lines named .json
    pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), root / "one.parquet", row_group_size=7)
    saved = root / "saved"  # what datasets' save_to_disk writes: Arrow IPC streams and two JSON files
    saved.mkdir()
    table = pa.table({"text": DOCS})
    with pa.ipc.new_stream(str(saved / "data-00000-of-00001.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=9):
            writer.write_batch(batch)
    (saved / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (root / "txt").mkdir()
    for i, d in enumerate(DOCS):
        (root / "txt" / f"{i:03d}.txt").write_text(d)
    return {"root": root, "bpe": str(root / "bpe.json"), "spm": str(root / "spm.model"), "bytes": "bytes"}


def own_encoding(spec: str, text: str) -> list[int]:
    """The tokenizer library's own encoding of one text, and EOS. A lone .model gets no BOS (as transformers'
    AutoTokenizer gives none without a tokenizer_config.json saying add_bos_token)."""
    if spec == "bytes":
        return list(text.encode()) + [10]
    if spec.endswith(".model"):
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=spec)
        return [*sp.encode(text), sp.eos_id()]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(spec)
    return tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]


@pytest.mark.parametrize("which", ["bytes", "bpe", "spm"])
def test_the_stream_is_the_tokenizers_own_encoding_joined_by_eos_and_counts_every_byte(made, which, tmp_path):
    files = documents.corpus_files(str(made["root"] / "jsonl"))
    cache = token_cache.load(files, "text", made[which], tmp_path)
    want = [own_encoding(made[which], d) for d in DOCS]
    assert cache.tokens.tolist() == [t for doc in want for t in doc]
    assert cache.documents == len(DOCS)
    per_doc = np.add.reduceat(cache.token_bytes.astype(np.int64), cache.doc_starts[:-1])
    assert per_doc.tolist() == [len(d.encode()) + 1 for d in DOCS]  # the text's UTF-8 bytes, and one for EOS


@pytest.mark.parametrize("path", ["jsonl", "one.json", "lines.json", "one.parquet", "saved", "txt", "jsonl/*.jsonl*"])
def test_every_format_reads_the_same_documents(made, path):
    files = documents.corpus_files(str(made["root"] / path))
    assert [t for f in files for batch in documents.texts(f, "text") for t in batch] == DOCS


def test_a_folder_of_mixed_files_reads_them_all(made, tmp_path):
    shutil.copy(made["root"] / "jsonl" / "a.jsonl", tmp_path)
    shutil.copy(made["root"] / "one.parquet", tmp_path)
    shutil.copy(made["root"] / "txt" / "000.txt", tmp_path)
    texts = [t for f in documents.corpus_files(str(tmp_path)) for b in documents.texts(f, "text") for t in b]
    assert len(texts) == len(DOCS) // 2 + len(DOCS) + 1


def test_the_cache_is_reused_and_a_changed_file_rebuilds(made, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    shutil.copytree(made["root"] / "jsonl", corpus)
    first = token_cache.load(documents.corpus_files(str(corpus)), "text", made["bpe"], tmp_path / "cache")
    built = []
    monkeypatch.setattr(token_cache, "build", lambda *a, **k: built.append(a) or pytest.fail("rebuilt"))
    again = token_cache.load(documents.corpus_files(str(corpus)), "text", made["bpe"], tmp_path / "cache")
    assert again.folder == first.folder and not built
    monkeypatch.undo()
    with open(corpus / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    changed = token_cache.load(documents.corpus_files(str(corpus)), "text", made["bpe"], tmp_path / "cache")
    assert changed.folder != first.folder and changed.documents == len(DOCS) + 1


def test_an_interrupted_build_leaves_no_cache(made, tmp_path, monkeypatch):
    files = documents.corpus_files(str(made["root"] / "jsonl"))
    calls = []

    def stop_at_the_second_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as Ctrl-C lands
        return real(*args, **kwargs)

    real = token_cache._encode_file
    monkeypatch.setattr(token_cache, "_encode_file", stop_at_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        token_cache.load(files, "text", made["bpe"], tmp_path)
    assert list(tmp_path.iterdir()) == []  # no cache, and no half-written folder either
    monkeypatch.undo()
    assert token_cache.load(files, "text", made["bpe"], tmp_path).documents == len(DOCS)


KILLED_BUILD = """
import sys, time
from pathlib import Path
from shard.data import documents, token_cache
real = token_cache._encode_file
def slow(index, *args, **kwargs):
    if index == 1:  # the first file is written: the build is half done
        Path(sys.argv[3]).touch()
        time.sleep(60)
    return real(index, *args, **kwargs)
token_cache._encode_file = slow
token_cache.load(documents.corpus_files(sys.argv[1]), "text", "bytes", sys.argv[2])
"""


def test_a_killed_build_leaves_no_cache_and_the_next_one_builds(made, tmp_path):
    import subprocess
    import sys
    import time

    started = tmp_path / "started"
    child = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(made["root"] / "jsonl"), str(tmp_path / "cache"),
                              str(started)], cwd=ROOT, env=subprocess_env())
    deadline = time.time() + 60
    while not started.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    child.kill()
    child.wait()
    assert started.exists()
    left = list((tmp_path / "cache").iterdir())
    assert len(left) == 1 and left[0].name.startswith(".")  # only the scratch folder, never read
    files = documents.corpus_files(str(made["root"] / "jsonl"))
    assert token_cache.load(files, "text", "bytes", tmp_path / "cache").documents == len(DOCS)
    assert not left[0].exists()  # the next build removed the dead one's scratch folder
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def test_a_parallel_build_writes_what_one_process_does(made, tmp_path, monkeypatch):
    files = documents.corpus_files(str(made["root"] / "txt"))
    serial = token_cache.load(files, "text", made["bpe"], tmp_path / "serial")
    monkeypatch.setattr(token_cache, "PARALLEL_MIN_BYTES", 0)
    parallel = token_cache.load(files, "text", made["bpe"], tmp_path / "parallel", workers=2)
    np.testing.assert_array_equal(parallel.tokens, serial.tokens)
    np.testing.assert_array_equal(parallel.token_bytes, serial.token_bytes)
    np.testing.assert_array_equal(parallel.doc_starts, serial.doc_starts)


def test_eval_rows_carry_their_bytes_and_the_split_is_by_document(made, tmp_path):
    from shard import config

    cfg = config.load(None, [*GPT, f"data.path={made['root'] / 'jsonl'}", f"data.tokenizer={made['bpe']}",
                             "data.eval_fraction=0.1"]).data
    train, held, cache = packing.splits(cfg, tmp_path)
    assert len(held.split.starts) == 4 and len(train.split.starts) == len(DOCS) - 4
    assert not set(held.split.starts) & set(train.split.starts)
    batch = held.read_batch(np.arange(len(held)))
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["bytes"].dtype == np.int32 and 0 < batch["bytes"].sum() <= sum(cache.token_bytes)
    assert "bytes" not in train.read_batch(np.arange(2))


def test_training_learns_reports_bits_per_byte_and_generates_through_the_tokenizer(made, tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    args = [*GPT, f"data.path={made['root'] / 'jsonl'}", f"data.tokenizer={made['bpe']}", f"data.cache_dir={cache}",
            f"run.dir={run_dir}", "train.steps=30", "run.log_every=1", "train.sample_len=8", *QUIET]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "\nsample:\n" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.5  # it learns
    final = records[-1]
    # Bits per byte: the eval split's nats over the UTF-8 bytes its target tokens stand for.
    from shard import config

    cfg = config.load(None, args).data
    assert cfg.tokenizer == made["bpe"]
    _, held, _ = packing.splits(cfg, cache)
    total_bytes = int(held.read_batch(np.arange(len(held)))["bytes"].sum())
    nats = final["eval_loss"] * len(held) * 32
    assert final["eval_bits_per_byte"] == pytest.approx(nats / math.log(2) / total_bytes, rel=1e-5)
    assert final["eval_bits_per_byte"] < final["eval_loss"] / math.log(2)  # a BPE token is more than a byte

    # The vocabulary followed the tokenizer, and generation goes through it: a text prompt in, text out.
    import subprocess
    import sys

    import shard
    from shard.use import generate, load

    assert "vocab_size: 300" in (run_dir / "config.yaml").read_text()
    # the run's own copy
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == Path(made["bpe"]).read_bytes()
    tok = shard.load_tokenizer(str(run_dir))
    assert tok.decode(tok.encode("def héllo(x):")) == "def héllo(x):"
    out = subprocess.run([sys.executable, "-m", "shard.generate", str(run_dir), "--prompt", "def ",
                          "--temperature", "0", "--max-new-tokens", "6"],
                         cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    model = load.load(str(run_dir), [], whole_mesh=False).model
    tokens = generate.Generator(model)(np.array([tok.encode("def ")]), 6, generate.Sampling(0, vocab=300), eos=tok.eos)
    assert out.stdout == "def " + tok.decode(generate.until_eos(tokens[0], tok.eos)) + "\n"


def test_byte_tokens_keep_bits_per_byte_the_loss_over_ln2(made, train, tmp_path):
    result = train(*GPT, f"data.path={made['root'] / 'saved'}", f"data.cache_dir={tmp_path / 'cache'}",
                   "train.steps=3", "train.eval_batches=0", "run.cpu_devices=1")
    assert result.eval["eval_bits_per_byte"] == pytest.approx(result.eval["eval_loss"] / math.log(2), rel=1e-6)


def test_resume_is_bitwise(made, train, tmp_path):
    corpus = [*GPT, f"data.path={made['root'] / 'one.parquet'}", f"data.tokenizer={made['spm']}",
              f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4", "run.log_every=1", "checkpoint.enabled=true",
              "checkpoint.every=2", "checkpoint.keep=5", "checkpoint.async=false", "run.cpu_devices=2"]
    whole = train(*corpus, subdir="whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = train(*corpus, subdir="resumed")
    assert resumed.start_step == 2
    import shard

    assert shard.load_tokenizer(str(tmp_path / "whole")).found.kind == "sentencepiece"  # the run's copy of spm.model
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history][2:]  # bitwise


def _train_main():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


BAD = {  # case: (corpus file name, its content or None, overrides, what the line names)
    "missing field": ("a.jsonl", '{"content": "x"}\n', [], "no data.field='text'; its fields are: content"),
    "malformed JSON line": ("a.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": \n', [], "a.jsonl:3: malformed JSON"),
    "empty corpus": ("a.jsonl", '{"text": ""}\n{"text": null}\n', [], "hold no documents"),
    "unreadable tokenizer": ("a.jsonl", '{"text": "a"}\n', ["data.tokenizer=BAD"], "is not a readable tokenizer"),
    "parquet without the column": ("a.parquet", None, [], "no column data.field='text'; its columns are: body"),
    "tokenizer for the text source": ("a.jsonl", '{"text": "a"}\n', ["data.name=text", "data.tokenizer=BPE"],
                                      "is read by data.name=documents only"),
    "tokenizer larger than the model": ("a.jsonl", '{"text": "a"}\n', ["data.tokenizer=BPE", "model.vocab_size=256"],
                                        "model.vocab_size=256 is smaller than data.tokenizer="),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(made, tmp_path, case, monkeypatch):
    name, content, extra, named = BAD[case]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["a", "b"]}), corpus / name)
    else:
        (corpus / name).write_text(content)
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    extra = [e.replace("BAD", str(tmp_path / "bad.json")).replace("BPE", made["bpe"]) for e in extra]
    argv = [*GPT, f"data.path={corpus}", f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
            *QUIET, *extra]
    if case == "missing field":  # as a user meets it: a new process
        proc = run_cli(*argv)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        stderr = proc.stderr
    else:
        monkeypatch.chdir(ROOT)
        with pytest.raises(UserError) as raised:
            _train_main()(argv)
        stderr = f"error: {raised.value}\n"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], stderr
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_a_tokenizer_that_is_not_there_is_one_line():
    with pytest.raises(UserError, match="data.tokenizer='nowhere.json' does not exist"):
        tokenizer_lib.load("nowhere.json")


@pytest.mark.parametrize("packing", ["concat", "documents"])
def test_two_processes_read_their_own_rows_and_train_as_one(made, train, tmp_path, packing):
    """Two real processes sharing one cache folder (both find it missing and race to build it) each read
    only their rows of every global batch; the curve is one process's."""
    from test_multihost import losses as logged, train_processes

    corpus = [*GPT, f"data.path={made['root'] / 'jsonl'}", f"data.tokenizer={made['bpe']}", f"data.packing={packing}",
              f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4", "run.log_every=1", "mesh=fsdp",
              "model.vocab_size=304"]  # the launcher puts the tests' tiny GPT (256 tokens) first
    one = train(*corpus, "run.cpu_devices=8", f"data.cache_dir={tmp_path / 'one_cache'}", subdir="one")
    train_processes(tmp_path / "two", 2, *corpus, "mesh.dcn_fsdp=2")
    np.testing.assert_allclose(logged(tmp_path / "two"), [r["loss"] for r in one.history], rtol=1e-5)
