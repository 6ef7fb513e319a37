"""MaxText's train step and ours, compiled side by side for a TPU slice we do not have (issue 46).

Both steps are compiled by the same TPU compiler (libtpu, for compile-only devices: nothing runs on a TPU) for
the same model shape, batch, mesh (fsdp over every chip, or --mesh ep), remat (full) and compiler flags, and
the script prints what that compiler says of each: its step-time estimate (the cost model's
`optimal_seconds`), its FLOPs and the memory per chip (arguments + outputs not aliased + temporaries).
Figures, not measurements.

Columns: ours with XLA attention (`train.attention=xla`; its logits and softmax in float32, our default),
the same in bfloat16 (`train.attention_precision=bfloat16`, as MaxText's dot_product computes them), ours
with Pallas splash attention (`train.attention=splash`), MaxText with `attention=dot_product` and MaxText
with `attention=flash` (its splash kernel on TPU). Rows: the layers scanned (both frameworks' default) or unrolled
(`train.scan_layers=false`, MaxText's `scan_layers=false`), each with the flags shard/plan/chips.yaml
recommends for TPUs (what our plan compiles with by default; the same dict is handed to MaxText's compile
as its `compile_xla_flags`) or with none.

Both columns are read the same way, by shard.plan's own code (`compiler_figures`; for MaxText applied
here to its compiled program's cost analysis and HLO):
- XLA's cost analysis counts a loop body once: the scanned rows' time is scaled by each loop body's
  share of the program times its trip count (hlo.loop_scale), and the FLOPs get the loops' other
  iterations' matrix products added.
- The TPU cost model gives a Pallas kernel zero FLOPs and zero time: where the program calls one (the
  splash columns), attention's analytic FLOPs (causal pairs only, shard.nn.attention.flops; forward,
  backward twice, and the forward again under full remat: x4) are added, at the chip's peak
  (459 TFLOP/s bf16 for a v5p chip). "kernel ms" is that share.

MaxText needs Python 3.12 (its wheel says Requires-Python >=3.12, and maxtext/kernels/mhc uses 3.12's
`type X = ...` statement, imported by every decoder), so it lives in its own virtual environment, made by
`--setup` from a Python 3.12 interpreter (`--python`, default: the first python3.12 that runs: PATH, then
pyenv's versions). Debian 12 has no python3.12 package; `pyenv install 3.12` builds one. Setup installs,
each with `pip install --no-deps` from PyPI:
  - the compiler stack at exactly this interpreter's versions (jax, jaxlib, libtpu, flax, optax, orbax,
    numpy, ...), so that both sides compile with the same libtpu;
  - maxtext==0.2.5 and only the packages its train_compile imports (PACKAGES below, pinned: found by
    importing it until nothing was missing), none of their own dependencies.
MaxText 0.2.5 asks for jax>=0.11.1, but its train step compiles with jax 0.10.2: only
`jax.experimental.xla_metadata.must_fuse_call` (jax 0.11) is missing, used by its jax_flash_attention
kernel (neither dot_product nor flash on TPU calls it); the worker gives that name a stub that raises.

The MaxText side runs MaxText's own `maxtext.trainers.pre_train.train_compile.main` (its
`python -m maxtext.trainers.pre_train.train_compile compile_topology=v5p-8 compile_topology_num_slices=1
...`) in the venv, with the compiled object kept (its `jit_and_compile` wrapped) so that its
cost_analysis(), memory_analysis() and HLO text can be read; config overrides below (MaxText's base.yml,
the model's shape given as base_* keys, or model_name=llama3-8b). MaxText's main adds
--xla_tpu_spmd_rng_bit_generator_unsafe=true to LIBTPU_INIT_ARGS; ours is given the same environment.

GPU targets (h100x8 only: MaxText's `compile_topology=a3`): run this script with a Python that has the CUDA plugin
(`pip install -e ".[cuda]"`), and give the venv the same plugin and NVIDIA wheels, e.g.
`.venv-maxtext/bin/pip install --no-deps jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 nvidia-cudnn-cu12 ...`
(the versions `pip list | grep nvidia` shows here). MaxText's GPU path compiles for jax.devices(); the worker
hands it the CUDA plugin's compile-only H100s, and the flags go through XLA_FLAGS.

Our side is `python train.py CONFIG run.target=TARGET --dry-run ...` in a subprocess (--ours-worker: its step's
HLO kept); its plan file (<run.dir>/plan-TARGET.json, "compiler" section) has the figures.

Shapes (--shape):
  gpt_1b     configs/gpt_1b.yaml: d_model 2048, 20 layers, 16 heads of 128, SwiGLU 5632, vocab 256, seq 2048,
             batch 8 per step (2 per chip on 4 chips), bf16 compute, float32 parameters, fsdp=4, remat full.
             MaxText: base.yml with the same shape as base_* keys and vocab_size=256 (its config allows it).
  llama3_8b  MaxText's model_name=llama3-8b (d 4096, 32 layers, 32 heads / 8 kv heads of 128, ffn 14336,
             vocab 128256, rope theta 500000), seq 8192, per-chip batch 1; ours: gpt_1b.yaml with the
             same shape as model.* overrides.
  qwen3_30b_a3b  a mixture of experts (issue 58): MaxText's model_name=qwen3-30b-a3b (48 layers of 128 experts,
             8 a token, expert ffn 768, d 2048, 32 heads / 4 kv heads of 128, vocab 151936), dropless
             (sparse_matmul=true, capacity_factor=-1) through its megablox Pallas kernels (megablox=true,
             use_tokamax_gmm=false: maxtext/kernels/megablox); ours: gpt_1b.yaml, train.init_from=a folder of
             Qwen3-30B-A3B's config.json alone (bench/family_plans.py's), dropless, train.grouped_matmul=auto:
             JAX's Pallas megablox kernels with MaxText's tiles (since the third session of 2026-11-29; tokamax's
             Mosaic kernels earlier that day; before, on a compile-only target, tokamax's XLA path).
             Seq 4096, per-chip batch 1. --mesh ep: the experts over every chip (ours mesh=ep; MaxText
             ici_expert_parallelism=N, whose rules split the other weights over that axis too, as our ep
             preset does since 2026-11-29; ours-xla-rest-whole keeps them whole, the preset before). Both sides'
             scatters stay on the TensorCore (MOE_FLAGS).
             A grouped-matmul kernel carries its own cost estimate, which the TPU cost model counts (unlike
             splash's): nothing analytic is added for it, only its loops' other iterations. megablox's estimate
             counts its whole receive buffer, by default sized for the worst case (every token of the expert
             group to one shard: 16x a fair share on 16 chips); maxtext-dot-buffer sizes it as ours are.

Commands:
  python bench/anchor_compile.py --setup [--python /path/to/python3.12]   # once: the venv (PyPI only)
  python bench/anchor_compile.py --shape gpt_1b --target v5p-8           # every cell, a few minutes each
  python bench/anchor_compile.py --shape gpt_1b --layers unrolled --flags recommended --sides maxtext-dot
  python bench/anchor_compile.py --shape gpt_1b --table                  # the table from the results so far
  python bench/anchor_compile.py --shape qwen3_30b_a3b --mesh ep --target v5p-32 --layers scanned \
      --flags recommended --sides ours-xla,ours-xla-embed-split,maxtext-dot,maxtext-dot-buffer
The venv is --venv (default: $SHARD_MAXTEXT_VENV, else .venv-maxtext beside the repository's folder).
Each cell's figures are appended to --out (default runs/anchor_compile/SHAPE-TARGET[-MESH].jsonl) as it
finishes; a cell already there is not compiled again (--redo to recompile). Logs beside it. Run one
at a time: each compile takes one to several CPU cores for minutes.

Not imported by the tests; nothing is downloaded at run time (only --setup calls pip).
"""

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = Path(os.environ.get("SHARD_MAXTEXT_VENV", ROOT.parent / ".venv-maxtext"))
MAXTEXT = "maxtext==0.2.5"

