"""Serving: `python -m shard.serve` on loopback under 1, 8 and 32 concurrent clients, its memory at start-up,
and one request alone against the scanned decode of `shard.generate` (bench/generate.py's method) on the same
prompt. Greedy, so every request's answer must be the same at every concurrency (checked before anything is
reported), and the server must not compile after warm-up.

Run: `python bench/serve.py [CONFIG.yaml] [key=value ...] [--real NAME] [--requests R] [--clients 1,8,32]
[--slots S] [--context N] [--burst B] [--max-prompt P] [--max-tokens N] [--alone N] [--mesh PRESET]`.
Default model: configs/default.yaml's with max_len 512, trained one step at a learning rate of 1e-6 (nearly as
initialised: speed does not depend on the weights). `--real NAME`: a folder built by transformers from
../shared/fixtures/hf/NAME/config.json, every field kept but the sizes (4 layers, heads of 32, width about
256; its 131072 positions stay), over that folder's tokenizer or else GPT-2's files. Prompts of 4..P
characters and answers of 8..N tokens, drawn at random (seed 0). Needs httpx (and for --real, transformers:
the test extra). Prints a table and a JSON line with every figure.
"""

import argparse
import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT.parent / "shared" / "fixtures" / "hf"
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles(seconds: list[float]) -> dict:
    import numpy as np

    return {f"p{q}_s": float(np.percentile(seconds, q)) for q in (50, 99)}


async def ask(client, body: dict) -> tuple[str, int, float]:
    start = time.perf_counter()
    answer = (await client.post("/v1/completions", json=body)).raise_for_status().json()
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"], time.perf_counter() - start


async def concurrently(url: str, bodies: list[dict], clients: int) -> list:
    """Every body asked by `clients` clients at once, each sending its next as soon as it has an answer."""
    import httpx

    gate = asyncio.Semaphore(clients)

    async def one(client, body):
        async with gate:
            return await ask(client, body)

    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=clients)) as c:
        return await asyncio.gather(*(one(c, body) for body in bodies))


def trained_run(path: Path, overrides: list[str]) -> tuple[Path, dict]:
    from shard import config
    from shard.run import trainer

    folder = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    cfg = config.load(path, ["model.max_len=512", "data.seq_len=128", *overrides, f"run.dir={folder}",
                             "train.steps=1", "optimizer.lr=1e-6", "checkpoint.enabled=true", "train.sample_len=0",
                             "train.eval_batches=1", "run.progress=false", "run.tensorboard=false", "run.plot=false"])
    trainer.run(cfg)
    return folder, {"model": cfg.model.name, "config": path.name, "overrides": overrides}


def real_folder(name: str) -> tuple[Path, dict]:
    """A folder from a real config.json with small sizes, random weights, and a tokenizer."""
    import torch
    import transformers

    from shard.data import tokenizer_files

    real = json.loads((FIXTURES / name / "config.json").read_text())
    c, head = dict(real), 32
    group = real["num_attention_heads"] // (real.get("num_key_value_heads") or real["num_attention_heads"])
    kv = max(1, 256 // head // group)
    width = kv * group * head
    c.update(num_hidden_layers=4, num_attention_heads=kv * group, num_key_value_heads=kv, hidden_size=width,
             intermediate_size=round(real["intermediate_size"] / real["hidden_size"] * width))
    if c.get("head_dim"):
        c["head_dim"] = head
    folder = Path(tempfile.mkdtemp(prefix=f"bench-serve-{name}-"))
    source = FIXTURES / name if tokenizer_files.present(FIXTURES / name) else FIXTURES / "gpt2"
    for file in source.iterdir():
        if file.is_file() and file.name not in ("config.json", "generation_config.json"):
            shutil.copyfile(file, folder / file.name)
    from shard.data import tokenizer as tokenizer_lib

    tok = tokenizer_lib.load(str(folder))
    c["vocab_size"] = tok.vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids of the tokenizer now in use
        c[key] = tok.eos if key == "eos_token_id" else tok.bos if key == "bos_token_id" else None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**c), dtype=torch.float32)
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    return folder, {"model": f"{name} (scaled: 4 layers, width {width}, {kv * group}/{kv} heads of {head}, "
                             f"{real['max_position_embeddings']} positions, {params:,} parameters)",
                    "tokenizer": source.name}


def server_memory(pid: int, log: str) -> dict:
    rss = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    cache = next((line.split("cache: ", 1)[1] for line in log.splitlines() if line.endswith("allocated")), "")
    return {"resident_bytes": rss, "cache": cache}


