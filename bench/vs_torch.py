"""Tokens per second: our GPT under train.py's loop against the same GPT written in plain PyTorch.

Same shapes (configs/default.yaml unless given: width, depth, heads, 4x GELU MLP, learned positions,
pre-norm LayerNorm, untied output layer, no biases in the matrices), the same AdamW with warmup,
cosine decay, global-norm clipping and decay on matrices only, the same batch. The two alternate for
ROUNDS rounds; each reports the median of blocks of LOG_EVERY steps after warm-up. With `--compile`
the PyTorch model also runs under torch.compile, as a PyTorch user would.

PyTorch runs in processes of its own, which take turns with ours round by round (each waits while the
others run). On a GPU there is one, which shares the GPU with ours (JAX allocates as it goes rather than
taking 75% of the memory up front). It runs PyTorch as its users make it fast: batches already on the
device, AdamW's fused CUDA kernel, bf16 autocast when `train.dtype=bfloat16` (float32 parameters, as
ours), and its scaled_dot_product_attention, which picks flash attention itself (give ours
`train.attention=cudnn`).

On a CPU there are three as shipped and three more given the host allocator settings our trainer makes by
default (`run.reuse_host_memory`, shard/run/host_malloc.py). Three, because one PyTorch process can run ~20%
faster or slower than the next for its whole life. The second kind shows which part of the gap is the
allocator and which the compiled step: under glibc's defaults PyTorch's eager step flips between two
speeds about a fifth apart on this model (bench/RESULTS.md).

Run: `pip install torch` then `python bench/vs_torch.py [CONFIG.yaml] [key=value ...] [--compile]`.
"""

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with PyTorch

from overhead import LOG_EVERY, QUIET, ROUNDS, STEPS, framework_round, one_cpu_device  # noqa: E402