# The compiler stack: the venv gets this interpreter's versions of these (the same libtpu on both sides).
SAME_AS_HERE = ["jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes", "chex",
                "absl-py", "etils", "opt_einsum", "tensorstore", "protobuf", "msgpack", "typing_extensions",
                "treescope", "humanize", "simplejson", "psutil", "packaging", "pyyaml", "rich", "omegaconf",
                "pydantic", "pydantic_core", "annotated-types", "typing-inspection"]
# What maxtext 0.2.5's train_compile imports besides those, pinned (each with --no-deps). Found by importing
# it in a bare venv until nothing was missing; the versions are those that worked with jax 0.10.2.
PACKAGES = [
    "annotated-doc==0.0.7", "anyio==4.16.0", "aqtp==0.9.0", "array_record==0.8.6", "certifi==2026.5.20",
    "click==8.5.1", "cloudpickle==3.1.3", "drjax==0.2.1", "einshape==1.0", "fastapi==0.165.0",
    "filelock==4.3.1", "fire==0.7.1", "fsspec==2026.9.0", "grain==0.2.18", "h11==0.16.0", "hf-xet==1.8.0",
    "httpcore2==2.16.2", "httpx2==2.16.2", "huggingface_hub==2.4.0", "idna==3.20", "immutabledict==4.3.1",
    "jaxtyping==0.3.11", "Jinja2==3.1.6", "MarkupSafe==3.0.3", "mpmath==1.3.0", "opentelemetry-api==1.45.2",
    "pathwaysutils==0.1.11",  # 0.1.13 wants an orbax newer than ours
    "pillow==13.0.0", "portpicker==1.6.0", "qwix==0.1.8", "regex==2026.5.9", "requests==2.34.2",
    "safetensors==0.8.0", "sentencepiece==0.2.3", "shellingham==1.5.4", "six==1.17.0", "starlette==1.10.0",
    "sympy==1.14.0", "termcolor==3.3.0", "tiktoken==0.14.0", "tokamax==0.0.17", "tokenizers==0.23.3",
    "tqdm==4.70.1", "transformers==5.24.0", "truststore==0.10.5", "typer==0.29.2", "urllib3==2.7.0",
    "uvicorn==0.54.0", "wadler_lindig==0.1.8", "xprof==2.24.2",
]

