"""What the framework costs over hand-written JAX: train.py's loop against a minimal loop (one jitted
step, the same model, batch shapes, loss and optimizer, no framework), alternating the two.

Each round trains STEPS steps with each; a loop's step time is measured per block of LOG_EVERY steps
(the framework logs, and so waits for the device, every LOG_EVERY steps; the minimal loop waits at
the same points), and the first two blocks of each round are warm-up. Reported: median step time of
each, their ratio (target <= 1.03), and the framework's start-up: compile time, and seconds from
process start to the end of the first step (from a fresh `python train.py` process).

Run: `python bench/overhead.py [CONFIG.yaml] [key=value ...]` (default: configs/default.yaml, 1 device).
"""

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROUNDS, STEPS, LOG_EVERY = 5, 60, 10
QUIET = ["checkpoint.enabled=false", "train.sample_len=0", "train.eval_batches=1", "run.progress=false"]


def framework_round(cfg_path, args, run_dir) -> list[float]:
    from shard import config
    from shard.run import trainer

    cfg = config.load(cfg_path, [*args, *QUIET, f"run.dir={run_dir}", f"train.steps={STEPS}",
                                 f"run.log_every={LOG_EVERY}"])
    result = trainer.run(cfg)
    # Record 0 is step 1 alone, then one per block of LOG_EVERY steps (the first of them steps 2-10). The
    # first two blocks are warm-up, as in the minimal loop: both keep steps 21-60 of each round.
    return [r["step_time_s"] for r in result.history[3:]]


class MinimalLoop:
    """The same math written directly: Flax NNX model, Optax AdamW, one jax.jit with donation."""

    def __init__(self, cfg):
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from flax import nnx

        from shard.nn import hooks
        from shard.core import registry
        from shard.core.step import cast_floats

        model_cls, kwargs = registry.load(cfg.model)
        with nnx.use_eager_sharding(False):
            model = model_cls(**kwargs, rngs=nnx.Rngs(cfg.train.seed))
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        o = cfg.optimizer
        schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, STEPS, o.lr * o.min_lr_ratio)
        tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                         optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                                     mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
        graphdef, dtype, t = self.graphdef, jnp.dtype(cfg.train.dtype), cfg.train

        def step(params, rest, opt_state, x, y):
            def loss_fn(p):
                p_compute = cast_floats(p, dtype)  # mixed precision: float32 parameters, compute in `dtype`
                # The model's own hooks for activation checkpointing and the attention kernel, no sharding.
                with hooks.use(remat=t.remat, attention=t.attention):
                    logits = nnx.merge(graphdef, p_compute, rest, copy=True)(x)
                return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), rest, opt_state, loss

        self.step = jax.jit(step, donate_argnums=(0, 1, 2))
        self.state = (params, rest, tx.init(params))
        rng = np.random.default_rng(0)
        shape = (cfg.data.batch_size, cfg.data.seq_len)
        self.batches = [(rng.integers(0, 256, shape, dtype=np.int32), rng.integers(0, 256, shape, dtype=np.int32))
                        for _ in range(8)]
        self.jax = jax

    def round(self) -> list[float]:
        times, t = [], time.perf_counter()
        for i in range(STEPS):
            x, y = self.batches[i % len(self.batches)]
            *state, loss = self.step(*self.state, x, y)
            self.state = tuple(state)
            if (i + 1) % LOG_EVERY == 0:
                float(loss)  # wait, as the framework does at a log step
                now = time.perf_counter()
                times.append((now - t) / LOG_EVERY)
                t = now
        return times[2:] if len(times) > 2 else times


def startup(cfg_path, args) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, str(ROOT / "train.py"), str(cfg_path), *args, *QUIET, f"run.dir={run_dir}",
                        "train.steps=2", "run.log_every=1"], check=True, capture_output=True)
        first = json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[0])
    return {"compile_s": first["compile_s"], "startup_s": first["startup_s"]}


def one_cpu_device(args: list[str]) -> list[str]:
    """`args` with run.cpu_devices=1 unless given, on a machine without an accelerator only: on a GPU or TPU
    machine that setting would move the run to the host's CPU. Asked without JAX, which must not start before
    the trainer sets its device count."""
    accelerator = shutil.which("nvidia-smi") or Path("/dev/accel0").exists() or Path("/dev/vfio").exists()
    given = any(a.startswith("run.cpu_devices=") for a in args)
    return args if given or accelerator else [*args, "run.cpu_devices=1"]


def main(argv: list[str]) -> int:
    cfg_path = Path(argv[0]) if argv and "=" not in argv[0] else ROOT / "configs" / "default.yaml"
    args = [a for a in argv if "=" in a]
    args = one_cpu_device(args)
    start = startup(cfg_path, args)

    from shard import config

    cfg = config.load(cfg_path, [*args, *QUIET])
    if cfg.data.name != "text":
        print("overhead.py compares language models (data.name=text)")
        return 2
    minimal = MinimalLoop(cfg)
    minimal.round()  # compile
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ROUNDS):
            ours += framework_round(cfg_path, args, Path(tmp) / str(r))
            theirs += minimal.round()
    fw, hand = statistics.median(ours), statistics.median(theirs)
    import jax

    print(f"device: {jax.devices()[0].device_kind} | jax {jax.__version__} | {cfg.model.name} "
          f"{cfg.data.batch_size}x{cfg.data.seq_len} | {ROUNDS} rounds x {STEPS} steps, alternating")
    print(f"median step: framework {fw * 1e3:.2f} ms, minimal loop {hand * 1e3:.2f} ms, ratio {fw / hand:.3f} "
          f"(target <= 1.03)")
    print(f"start-up (fresh process): compile {start['compile_s']:.1f} s, process start to end of first step "
          f"{start['startup_s']:.1f} s")
    return 0 if fw / hand <= 1.03 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
