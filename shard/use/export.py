"""A trained model's forward pass as an ONNX file, for other runtimes, or a GPT as a Hugging Face folder:

    python -m shard.export RUN --format onnx [--out FILE.onnx] [--batch B] [--step N] [--trust-code] [key=value ...]
    python -m shard.export RUN --format hf --out FOLDER [--step N] [key=value ...]
    python -m shard.export RUN --adapters-only --out FOLDER [--step N] [key=value ...]

The converter is jax2onnx. The stack of layers is written out layer by layer (the converter does not take
Flax's scan), the batch dimension is symbolic unless --batch fixes it, and the computation is float32
whatever dtype the run trained in. The file is then checked: onnxruntime runs it on a batch of the run's own
held-out data (random byte tokens for a language model whose data is not here), and its outputs must equal
the JAX model's within 1e-4 (relative to their largest value), or the export fails and nothing is written.
Mesh and device overrides (`mesh=fsdp run.cpu_devices=8`) load the checkpoint sharded, each parameter
straight into its place, for a model too large for one device's memory; otherwise one device.

Models of the library that convert: mlp, cnn, gpt (both position kinds, every norm and MLP option), vit,
lstm and moe. A model using an operation jax2onnx has no converter for fails in one line naming it.

--format hf writes config.json, generation_config.json, safetensors shards and the run's tokenizer into a new
folder (its missing parents made) that transformers' AutoModelForCausalLM.from_pretrained reads, for a gpt whose
options are one of Llama, Qwen2, Gemma or GPT-2 (shard/hf/arch.py); the parameters come to the host one at a
time (shard/hf/write.py). A run started from a Hugging Face folder (train.init_from) is written in that folder's
dtype, with its special token ids and generation_config.json; any other in its parameters' dtype (float32).
A LoRA run (train.lora.rank > 0) exports its merged weights (W + alpha/r A B) in either format;
--adapters-only writes the adapters alone in the layout Hugging Face's peft loads (shard/hf/peft.py).
"""

import contextlib
import importlib
import os
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shard.nn import hooks
from shard.cli import Parser
from shard.errors import UserError, first_line

TOLERANCE = 1e-4
FORMATS = ("onnx", "hf")


def forward_fn(model: nnx.Module):
    """The model's inference forward pass as a function of its inputs alone (parameters are constants)."""
    graphdef, state = nnx.split(model)

    def forward(inputs):
        one = nnx.merge(graphdef, state, copy=True)
        one.eval()
        with hooks.use(unroll=True):
            return one(inputs)

    return forward


def to_onnx(model: nnx.Module, example: np.ndarray, out: str, batch: int | None, name: str) -> None:
    """Convert with jax2onnx into `out`; an operation it cannot convert is one UserError naming it."""
    convert = needed("jax2onnx").to_onnx

    first = jax.export.symbolic_shape("B")[0] if batch is None else batch
    spec = jax.ShapeDtypeStruct((first, *example.shape[1:]), example.dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the converter's use of APIs Flax is retiring
            convert(forward_fn(model), inputs=[spec], model_name=name, return_mode="file", output_path=out,
                    input_names=["inputs"], output_names=["outputs"])
    except Exception as e:  # the converter's own words name the operation it lacks
        raise UserError(f"model {name!r} does not convert to ONNX: {first_line(e, 300)}") from None


def check(path: str, model: nnx.Module, inputs: np.ndarray) -> float:
    """onnxruntime's outputs on `inputs` against the JAX model's: the largest difference relative to the
    largest output. Raises UserError past TOLERANCE."""
    onnxruntime = needed("onnxruntime")
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # errors only: its notes on unused constants are not the user's business
    try:
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: inputs})[0]
    except Exception as e:  # a graph the converter wrote but the runtime refuses
        raise UserError(f"onnxruntime cannot run the converted model, so nothing was written: "
                        f"{first_line(e, 300)}") from None
    want = np.asarray(jax.jit(forward_fn(model))(jnp.asarray(inputs)))
    if got.shape != want.shape:
        raise UserError(f"the ONNX model's outputs have shape {got.shape}, the JAX model's {want.shape}")
    error = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))
    if not error <= TOLERANCE:
        raise UserError(f"the ONNX model's outputs differ from the JAX model's by {error:.2e} (relative; allowed "
                        f"{TOLERANCE:g}); nothing was written")
    return error


def needed(module: str):
    """An export dependency, or one line saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"exporting needs {module}, which is not installed: pip install -e '.[export]'") from None


def example_batch(cfg, rows: int) -> np.ndarray:
    """`rows` inputs of the run's held-out data (the first eval batch, its rows repeated if it has fewer).
    Where that data is not here (a run folder copied to another machine), a language model's check runs on
    random byte tokens of its sequence length; other inputs' shapes are only known from their data."""
    from shard import data as data_lib

    try:
        inputs = np.asarray(data_lib.build(cfg.data, cfg.train.seed).eval[0]["inputs"])
    except (UserError, OSError) as e:
        if cfg.data.name != "text" and cfg.data.task != "lm":
            raise UserError(f"the check needs a batch of the run's data, and data.path={cfg.data.path!r} cannot be "
                            f"read here ({first_line(e, 200)}); give it with data.path=...") from None
        return np.random.default_rng(0).integers(0, 256, (rows, cfg.data.seq_len), dtype=np.int32)
    return inputs[np.arange(rows) % len(inputs)]