SIDES = {  # column -> (framework, attention, more overrides)
    "ours-xla": ("ours", "xla", []),
    "ours-xla-bf16": ("ours", "xla", ["train.attention_precision=bfloat16"]),  # as MaxText's dot_product
    "ours-splash": ("ours", "splash", []),
    "ours-cudnn": ("ours", "cudnn", []),  # GPU targets
    # --mesh ep: the other weights split over the expert axis too (their embed dimension), as MaxText's rules do;
    # meshes/ep.yaml's own rule since 2026-11-29 (ours-xla is the same there now), ours-xla-rest-whole the old preset
    "ours-xla-embed-split": ("ours", "xla", ["mesh.rules.embed=[fsdp,expert]"]),
    "ours-xla-rest-whole": ("ours", "xla", ["mesh.rules.embed=fsdp"]),
    # an MoE's pairs in whole buckets (all-to-all: auto's on a TPU), or only the pairs (ragged all-to-all)
    "ours-xla-padded": ("ours", "xla", ["train.expert_exchange=padded"]),
    "ours-xla-ragged": ("ours", "xla", ["train.expert_exchange=ragged"]),
    "maxtext-dot": ("maxtext", "dot_product", []),
    "maxtext-splash": ("maxtext", "flash", []),
    "maxtext-cudnn": ("maxtext", "cudnn_flash_jax", []),  # GPU: cuDNN through jax.nn.dot_product_attention
    # MoE: the experts' receive buffers sized as ours (1.25x a fair share), not for the worst case (its dropless
    # default, the rows megablox's cost estimate counts); past them MaxText drops tokens, ours runs another round
    "maxtext-dot-buffer": ("maxtext", "dot_product", ["ragged_buffer_factor=1.25"]),
}
# Mixtures of experts: (bench/family_plans.py's family, MaxText's model_name; its dimensions)
MOE = {"qwen3_30b_a3b": ("qwen3-30b-a3b", dict(d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                                               vocab=151936, seq=4096, experts=128, top_k=8, expert_ffn=768))}
# Both sides' scatters kept on the TensorCore: the TPU cost model has no estimate for one offloaded to v5p's
# SparseCores (its estimated_cycles INT64_MAX: optimal_seconds overflows negative); MoE routing sorts with them.
MOE_FLAGS = {"xla_tpu_enable_offloading_scatter_to_sparsecore": False}
SHAPES = ("gpt_1b", "llama3_8b", *MOE)
MESHES = ("fsdp", "ep")
LAYERS = ("scanned", "unrolled")
FLAG_SETS = ("recommended", "none")
RNG_FLAG = "--xla_tpu_spmd_rng_bit_generator_unsafe=true"  # what MaxText's train_compile.main adds