def alone_in_process(folder: Path, prompt: str, new_tokens: int) -> float:
    """Tokens/s of shard.generate's scanned decode (bench/generate.py's method) of `prompt`, after a warm-up call."""
    import numpy as np

    import shard
    from shard.use import generate

    tok = shard.load_tokenizer(str(folder))
    generator = generate.Generator(shard.load_model(str(folder)))
    ids = np.array([tok.prompt(prompt)], np.int32)
    greedy = generate.Sampling(temperature=0, vocab=tok.vocab_size)
    generator(ids, new_tokens, greedy)
    start = time.perf_counter()
    generator(ids, new_tokens, greedy)
    return new_tokens / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/serve.py")
    parser.add_argument("--real", help="a folder of ../shared/fixtures/hf whose config.json to build from")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--context", type=int, help="the server's --context (default: its own)")
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--alone", type=int, default=256, help="tokens of the single request against generate")
    parser.add_argument("--mesh", help="the server's mesh preset (default: one device)")
    parser.add_argument("--burst", type=int, help="the server's --burst (default: its own)")
    args, rest = parser.parse_known_args(argv)
    path = Path(rest[0]) if rest and rest[0].endswith(".yaml") else ROOT / "configs" / "default.yaml"
    overrides = [a for a in rest if not a.endswith(".yaml")]
    clients = [int(c) for c in args.clients.split(",")]

    import httpx
    import jax
    import numpy as np

    folder, about = real_folder(args.real) if args.real else trained_run(path, overrides)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "shard.serve", str(folder), "--port", str(port), "--slots", str(args.slots)]
    for flag, value in (("--mesh", args.mesh), ("--context", args.context), ("--burst", args.burst)):
        command += [flag, str(value)] if value else []
    log_path = folder / "serve.log"
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))
    began = time.perf_counter()
    try:
        while True:  # loading and warm-up
            if server.poll() is not None:
                print(log_path.read_text()[-3000:], file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        ready_s = time.perf_counter() - began
        memory = server_memory(server.pid, log_path.read_text())
        rng = np.random.default_rng(0)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz    \n():=._"))
        bodies = [{"prompt": "".join(rng.choice(letters, rng.integers(4, args.max_prompt + 1))),
                   "max_tokens": int(rng.integers(8, args.max_tokens + 1)), "temperature": 0}
                  for _ in range(args.requests)]
        rows = {}
        for n in clients:
            start = time.perf_counter()
            answers = asyncio.run(concurrently(url, bodies, n))
            rows[n] = (time.perf_counter() - start, answers)
        texts = [[text for text, _, _ in answers] for _, answers in rows.values()]
        mixed = sum(any(t[i] != texts[0][i] for t in texts) for i in range(len(bodies)))
        prompt = "def alone(x):\n    return"
        alone = [asyncio.run(concurrently(url, [{"prompt": prompt, "max_tokens": args.alone, "temperature": 0}], 1))[0]
                 for _ in range(2)][-1]  # the second: the first request of a prompt length may wait on nothing new
        health = httpx.get(f"{url}/health").json()
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=600)
    if mixed or health["recompiles"] or code or alone[1] != args.alone:
        print(f"{mixed} answers differ between concurrencies, {health['recompiles']} recompiles after warm-up, "
              f"server exit code {code}, the lone request made {alone[1]} of {args.alone} tokens", file=sys.stderr)
        return 1
    scanned = alone_in_process(folder, prompt, args.alone)
    served_alone = alone[1] / alone[2]
    figures = {}
    print(f"{about['model']}: ready in {ready_s:.0f} s, resident {memory['resident_bytes'] / 2**20:,.0f} MiB; cache "
          f"{memory['cache']}")
    for n, (seconds, answers) in rows.items():
        tokens = sum(k for _, k, _ in answers)
        figures[f"clients_{n}"] = {"seconds": seconds, "requests_per_s": len(answers) / seconds,
                                   "tokens_per_s": tokens / seconds, **percentiles([s for _, _, s in answers])}
        f = figures[f"clients_{n}"]
        print(f"{n:>3} clients: {f['requests_per_s']:7.2f} requests/s {f['tokens_per_s']:9,.0f} tokens/s  latency p50 "
              f"{f['p50_s']:.2f} s p99 {f['p99_s']:.2f} s "
              f"({seconds:.1f} s for {len(answers)} requests, {tokens} tokens)")
    print(f"one request of {args.alone} tokens: served {served_alone:,.0f} tokens/s, shard.generate's scanned decode "
          f"{scanned:,.0f} tokens/s ({scanned / served_alone:.2f}x)")
    print(json.dumps({**about, "requests": args.requests, "slots": args.slots, "mesh": args.mesh, "burst": args.burst,
                      "device": jax.devices()[0].device_kind, "ready_s": ready_s, **memory, **figures,
                      "alone": {"tokens": args.alone, "served_tokens_per_s": served_alone,
                                "generate_tokens_per_s": scanned, "generate_over_served": scanned / served_alone}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
