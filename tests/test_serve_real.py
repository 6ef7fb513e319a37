"""The server over a folder built from a real config: Llama-3.2's, whose 131072 positions once sized a cache of
26 GB at start-up. Served with its defaults it holds the whole context within a bounded resident memory (the
cache sized by what is held, prompts prefilled by chunks, attention over blocks of keys); a device with less
memory caps the context, and a context that cannot fit is refused in one line before anything is compiled."""

import argparse
import json
import logging
import shutil
import signal
import subprocess
import sys
import time

import pytest

from test_hf_real_configs import FIXTURES, build, tiny  # noqa: F401  (skips where the fixtures are absent)
from conftest import ROOT, subprocess_env
from test_serve import free_port

import shard  # noqa: E402
from shard.data import tokenizer as tokenizer_lib  # noqa: E402
from shard.errors import UserError  # noqa: E402
from shard.server import cli, engine  # noqa: E402
from shard.use import generate, load  # noqa: E402

httpx = pytest.importorskip("httpx")
POSITIONS = 131072
GPT2_VOCAB = 50257


@pytest.fixture(scope="module")
def llama_3_2(tmp_path_factory):
    """Llama-3.2-3B-Instruct's config.json with 2 small layers (its RoPE scaling and 131072 positions kept),
    over GPT-2's tokenizer files."""
    folder = tmp_path_factory.mktemp("llama-3.2")
    c = tiny(json.loads((FIXTURES / "llama-3.2-3b-instruct" / "config.json").read_text()))
    c.update(vocab_size=GPT2_VOCAB, bos_token_id=GPT2_VOCAB - 1, eos_token_id=GPT2_VOCAB - 1)
    assert c["max_position_embeddings"] == POSITIONS
    build(folder, c)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(FIXTURES / "gpt2" / name, folder / name)
    return folder


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_131072_position_folder_serves_its_whole_context_within_bounded_memory(llama_3_2, tmp_path):
    port, url = free_port(), None
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "shard.serve", str(llama_3_2), "--port", str(port), "--slots", "2",
                             "--burst", "1"],  # the memory defaults, and half the programs to compile
                            cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        text = (tmp_path / "serve.log").read_text()
        assert f"2 slots x {POSITIONS} positions" in text and "cache:" in text, text
        started = rss_bytes(proc.pid)
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France", "max_tokens": 8,
                                                            "temperature": 0}, timeout=300)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        long = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 3000, "max_tokens": 4}, timeout=300)
        assert long.status_code == 200, long.text  # six chunks of prefill
        over = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * POSITIONS, "max_tokens": 1}, timeout=300)
        assert over.status_code == 400 and str(POSITIONS) in over.json()["error"]["message"]
        peak = rss_bytes(proc.pid)
        assert max(started, peak) < 2.5 * 2**30, (started, peak)
        assert httpx.get(f"{url}/health").json()["recompiles"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def test_a_smaller_device_caps_the_context_and_a_context_that_cannot_fit_is_refused(llama_3_2, caplog):
    loaded = load.load(str(llama_3_2), [], whole_mesh=False)
    generator = generate.Generator(loaded.model)
    vocab = tokenizer_lib.load(str(llama_3_2)).vocab_size
    build_engine = lambda context: engine.Engine(generator, 2, context, vocab)
    per_position = build_engine(32).cache_bytes() - build_engine(16).cache_bytes()
    assert per_position == 2 * 2 * 2 * 16 * 4 * 16  # 2 slots x 2 layers x (keys, values) x 16 wide x float32, x16

    def sized(context=None, memory_gb=None):
        loaded.cfg.run.device_memory_gb = memory_gb
        return cli.sized_context(argparse.Namespace(context=context, slots=2), generator, build_engine,
                                 loaded.cfg.run, logging.getLogger("shard.serve"))

    with caplog.at_level(logging.INFO, logger="shard.serve"):
        capped = sized(memory_gb=0.2)
    assert 1000 < capped < POSITIONS and f"context capped at {capped} (the model's is {POSITIONS})" in caplog.text
    assert sized(context=1000, memory_gb=0.2) == 1000
    with pytest.raises(UserError, match=f"the cache cannot fit: 2 slots x {POSITIONS} positions need 64.0 MiB"):
        sized(context=POSITIONS, memory_gb=0.2)
    with pytest.raises(UserError, match="fewer --slots"):
        sized(memory_gb=0.005)
    with pytest.raises(UserError, match=f"--context 200000: the model's positions end at {POSITIONS}"):
        sized(context=200000)
    assert sized() == POSITIONS  # this machine's memory holds it all


@pytest.mark.parametrize("name, ends", [("qwen3-4b", {151643, 151645}), ("gemma-2b-it", {1, 107}),
                                        ("llama-2-7b-hf", {2})])
def test_every_end_token_of_a_real_folder_stops_generation_and_serving(name, ends):
    """EOS, generation_config.json's eos_token_id list and the chat template's end of turn (<|im_end|>,
    <end_of_turn>): the ids shard.generate and the server stop at."""
    assert generate.stop_ids(tokenizer_lib.load(str(FIXTURES / name))) == ends