def shape_spec(shape: str, chips: int, mesh: str = "fsdp", work: Path | None = None) -> dict:
    """Both frameworks' settings for one model shape on `chips` chips (fsdp, or expert parallelism for a mixture
    of experts, over all of them); `work` holds the config.json folder of a model planned from one."""
    if mesh != "fsdp" and shape not in MOE:
        raise SystemExit(f"--mesh {mesh} is for a mixture of experts ({', '.join(MOE)}), not {shape}")
    if shape == "gpt_1b":
        dims = dict(d_model=2048, n_layers=20, n_heads=16, n_kv_heads=16, head_dim=128, d_ff=5632, vocab=256,
                    seq=2048, batch=8)
        if dims["batch"] % chips:
            raise SystemExit(f"gpt_1b's batch of 8 does not split over {chips} chips")
        ours = ["configs/gpt_1b.yaml"]
        maxtext = [f"base_emb_dim={dims['d_model']}", f"base_num_decoder_layers={dims['n_layers']}",
                   f"base_num_query_heads={dims['n_heads']}", f"base_num_kv_heads={dims['n_kv_heads']}",
                   f"head_dim={dims['head_dim']}", f"base_mlp_dim={dims['d_ff']}", f"vocab_size={dims['vocab']}",
                   f"max_target_length={dims['seq']}", f"per_device_batch_size={dims['batch'] // chips}"]
    elif shape == "llama3_8b":
        dims = dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336, vocab=128256,
                    seq=8192, batch=chips)
        ours = ["configs/gpt_1b.yaml", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32",
                "model.n_kv_heads=8", "model.d_ff=14336", "model.vocab_size=128256", "model.max_len=8192",
                "model.rope_theta=500000", "model.norm_eps=1e-5", "data.seq_len=8192", f"data.batch_size={chips}"]
        maxtext = ["model_name=llama3-8b", "max_target_length=8192", "per_device_batch_size=1"]
    elif shape in MOE:
        import family_plans  # its config.json dicts (bench/ is this script's folder, first on sys.path)

        family, dims = MOE[shape]
        dims = {**dims, "batch": chips}
        if mesh == "ep" and dims["experts"] % chips:
            raise SystemExit(f"{family}'s {dims['experts']} experts do not split over {chips} chips")
        folder = family_plans.config_folder(family, family_plans.family_config(family)[1], work)
        ours = ["configs/gpt_1b.yaml", f"train.init_from={folder}", "model.routing=dropless",
                f"data.seq_len={dims['seq']}", f"data.batch_size={chips}"]
        maxtext = [f"model_name={family}", f"max_target_length={dims['seq']}", "per_device_batch_size=1",
                   "sparse_matmul=true", "megablox=true", "use_tokamax_gmm=false", "capacity_factor=-1.0"]
    else:
        raise SystemExit(f"unknown --shape {shape!r}: {', '.join(SHAPES)}")
    ours += [f"mesh={mesh}", "train.remat=full", "train.dtype=bfloat16"]
    maxtext += [f"ici_fsdp_parallelism={chips}"] if mesh == "fsdp" else [
        "ici_fsdp_parallelism=1", f"ici_expert_parallelism={chips}"]
    maxtext += ["remat_policy=full", "dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic",
                "enable_checkpointing=false", "enable_dropout=false"]
    return {"dims": dims, "ours": ours, "maxtext": maxtext, "flags": MOE_FLAGS if shape in MOE else {}}


# --------------------------------------------------------------------------------------------- setup

def python312(given: str | None) -> str:
    """A Python 3.12 interpreter that runs (a pyenv shim for a version not selected does not)."""
    pyenv = sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    candidates = [given] if given else [shutil.which("python3.12"), "/usr/bin/python3.12", *pyenv]
    for exe in filter(None, candidates):
        try:
            ok = subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                capture_output=True).returncode == 0
        except OSError:
            continue
        if ok:
            return exe
    raise SystemExit("no Python 3.12 found (maxtext needs it): give --python PATH; Debian 12 has no python3.12 "
                     "package, `pyenv install 3.12` builds one")


def setup(venv: Path, python: str | None) -> None:
    exe = python312(python)
    print(f"venv {venv} from {exe}")
    if not (venv / "bin" / "python").exists():
        subprocess.run([exe, "-m", "venv", str(venv)], check=True)
    here = []
    for name in SAME_AS_HERE:
        try:
            here.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: pip install -e '.[tpu]' first") from None
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
    subprocess.run([*pip, *here, *PACKAGES, MAXTEXT], check=True)
    check = subprocess.run([str(venv / "bin" / "python"), __file__, "--worker", "-"], input="{}", text=True,
                           capture_output=True)
    if check.returncode:
        raise SystemExit(f"the venv does not import maxtext's train_compile:\n{check.stderr[-3000:]}")
    print("maxtext's train_compile imports: ready")


# -------------------------------------------------------------------------------------------- worker

