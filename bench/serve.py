"""Serving throughput: `python -m shard.serve` answering R requests sent all at once (continuous batching over
its slots) against the same requests sent one at a time, on loopback. Greedy, so each request's answer must be
the same both ways (checked before anything is reported), and the server must not compile after warm-up.

Run: `python bench/serve.py [CONFIG.yaml] [key=value ...] [--requests R] [--slots S] [--max-prompt P]
[--max-tokens N] [--mesh PRESET]` (default: configs/default.yaml's model with max_len 128, trained one step at
a learning rate of 1e-6, so nearly as initialised: speed does not depend on the weights). Prompts of 4..P
bytes and answers of 8..N tokens, drawn at random (seed 0). Needs httpx (the test extra). Prints a table and
a JSON line with every figure: requests/s and tokens/s both ways and their ratio, latency percentiles.
"""

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles(seconds: list[float]) -> dict:
    import numpy as np

    return {f"p{q}_s": float(np.percentile(seconds, q)) for q in (50, 90, 99)}


async def ask(client, body: dict) -> tuple[str, int, float]:
    start = time.perf_counter()
    answer = (await client.post("/v1/completions", json=body)).raise_for_status().json()
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"], time.perf_counter() - start


async def one_at_a_time(url: str, bodies: list[dict]) -> list:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        return [await ask(client, body) for body in bodies]


async def all_at_once(url: str, bodies: list[dict]) -> list:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        return await asyncio.gather(*(ask(client, body) for body in bodies))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/serve.py")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mesh", help="the server's mesh preset (default: one device)")
    args, rest = parser.parse_known_args(argv)
    path = Path(rest[0]) if rest and rest[0].endswith(".yaml") else ROOT / "configs" / "default.yaml"
    overrides = [a for a in rest if not a.endswith(".yaml")]

    import httpx
    import jax
    import numpy as np

    from shard import config
    from shard.run import trainer

    folder = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    cfg = config.load(path, ["model.max_len=128", "data.seq_len=128", *overrides, f"run.dir={folder}",
                             "train.steps=1", "optimizer.lr=1e-6", "checkpoint.enabled=true", "train.sample_len=0",
                             "train.eval_batches=1", "run.progress=false", "run.tensorboard=false", "run.plot=false"])
    trainer.run(cfg)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "shard.serve", str(folder), "--port", str(port), "--slots", str(args.slots)]
    server = subprocess.Popen(command + (["--mesh", args.mesh] if args.mesh else []), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=open(folder / "serve.log", "w"))
    try:
        while True:  # loading and warm-up
            if server.poll() is not None:
                print((folder / "serve.log").read_text()[-3000:], file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        rng = np.random.default_rng(0)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz    \n():=._"))
        bodies = [{"prompt": "".join(rng.choice(letters, rng.integers(4, args.max_prompt + 1))),
                   "max_tokens": int(rng.integers(8, args.max_tokens + 1)), "temperature": 0}
                  for _ in range(args.requests)]
        rows = {}
        for name, send in (("one at a time", one_at_a_time), ("all at once", all_at_once)):
            start = time.perf_counter()
            answers = asyncio.run(send(url, bodies))
            rows[name] = (time.perf_counter() - start, answers)
        texts = [[text for text, _, _ in answers] for _, answers in rows.values()]
        mixed = sum(a != b for a, b in zip(*texts))
        health = httpx.get(f"{url}/health").json()
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=600)
    if mixed or health["recompiles"] or code:
        print(f"{mixed} answers differ between the two ways, {health['recompiles']} recompiles after warm-up, "
              f"server exit code {code}", file=sys.stderr)
        return 1
    figures = {}
    for name, (seconds, answers) in rows.items():
        key = name.replace(" ", "_")
        tokens = sum(n for _, n, _ in answers)
        figures[key] = {"seconds": seconds, "requests_per_s": len(answers) / seconds, "tokens_per_s": tokens / seconds,
                        **percentiles([s for _, _, s in answers])}
        print(f"{name:>14}: {len(answers) / seconds:7.2f} requests/s {tokens / seconds:9,.0f} tokens/s  latency p50 "
              f"{figures[key]['p50_s']:.2f} s p90 {figures[key]['p90_s']:.2f} s p99 {figures[key]['p99_s']:.2f} s "
              f"({seconds:.1f} s for {len(answers)} requests, {tokens} tokens)")
    ratio = figures["all_at_once"]["tokens_per_s"] / figures["one_at_a_time"]["tokens_per_s"]
    print(f"continuous batching: {ratio:.1f}x the tokens/s of one request at a time")
    print(json.dumps({"model": cfg.model.name, "config": path.name, "overrides": overrides, "requests": args.requests,
                      "slots": args.slots, "mesh": args.mesh,
                      "device": jax.devices()[0].device_kind, "ratio": ratio, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
