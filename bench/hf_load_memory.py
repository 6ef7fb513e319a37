"""Host memory of reading a Hugging Face folder sharded (issue 35): a generated Llama-shaped checkpoint
(float32, two safetensors files and their index) loaded with `shard.load_model(FOLDER, mesh="fsdp")` by
8 processes of one simulated CPU device each (what 8 hosts would do), and by one process holding all 8.

    python bench/hf_load_memory.py [--layers 6] [--width 768]

Per process: the resident memory just before the load (JAX started, the processes joined), and the peak
during it (VmHWM), against the folder's size on disk. Anonymous memory (the arrays, the read buffers) and
file-backed pages (safetensors memory-maps the files; pages read stay mapped, and count in RSS while
they do, though the kernel may drop them at any time) are printed apart at the end of the load.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def status() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def make_folder(path: Path, layers: int, width: int) -> int:
    """A Llama-shaped folder of random float32 weights (grouped-query attention, 2 files): its bytes."""
    from safetensors.numpy import save_file

    heads, kv, ff, vocab = width // 64, width // 256, int(width * 8 / 3) // 64 * 64, 8192
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=width,
                  intermediate_size=ff, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, width), "model.norm.weight": (width,),
              "lm_head.weight": (vocab, width)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (width, width), p + "self_attn.k_proj.weight": (kv * 64, width),
                       p + "self_attn.v_proj.weight": (kv * 64, width), p + "self_attn.o_proj.weight": (width, width),
                       p + "mlp.gate_proj.weight": (ff, width), p + "mlp.up_proj.weight": (ff, width),
                       p + "mlp.down_proj.weight": (width, ff), p + "input_layernorm.weight": (width,),
                       p + "post_attention_layernorm.weight": (width,)})
    names, weight_map = sorted(shapes), {}
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file({n: rng.standard_normal(shapes[n], np.float32) * 0.02 for n in chunk}, str(path / file))
        weight_map.update({n: file for n in chunk})
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return total


def worker(folder: str, overrides: list[str]) -> None:
    import jax

    from shard.use import load

    cfg = load.run_settings(folder, overrides)
    from shard.run import distributed

    distributed.start(cfg.run)
    jax.devices()
    before = status()
    model = load.load(folder, overrides).model
    jax.block_until_ready(jax.tree.leaves(model))
    after = status()
    print(json.dumps({"before": before, "after": after, "process": jax.process_index()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--worker", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1:])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        size = make_folder(folder, args.layers, args.width)
        print(f"folder: {size / 1e6:.1f} MB on disk ({args.layers} layers, width {args.width}, float32)")
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        me = [sys.executable, __file__, "--worker", str(folder)]
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        runs = {"8 processes x 1 device": [subprocess.Popen(
                    me + ["mesh=fsdp", "run.cpu_devices=1", f"run.coordinator=localhost:{port}", "run.num_processes=8",
                          f"run.process_id={i}"], env=env, stdout=subprocess.PIPE, text=True) for i in range(8)]}
        results = {"8 processes x 1 device": [json.loads(p.communicate()[0].strip().splitlines()[-1])
                                              for p in runs["8 processes x 1 device"]]}
        one = subprocess.run(me + ["mesh=fsdp", "run.cpu_devices=8"], env=env, stdout=subprocess.PIPE, text=True)
        results["1 process x 8 devices"] = [json.loads(one.stdout.strip().splitlines()[-1])]
        print("| processes | per process: peak - before (x file) | anon after - before (x file) "
              "| file-backed after (x file) |")
        print("|---|---|---|---|")
        for name, got in results.items():
            peak = max(r["after"]["VmHWM"] - r["before"]["VmRSS"] for r in got) / size
            anon = max(r["after"]["RssAnon"] - r["before"]["RssAnon"] for r in got) / size
            mapped = max(r["after"]["RssFile"] - r["before"]["RssFile"] for r in got) / size
            print(f"| {name} | {peak:.3f} | {anon:.3f} | {mapped:.3f} |")


if __name__ == "__main__":
    main()