# ----------------------------------------------------------------------------- command line

def main(argv: list[str]) -> int:
    from shard.use import load

    parser = Parser(prog="python -m shard.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", metavar="RUN", help="run folder (or its checkpoints/ or a step folder)")
    parser.add_argument("--format", choices=FORMATS)
    parser.add_argument("--adapters-only", action="store_true",
                        help="a LoRA run's adapters alone, as PEFT's adapter_config.json and adapter_model.safetensors")
    parser.add_argument("--out", metavar="FILE.onnx|FOLDER",
                        help="file to write (default: <RUN>/model.onnx); --format hf: a new folder")
    parser.add_argument("--batch", type=int, metavar="B", help="a fixed batch size (default: symbolic)")
    load.add_loading_arguments(parser)
    args, overrides, whole_mesh = load.parse_loading(parser, argv)
    if args.adapters_only:
        from shard.hf import peft

        if args.format:
            raise UserError(f"--adapters-only with --format {args.format}: give one (the adapters alone, or the "
                            "merged model in that format)")
        print(peft.export(args.run, overrides, args.step, args.out, args.trust_code))
        return 0
    if not args.format:
        parser.error("the following arguments are required: --format (or --adapters-only)")
    if args.format == "hf":
        return export_hf(args, overrides, whole_mesh)
    if args.batch is not None and args.batch < 1:
        raise UserError(f"--batch {args.batch}: must be at least 1 (or leave it out for a symbolic batch)")
    out = Path(args.out or Path(load.run_config(args.run, "RUN")).parent / "model.onnx")
    if out.suffix != ".onnx":
        raise UserError(f"--out {out}: name a .onnx file")
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; name a .onnx file")
    from shard.hf.write import check_parents

    check_parents(out)
    loaded = load.load(args.run, overrides, step=args.step, whole_mesh=whole_mesh, key="RUN",
                       trust_code=args.trust_code)
    inputs = example_batch(loaded.cfg, args.batch or 3)  # 3: a batch no dimension of the model has
    start = time.perf_counter()
    # Written beside the target under its own name (large weights go to a sidecar file the model names), and
    # moved there once checked: an earlier export stays whole until then.
    with new_parents(out), tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
        written = Path(scratch) / out.name
        to_onnx(loaded.model, inputs, str(written), args.batch, loaded.cfg.model.name)
        error = check(str(written), loaded.model, inputs)
        for f in Path(scratch).iterdir():
            os.replace(f, out.parent / f.name)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, step {loaded.step} of {args.run}, batch "
          f"{args.batch or 'symbolic'}) in {time.perf_counter() - start:.1f} s; onnxruntime matches JAX on "
          f"{len(inputs)} held-out examples within {error:.1e}")
    return 0


def export_hf(args, overrides: list[str], whole_mesh: bool) -> int:
    from shard import hf
    from shard.hf import write
    from shard.hf.read import Folder
    from shard.use import load
    from shard.data.tokenizer import RUN_FOLDER

    if not args.out:
        raise UserError("--format hf needs --out FOLDER (a new or empty folder)")
    out = Path(args.out).expanduser().absolute()
    write.check_out(out)
    run_folder = Path(load.run_config(args.run, "RUN")).parent
    cfg = load.run_settings(args.run, overrides, "RUN")
    write.check_model(cfg.model.name, cfg.model.kwargs)  # before the (slow) read
    # The folder the run started from, where it is still here: its dtype and generation settings carry over.
    source = Folder(cfg.train.init_from) if hf.is_folder(cfg.train.init_from) else None
    loaded = load.load(args.run, overrides, step=args.step, whole_mesh=whole_mesh, key="RUN",
                       trust_code=args.trust_code)
    _, params, rest = nnx.split(loaded.model, nnx.Param, ...)
    start = time.perf_counter()
    with new_parents(out):
        files, size = write.write_folder(params, loaded.cfg.model.name, loaded.cfg.model.kwargs, out,
                                         run_folder / RUN_FOLDER, source=source, rest=rest)
    dtype = write.dtype_of(params, source)
    print(f"wrote {out} ({files} safetensors file{'s' * (files > 1)}, {size / 1e6:.1f} MB, {dtype}"
          f"{f' as in {source.path}' if source else ''}, step {loaded.step} of {args.run}) in "
          f"{time.perf_counter() - start:.1f} s")
    return 0


@contextlib.contextmanager
def new_parents(out: Path):
    """The folders above `out` that do not exist yet, made for the export and removed again if it fails."""
    made = [p for p in reversed(out.parents) if not p.exists()]
    for p in made:
        p.mkdir(exist_ok=True)
    try:
        yield
    except BaseException:
        for p in reversed(made):
            with contextlib.suppress(OSError):  # not empty: another process wrote there meanwhile
                p.rmdir()
        raise