def torch_gpt(cfg):
    import torch
    from torch import nn
    from torch.nn import functional as F

    k = cfg.model.kwargs
    d, layers, heads = k.get("d_model", 128), k.get("n_layers", 4), k.get("n_heads", 4)
    vocab, max_len, d_ff = (k.get("vocab_size", 256), k.get("max_len", 512),
                            k.get("d_ff", 0) or 4 * k.get("d_model", 128))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.out = nn.Linear(d, d, bias=False)
            self.w_in, self.w_out = nn.Linear(d, d_ff, bias=False), nn.Linear(d_ff, d, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q, k_, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k_, v = (y.view(b, t, heads, d // heads).transpose(1, 2) for y in (q, k_, v))
            y = F.scaled_dot_product_attention(q, k_, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.out(y)
            return x + self.w_out(F.gelu(self.w_in(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(max_len, d))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return GPT()


def torch_round(step_fn, batches) -> list[float]:
    times, t = [], time.perf_counter()
    for i in range(STEPS):
        loss = step_fn(*batches[i % len(batches)])
        if (i + 1) % LOG_EVERY == 0:
            float(loss)
            now = time.perf_counter()
            times.append((now - t) / LOG_EVERY)
            t = now
    return times[2:]


def torch_setup(cfg, steps: int = STEPS, compile_: bool = False):
    """The PyTorch GPT with its AdamW, schedule and one train step, and 8 batches: (step_fn, batches, model)."""
    import numpy as np
    import torch
    from torch.nn import functional as F

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch_gpt(cfg).to(device)
    o = cfg.optimizer
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0}],
                            lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, fused=device == "cuda")
    bf16 = cfg.train.dtype == "bfloat16"
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    warm = o.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / max(warm, 1) if s < warm else o.min_lr_ratio + (
        1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(steps - warm, 1)))))
    forward = torch.compile(model) if compile_ else model

    def step_fn(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast():
            logits = forward(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        sched.step()
        return loss.detach()

    rng = np.random.default_rng(0)
    shape = (cfg.data.batch_size, cfg.data.seq_len)
    batches = [(torch.from_numpy(rng.integers(0, 256, shape)).to(device),
                torch.from_numpy(rng.integers(0, 256, shape)).to(device)) for _ in range(8)]
    return step_fn, batches, model


PROCESSES = 3  # PyTorch processes of each kind on a CPU


def parse(argv: list[str]):
    """(config path, key=value args with run.cpu_devices=1 unless given or on an accelerator, --compile)."""
    compile_ = "--compile" in argv
    argv = [a for a in argv if a not in ("--compile", "--worker", "--allocator")]
    cfg_path = Path(argv[0]) if argv and "=" not in argv[0] else ROOT / "configs" / "default.yaml"
    args = [a for a in argv if "=" in a]
    return cfg_path, one_cpu_device(args), compile_


def load_config(cfg_path, args):
    from shard import config
    from shard.core import registry

    cfg = config.load(cfg_path, [*args, *QUIET])
    cfg.model.kwargs = registry.with_defaults(registry.resolve(cfg.model.name), cfg.model.kwargs)
    return cfg


def worker(argv: list[str]) -> int:
    """A PyTorch process: warms up, says what it runs, then trains one round per line on stdin and
    answers with the round's block times as a JSON line. `--allocator`: our trainer's host allocator
    settings first."""
    import torch

    if "--allocator" in argv:
        from shard.run import host_malloc

        host_malloc.keep_freed_memory()
    cfg_path, args, compile_ = parse(argv)
    step_fn, batches, model = torch_setup(load_config(cfg_path, args), STEPS, compile_)
    torch_round(step_fn, batches)  # warm-up (and compile)
    print(json.dumps({"device": batches[0][0].device.type, "threads": torch.get_num_threads(),
                      "version": torch.__version__, "parameters": sum(p.numel() for p in model.parameters())}),
          flush=True)
    for _ in sys.stdin:
        print(json.dumps(torch_round(step_fn, batches)), flush=True)
    return 0


class Worker:
    """bench/vs_torch.py --worker in a child process, driven a round at a time."""

    def __init__(self, argv: list[str], allocator: bool):
        flags = ["--worker"] + (["--allocator"] if allocator else [])
        self.proc = subprocess.Popen([sys.executable, __file__, *flags, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = self._answer()

    def _answer(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the PyTorch worker stopped (exit {self.proc.wait()})")
        return json.loads(line)

    def round(self) -> list[float]:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def main(argv: list[str]) -> int:
    if "--worker" in argv:
        return worker(argv)
    cfg_path, args, compile_ = parse(argv)
    cfg = load_config(cfg_path, args)
    kw = cfg.model.kwargs
    if cfg.model.name != "gpt" or kw.get("position") != "learned" or kw.get("mlp") != "gelu" or kw.get("n_kv_heads"):
        print("vs_torch.py mirrors the GPT-2 style gpt (learned positions, GELU MLP, full attention heads)")
        return 2
    import jax

    on_cpu = jax.default_backend() == "cpu"
    # PyTorch as its users run it, and (on a CPU) with our allocator settings too; PROCESSES of each, since
    # one PyTorch process can run ~20% faster or slower than the next for its whole life on a CPU.
    kinds = {"PyTorch": False, "PyTorch, our allocator settings": True} if on_cpu else {"PyTorch": False}
    workers = {name: [Worker(argv, allocator=a) for _ in range(PROCESSES if on_cpu else 1)]
               for name, a in kinds.items()}
    ours, per_process = [], {}  # (kind, process) -> its block times
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(ROUNDS):
                ours += framework_round(cfg_path, args, Path(tmp) / str(r))
                for name, group in workers.items():
                    for i, w in enumerate(group):
                        per_process.setdefault((name, i), []).extend(w.round())
    finally:
        for group in workers.values():
            for w in group:
                w.close()
    info = workers["PyTorch"][0].info
    tokens = cfg.data.batch_size * cfg.data.seq_len
    a = tokens / statistics.median(ours)
    print(f"device: {jax.devices()[0].device_kind} | jax {jax.__version__} | torch {info['version']} "
          f"({info['device']}, {info['threads']} threads{', torch.compile' if compile_ else ', eager'}"
          f"{', bf16 autocast' if cfg.train.dtype == 'bfloat16' else ''}) | {info['parameters']:,} torch parameters "
          f"| batch {cfg.data.batch_size}x{cfg.data.seq_len} | {ROUNDS} rounds, alternating, PyTorch in "
          f"{len(workers['PyTorch'])} process(es) of its own per kind")
    for name in workers:
        kind = [t for (n, _), t in per_process.items() if n == name]
        b = tokens / statistics.median([x for t in kind for x in t])
        each = ", ".join(f"{statistics.median(t) * 1e3:.1f}" for t in kind)
        print(f"tokens/s: ours {a:,.0f}, {name} {b:,.0f}, ratio {a / b:.2f} (ms a step: ours "
              f"{statistics.median(ours) * 1e3:.1f}; each PyTorch process {each})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