def worker(spec_path: str) -> None:
    """In the venv: MaxText's train_compile.main with `spec["argv"]`, its compiled step's figures and HLO
    written to spec["out"] (an empty spec: only check that it imports)."""
    spec = json.loads(sys.stdin.read() if spec_path == "-" else Path(spec_path).read_text())
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax.experimental.xla_metadata as xla_metadata

    if not hasattr(xla_metadata, "must_fuse_call"):  # jax >= 0.11; only MaxText's jax_flash_attention uses it
        def must_fuse_call(*args, **kwargs):
            raise NotImplementedError("jax.experimental.xla_metadata.must_fuse_call needs jax >= 0.11")
        xla_metadata.must_fuse_call = must_fuse_call
    from maxtext.trainers.pre_train import train_compile

    if not spec:
        return
    if spec.get("gpu"):
        # MaxText's GPU path compiles for jax.devices() (a real GPU, mocked as several processes); here there is
        # none, so it gets the same compile-only GPUs as ours: the CUDA plugin's, for our target's device facts.
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(platform="cuda", topology=spec["gpu"]["topology"],
                                               target_config=spec["gpu"]["target_config"]).devices
        train_compile.jax.devices = lambda *args, **kwargs: devices
    compiled = []
    jit_and_compile = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        compiled.append(jit_and_compile(*args, **kwargs))
        return compiled[-1]

    train_compile.jit_and_compile = keep
    start = time.time()
    train_compile.main(["train_compile", *spec["argv"]])
    seconds = time.time() - start
    step = compiled[-1]
    cost = step.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    mem = step.memory_analysis()
    out = Path(spec["out"])
    (out.parent / (out.stem + ".hlo.txt")).write_text(step.as_text())
    import jax

    out.write_text(json.dumps({
        "compile_s": seconds,
        "cost": {k: cost.get(k) for k in ("flops", "optimal_seconds", "bytes accessed", "transcendentals")},
        "memory": {k: getattr(mem, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                "alias_size_in_bytes", "temp_size_in_bytes",
                                                "generated_code_size_in_bytes")},
        "versions": {"jax": jax.__version__, "maxtext": importlib.metadata.version("maxtext"),
                     "libtpu" if not spec.get("gpu") else "jax-cuda12-plugin":
                         importlib.metadata.version("libtpu" if not spec.get("gpu") else "jax-cuda12-plugin")},
    }))


# ------------------------------------------------------------------------------------------- the cells

def run_logged(cmd: list[str], log: Path, env: dict, timeout_s: float) -> int:
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\ntimed out after {timeout_s:.0f} s\n")
            return 124


def tail(log: Path, lines: int = 3) -> str:
    text = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(text[-lines:])[-600:]


def our_cell(args, spec: dict, layers: str, flags: str, side: str, work: Path, env: dict) -> dict:
    _, attention, more = SIDES[side]
    name = f"{side}-{layers}-{flags}"
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [*spec["ours"], f"run.target={args.target}", f"train.attention={attention}",
                 f"train.scan_layers={'true' if layers == 'scanned' else 'false'}",
                 f"run.recommended_flags={'true' if flags == 'recommended' else 'false'}", *more, f"run.dir={run_dir}"]
    given = ", ".join(f"{k}: {str(v).lower()}" for k, v in spec["flags"].items())
    overrides += [f"run.compiler_flags={{{given}}}"] if given else []
    (text_file := work / f"{name}.hlo.txt").unlink(missing_ok=True)
    # train.py itself, its compiled step's HLO kept (our_worker) to be read as MaxText's is
    cmd = [sys.executable, str(Path(__file__).resolve()), "--ours-worker", str(text_file), *overrides, "--dry-run"]
    shown = "python " + " ".join(["train.py", *overrides, "--dry-run"])
    log = work / f"{name}.log"
    start = time.time()
    rc = run_logged(cmd, log, env, args.timeout_s)
    plans = sorted(run_dir.glob("plan*.json"))
    if rc or not plans:
        return {"error": f"exit {rc}: {tail(log)}", "command": shown}
    plan = json.loads(plans[0].read_text())
    c, mem = plan["compiler"], plan["memory_per_device"]
    read = {"step_s": c.get("step_s"), "raw_step_s": c.get("raw_step_s"), "loop_factor": c.get("loop_factor"),
            "kernel_s": c.get("kernel_s", 0.0), "kernel_calls": c.get("kernel_calls"),
            "flops": c.get("flops_per_device"), "raw_flops": c.get("raw_flops_per_device")}
    again = text_file.exists() and reading(text_file.read_text(), c.get("raw_step_s"), c.get("raw_flops_per_device"),
                                           spec["dims"], plan["devices"], plan["peak_tflops"] * 1e12)
    if again and again["grouped_kernel_calls"]:
        # The plan counts each grouped kernel's FLOPs by its own estimate, as this reading does, but scales their
        # time with the rest of the loop bodies': read as MaxText's is, each run at the cost model's kernel rates.
        read = {**again, "plan_step_s": c.get("step_s"), "plan_flops": c.get("flops_per_device")}
    return {"command": shown, "wall_s": time.time() - start, **read,
            "memory": mem["total"], "temp": mem["temp"], "arguments": mem["arguments"],
            "model_flops_per_device": plan["flops_per_device"], "peak_tflops": plan.get("peak_tflops"),
            "flags": plan.get("compiler_flags", {}), "flags_dropped": plan.get("compiler_flags_dropped", []),
            "collectives": {k: v["count"] for k, v in plan["collectives"].items() if v["count"]}}


