"""The frozen base's bytes per device under train.lora.base (issue 48), without compiling: the LoRA strategy's own
plan figures for a Llama-3-8B shape under fsdp over N simulated CPU devices (the split run.target=h100x8, N=8, and
v5p-8, N=4, plan with mesh=fsdp). Usage: python bench/qlora_bytes.py N"""
import os
import sys
n = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from shard import config
from shard.core import step as step_lib
from shard.run import job as job_lib

SHAPE = ["model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8", "model.d_ff=14336",
         "model.vocab_size=128256", "model.max_len=4096", "model.rope_theta=500000", "model.norm_eps=1e-5",
         "data.seq_len=4096", "data.batch_size=8", "mesh=fsdp", "train.remat=full", "train.dtype=bfloat16",
         "train.lora.rank=16", "train.lora.targets=[q,k,v,o,mlp]", f"run.cpu_devices={n}", "run.dir=runs/qlora_bytes"]
step_lib.compile_step = lambda *a, **k: None  # the state's layout only
for base in ("float32", "bfloat16", "nf4", "int4", "int8"):
    cfg = config.load("configs/gpt_1b.yaml", [*SHAPE, f"train.lora.base={base}"])
    job = job_lib.prepare(cfg, jax.devices()[:n], training=False)
    lora = job.strategy("lora").plan(job, [], n)["lora"]
    print(f"{n} devices, base {base}: {lora['base_bytes_per_device'] / 2**30:.3f} GiB a device "
          f"(float32 {lora['base_float32_bytes_per_device'] / 2**30:.3f}); adapters "
          f"{lora['adapter_bytes_per_device'] / 2**20:.1f} MiB; {lora['frozen_params']:,} frozen", flush=True)
