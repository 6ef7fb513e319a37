"""A trained model back from its run folder, on one device or straight into a mesh's shardings.

    model = shard.load_model("runs/default")                     # one device, the newest checkpoint
    model = shard.load_model("runs/default", mesh="tp")          # split as the tp preset says
    model = shard.load_model("runs/default", mesh={"tensor": 4}, step=600)
    model = shard.load_model("path/to/hf-folder", mesh="fsdp")   # a Hugging Face causal LM (shard/hf)
    tokenizer = shard.load_tokenizer("runs/default")              # text <-> the model's tokens

The model is built from the `config.yaml` the run wrote (its class and arguments), and each parameter is
read by Orbax straight into its place on the mesh, so a model too large for one device loads too.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from shard.run import checkpoint as ckpt_lib
from shard import config as config_lib
from shard.run import distributed
from shard import paths
from shard.nn import partition
from shard.core import registry
from shard.core import mesh as mesh_lib
from shard.core import state as state_lib
from shard.strategies import registry as strategies
from shard.errors import UserError

# What a loaded model takes from its run's config.yaml: the mesh and devices are the loader's.
RUN_SECTIONS = ("model", "data", "train", "optimizer")


@dataclass
class Loaded:
    model: nnx.Module     # parameters restored, sharded over `mesh`
    cfg: config_lib.Config
    mesh: jax.sharding.Mesh
    rules: dict
    step: int             # the checkpoint's step


def load_model(path: str, *, mesh: str | dict | None = None, step: int | None = None,
               trust_code: bool = False) -> nnx.Module:
    """The trained Flax NNX module of a run. `path`: the run folder, its `checkpoints/` folder or one step
    folder; `step`: that checkpoint (default: the newest, or the step folder's). `mesh`: a preset name, or a
    dict of mesh settings as in a config ({"tensor": 4}, {"preset": "fsdp"}), over all devices; None: one
    device. `trust_code`: import the model's module even where it is not one of the model library's (importing
    runs its code: only for runs you trust). Raises UserError (one line) for a path without a run or
    checkpoint, a checkpoint of another model, or an untrusted module."""
    if mesh is None:
        overrides = []
    elif isinstance(mesh, str):
        overrides = [f"mesh={mesh}"]
    elif isinstance(mesh, dict):
        overrides = [f"mesh.{k}={v}" for k, v in mesh.items()]
    else:
        raise UserError(f"mesh={mesh!r}: give a preset name, a dict of mesh settings such as {{'tensor': 4}}, or None")
    return load(path, overrides, step=step, whole_mesh=mesh is not None, trust_code=trust_code).model


def load_tokenizer(path: str, key: str = "path"):
    """The tokenizer a run's text went through (data.tokenizer; bytes for the text source), or a Hugging Face
    folder's own, with `encode(text) -> ids` (as transformers' tokenizer(text)), `prompt(text)` (the ids a
    model continues) and `decode(ids) -> text`. A folder without a tokenizer is one line naming what was
    looked for."""
    from shard import hf
    from shard.data import tokenizer

    if hf.is_folder(path):
        return tokenizer.load(path, key)
    config_path = run_config(path, key)
    data_cfg = config_lib.load(config_path, [], sections=RUN_SECTIONS).data
    return tokenizer.of_run(data_cfg, paths.resolve(config_path).parent)


def add_loading_arguments(parser) -> None:
    """The options every command line that loads a run takes (python -m shard.generate, shard.export, shard.serve)."""
    parser.add_argument("--step", type=int, metavar="N", help="checkpoint step (default: the newest)")
    parser.add_argument("--trust-code", action="store_true", help="import the run's model module even where it is "
                        "not one of the model library's (importing runs its code: only for runs you trust)")
    # declared so that the usage and --help show them (a default, or argparse requires one); parse_loading also
    # takes those argparse leaves over
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="the run's config changed "
                        "for loading; a mesh or device setting (mesh=tp run.cpu_devices=4) lays the model over all "
                        "devices")


def parse_loading(parser, argv: list[str]):
    """(args, key=value overrides, whole_mesh): anything else unknown is the parser's one-line error. A mesh or
    device setting among the overrides lays the model over all devices; without one, one device."""
    args, left = parser.parse_known_args(argv)
    # argparse fills `overrides` from the first run of positionals only and leaves later ones over: in order, both
    overrides = [*args.overrides, *left]
    bad = [a for a in overrides if a.startswith("-") or "=" not in a]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    return args, overrides, any(o.startswith(("mesh", "run.cpu_devices")) for o in overrides)


def run_config(path: str, key: str = "path") -> str:
    """The config.yaml of the run that `path` (a run, checkpoints or step folder) belongs to."""
    p = paths.resolve(path)
    if not p.exists():
        raise UserError(f"{key}={path!r} does not exist")
    for folder in (p, p.parent, p.parent.parent):
        if (folder / "config.yaml").is_file():
            return str(folder / "config.yaml")
    raise UserError(f"{key}={path!r}: no config.yaml in it or the two folders above it; give the run folder "
                    "that trained the model (it holds config.yaml and checkpoints/)")


def run_rules(config_path: str) -> dict:
    """The logical-axis rules a run trained with (its config.yaml's mesh.rules)."""
    saved = paths.yaml_load(paths.resolve(config_path).read_text()) or {}
    rules = (saved.get("mesh") or {}).get("rules") if isinstance(saved, dict) else None
    return rules if isinstance(rules, dict) else {}


def run_settings(path: str, overrides: list[str], key: str = "path") -> config_lib.Config:
    """The config a run (its config.yaml's model, data and train sections) or a Hugging Face folder stands for,
    with `overrides`."""
    from shard import hf

    if hf.is_folder(path):
        from shard.hf.read import Folder

        # config.json read here first, so that what is wrong with it is said of the argument the caller gave
        # (the config below reads it again as train.init_from)
        Folder(path, key).gpt_kwargs()
        return config_lib.load(None, [f"train.init_from={path}", *overrides])
    config_path = run_config(path, key)
    cfg = config_lib.load(config_path, overrides, sections=RUN_SECTIONS)
    cfg.mesh.rules = {**run_rules(config_path), **cfg.mesh.rules}
    return cfg


def load(path: str, overrides: list[str], step: int | None = None, whole_mesh: bool = True,
         key: str = "path", trust_code: bool = False) -> Loaded:
    """The run's model, with its config's model, data and train sections plus `overrides` (key=value, e.g.
    the mesh and devices), restored over the devices (all of them, or with `whole_mesh=False` the first).
    The run's `mesh.rules` come along (a model may need a rule for a logical name of its own), under the
    loader's mesh's rules; its axis sizes do not. A Hugging Face folder: its model (shard/hf), step 0."""
    from shard import hf

    cfg = run_settings(path, overrides, key)
    model_cls, kwargs = registry.load(cfg.model, trusted=trust_code, source=f"{key}={path!r} (its config.yaml)")
    devices = distributed.start(cfg.run)
    devices = devices if whole_mesh else devices[:1]
    mesh = mesh_lib.build_mesh(cfg.mesh, devices)
    rules = partition.merged_rules(cfg.mesh.rules, mesh.axis_names)
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: state_lib.build_model(model_cls, kwargs, cfg.train.seed)),
                                       nnx.Param, ...)
    abstract = state_lib.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, rest=rest, opt_state=None)
    shardings = state_lib.state_shardings(abstract, mesh, rules, state_lib.auto_min_size(cfg.mesh))
    target = ckpt_lib.abstract_target(abstract, shardings)
    if hf.is_folder(path):
        from shard.hf.read import Folder, load_params

        if jax.tree.leaves(rest):  # what no folder holds (a layer's own settings): built, the weights' init dropped
            rest = jax.jit(lambda: nnx.split(state_lib.build_model(model_cls, kwargs, cfg.train.seed),
                                             nnx.Param, ...)[2],
                           out_shardings=shardings.rest)()
        # (and what one does: a router's correction bias)
        params, rest = load_params(Folder(path, key), target.params, cfg.model.kwargs, rest)
        return Loaded(nnx.merge(graphdef, params, rest), cfg, mesh, rules, 0)
    # A strategy that keeps the model elsewhere says where (DiLoCo's anchor, the weights' average); else the
    # checkpoint's own weights.
    folder, at = ckpt_lib.open_named(path, key, step)
    got = next((g for cls in strategies.ALL if (g := cls.read_model(cfg, folder, at, target))), None)
    restored, meta = got or ckpt_lib.restore_path(path, key, target, model_only=True, step=at)
    return Loaded(nnx.merge(graphdef, restored.params, restored.rest), cfg, mesh, rules, int(meta["step"]))