def our_worker(text_file: str, argv: list[str]) -> None:
    """`python train.py ARGV` in this process, the HLO of the step its plan compiles written to text_file."""
    import runpy

    sys.path.insert(0, str(ROOT))
    from shard.plan import analysis

    figures = analysis.compiler_figures

    def keep(step, text, *rest, **kwargs):
        Path(text_file).write_text(text)
        return figures(step, text, *rest, **kwargs)

    analysis.compiler_figures = keep
    sys.argv = [str(ROOT / "train.py"), *argv]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def maxtext_cell(args, spec: dict, layers: str, flags: dict, side: str, work: Path, env: dict, tag: str) -> dict:
    from shard.plan import target as target_lib

    _, attention, more = SIDES[side]
    name = f"{side}-{layers}-{tag}" if more else f"maxtext-{attention}-{layers}-{tag}"
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    tgt = target_lib.parse(args.target)
    gpu = None
    if tgt.family == "gpu":  # MaxText names one GPU machine: a3, eight H100s
        if args.target != "h100x8":
            raise SystemExit(f"MaxText's GPU topologies here: a3 (run.target=h100x8), not {args.target}")
        gpu = {"topology": tgt.topology, "target_config": target_lib.gpu_target_config(tgt.facts)}
    argv = [*spec["maxtext"], f"compile_topology={'a3' if gpu else args.target}", "compile_topology_num_slices=1",
            f"attention={attention}", f"scan_layers={'true' if layers == 'scanned' else 'false'}", *more,
            f"run_name={name}", f"base_output_directory={work / 'maxtext-out'}"]
    written = " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flags.items())
    if flags and gpu:  # on GPUs MaxText takes XLA's flags from XLA_FLAGS (its compile_xla_flags are libtpu's)
        env = {**env, "XLA_FLAGS": (env.get("XLA_FLAGS", "") + " " + written).strip()}
    elif flags:
        argv.append("compile_xla_flags=" + written)
    spec_file = work / f"{name}.spec.json"
    spec_file.write_text(json.dumps({"argv": argv, "out": str(out), "gpu": gpu}))
    venv_python = str(args.venv / "bin" / "python")
    cmd = [venv_python, str(Path(__file__).resolve()), "--worker", str(spec_file)]
    log = work / f"{name}.log"
    start = time.time()
    rc = run_logged(cmd, log, env, args.timeout_s)
    shown = "python -m maxtext.trainers.pre_train.train_compile " + " ".join(
        f"'{a}'" if " " in a else a for a in argv)
    if rc or not out.exists():
        return {"error": f"exit {rc}: {tail(log)}", "command": shown}
    got = json.loads(out.read_text())
    text = (work / f"{name}.hlo.txt").read_text()
    n = tgt.chips_in_all()
    m = got["memory"]
    total = m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"] \
        + m["temp_size_in_bytes"]
    raw_s = got["cost"].get("optimal_seconds")
    return {"command": shown, "wall_s": time.time() - start, "compile_s": got["compile_s"],
            **reading(text, raw_s, got["cost"].get("flops"), spec["dims"], n,
                      target_lib.per_device(tgt, n)["tflops"] * 1e12),
            "memory": total, "temp": m["temp_size_in_bytes"], "arguments": m["argument_size_in_bytes"],
            "flags": flags, "versions": got["versions"]}


def reading(text: str, raw_s: float | None, raw_flops: float | None, dims: dict, n: int, peak: float) -> dict:
    """A compiled step's figures per chip, read as shard.plan.compiler_figures reads ours: the cost model's time
    scaled by the loops' trips (hlo.loop_scale), its FLOPs plus the loops' other iterations' matrix products, and
    attention's analytic FLOPs at peak where a kernel the cost model cannot see (splash) computes it. But a grouped
    matmul kernel (megablox's, tokamax's, XLA's own ragged-dot) carries a cost estimate, which the cost model counts
    once per loop body (time: KERNEL_RATES' roofline) and hlo.loop_scale's cycles leave out: its time is taken out
    of the scaled part and counted for every execution, its FLOPs likewise, nothing analytic added."""
    from shard.plan import hlo

    comps, entry = hlo.computations(text)
    runs, once = hlo.executions(comps, entry), hlo.executions(comps, entry, loops=False)
    s_all = s_once = 0
    for name, lines in comps.items():
        for line in lines:
            if 'custom_call_target="tpu_custom_call"' in line and GROUPED.search(line):
                f, b = map(int, ESTIMATE.search(line).groups()) if ESTIMATE.search(line) else (0, 0)
                t = max(f / KERNEL_RATES[0], b / KERNEL_RATES[1])
                s_all, s_once = s_all + t * runs.get(name, 0), s_once + t * once.get(name, 0)
    k = hlo.kernels(text)  # the grouped kernels' FLOPs by their own estimates, every run (as the plan counts them)
    grouped, flops_all = k.grouped, k.estimated_flops
    kernels = k.calls
    kernel_flops = attention_kernel_flops(dims, n) if k.attention_unestimated else 0.0
    kernel_s = kernel_flops / peak if kernel_flops else 0.0
    dots_once = hlo.dot_flops(text, loops=False, convolutions=True)
    extra = hlo.dot_flops(text, convolutions=True) - dots_once + k.estimated_flops - k.estimated_once
    scale, basis = hlo.loop_scale(text)
    raw_s = raw_s if raw_s and raw_s > 0 else None  # the cost model answers a negative time where it has none
    return {"step_s": (raw_s - s_once) * scale + s_all + kernel_s if raw_s else None, "raw_step_s": raw_s,
            "loop_factor": scale, "loop_basis": basis, "kernel_s": kernel_s, "kernel_calls": kernels,
            "grouped_kernel_calls": grouped, "grouped_estimate_flops": flops_all, "grouped_estimate_s": s_all,
            "flops": raw_flops + extra + kernel_flops if raw_flops else None, "raw_flops": raw_flops}


def attention_kernel_flops(dims: dict, n: int) -> float:
    """Attention's analytic FLOPs per chip where a kernel the cost model cannot see (splash) computes it: causal
    pairs, forward, backward (2x) and the forward again under full remat."""
    from shard.nn import attention as attention_lib

    q = (dims["batch"], dims["seq"], dims["n_heads"], dims["head_dim"])
    kv = (dims["batch"], dims["seq"], dims["n_kv_heads"], dims["head_dim"])
    return attention_lib.flops(q, kv, kv, True) * dims["n_layers"] * 4 / n


GROUPED = re.compile(r"ragged[-_]dot|gmm")  # XLA's and tokamax's ragged-dot, megablox's gmm/tgmm Pallas kernels
ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"')
# The time the v5p cost model (libtpu 0.0.42.1) gives a Pallas kernel's cost estimate, found by compiling kernels of
# given estimates: max(flops / 394e12, bytes / 2.35e12) seconds
KERNEL_RATES = (3.94e14, 2.35e12)


def cells(args) -> list[tuple[str, str, str]]:
    return [(layers, flags, side) for layers in args.layers for flags in args.flags for side in args.sides]


def load(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["layers"], r["flags_set"], r["side"])] = r
    return done


def measure(args) -> None:
    from shard.plan import target as target_lib

    tgt = target_lib.parse(args.target)
    work = args.out.parent / args.out.stem
    work.mkdir(parents=True, exist_ok=True)
    spec = shape_spec(args.shape, tgt.chips_in_all(), args.mesh, work)
    spec["flags"] = {} if tgt.family == "gpu" else spec["flags"]  # MOE_FLAGS are libtpu's
    env = {**os.environ, "LIBTPU_INIT_ARGS": (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + RNG_FLAG).strip(),
           "JAX_PLATFORMS": "cpu"}
    if any(s.startswith("maxtext") for s in args.sides) and not (args.venv / "bin" / "python").exists():
        raise SystemExit(f"no MaxText venv at {args.venv}: run python bench/anchor_compile.py --setup first")
    done = load(args.out)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or None  # ours as compiled: this tree's commit
    recommended = dict(target_lib.chips().get("flags", {}).get(tgt.family, {}))
    for layers, flags, side in cells(args):
        if (layers, flags, side) in done and not args.redo and "error" not in done[(layers, flags, side)]:
            continue
        framework = SIDES[side][0]
        print(f"compiling {side}, layers {layers}, flags {flags} ...", flush=True)
        if framework == "ours":
            r = our_cell(args, spec, layers, flags, side, work, env)
        else:
            # the flags ours compiled with (chips.yaml's, less any this compiler dropped), else chips.yaml's
            ours = [done.get((layers, flags, s)) for s in ("ours-xla", "ours-splash")]
            used = next((o["flags"] for o in ours if o and "flags" in o), None)
            given = {**((used if used is not None else recommended) if flags == "recommended" else {}),
                     **spec["flags"]}
            r = maxtext_cell(args, spec, layers, given, side, work, env, flags)
        r.update(layers=layers, flags_set=flags, side=side, shape=args.shape, target=args.target,
                 when=time.strftime("%Y-%m-%d %H:%M"), commit=commit)
        done[(layers, flags, side)] = r
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print("  " + (f"error: {r['error']}" if "error" in r else
                      f"{fmt_ms(r['step_s'])} ms, {fmt_f(r['flops'])} FLOPs, {fmt_gib(r['memory'])} GiB"), flush=True)


# -------------------------------------------------------------------------------------------- the table

def fmt_ms(s):
    return f"{s * 1e3:.1f}" if s else "-"


def fmt_f(x):
    return f"{x:.3g}" if x else "-"


def fmt_gib(b):
    return f"{b / 2**30:.2f}" if b else "-"


def table(args) -> str:
    done = load(args.out)
    sides = [s for s in SIDES if any(k[2] == s for k in done)]
    head = "| layers | flags | what | " + " | ".join(sides) + " |"
    lines = [head, "|" + "---|" * (3 + len(sides))]
    for layers in LAYERS:
        for flags in FLAG_SETS:
            row = [done.get((layers, flags, s)) for s in sides]
            if not any(row):
                continue
            for what, cell in (("compiler step ms", lambda r: fmt_ms(r["step_s"])),
                               ("of which kernel ms", lambda r: fmt_ms(r["kernel_s"]) if r["kernel_s"] else "0"),
                               ("of which grouped kernels' ms", lambda r: fmt_ms(r.get("grouped_estimate_s"))),
                               ("raw ms (loop x)", lambda r: f"{fmt_ms(r['raw_step_s'])} (x{r['loop_factor']:.2f})"
                                if r.get("raw_step_s") else "-"),
                               ("compiler FLOPs/chip", lambda r: fmt_f(r["flops"])),
                               ("of which grouped kernels' own", lambda r: fmt_f(r.get("grouped_estimate_flops"))),
                               ("memory GiB/chip", lambda r: fmt_gib(r["memory"])),
                               ("args + temp GiB", lambda r: f"{fmt_gib(r['arguments'])} + {fmt_gib(r['temp'])}")):
                vals = [("error" if "error" in r else cell(r)) if r else "" for r in row]
                if "grouped" in what and set(vals) <= {"-", "", "error"}:
                    continue
                lines.append(f"| {layers} | {flags} | {what} | " + " | ".join(vals) + " |")
    errors = [r for r in done.values() if "error" in r]
    lines += [f"{r['side']} {r['layers']} {r['flags_set']}: {r['error']}" for r in errors]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--ours-worker"]:
        our_worker(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setup", action="store_true", help="create the MaxText venv (pip from PyPI) and exit")
    p.add_argument("--python", help="the Python 3.12 interpreter for --setup")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--shape", default="gpt_1b", choices=SHAPES)
    p.add_argument("--mesh", default="fsdp", choices=MESHES, help="fsdp, or ep (experts split over every chip)")
    p.add_argument("--target", default="v5p-8")
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--flags", default=",".join(FLAG_SETS))
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--out", type=Path)
    p.add_argument("--redo", action="store_true", help="compile cells already in --out again")
    p.add_argument("--table", action="store_true", help="only print the table from --out")
    p.add_argument("--timeout-s", type=float, default=3600)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.setup:
        setup(args.venv, args.python)
        return 0
    sys.path.insert(0, str(ROOT))
    args.layers = [x for x in args.layers.split(",") if x]
    args.flags = [x for x in args.flags.split(",") if x]
    args.sides = [x for x in args.sides.split(",") if x]
    for given, allowed in ((args.layers, LAYERS), (args.flags, FLAG_SETS), (args.sides, tuple(SIDES))):
        bad = [x for x in given if x not in allowed]
        if bad:
            raise SystemExit(f"unknown {bad}: choose from {', '.join(allowed)}")
    name = f"{args.shape}-{args.target}" + ("" if args.mesh == "fsdp" else f"-{args.mesh}")
    args.out = (args.out or ROOT / "runs" / "anchor_compile" / f"{name}.jsonl").resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.table:
        measure(args)
    print(table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
