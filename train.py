"""Train a model: `python train.py [CONFIG.yaml] [key=value ...] [--print-config] [--dry-run] [--compare] [--help]`.

--dry-run compiles the step and reports its memory and communication (plan.json) without training (train.init_from
may then name a Hugging Face folder of config.json alone: shard/hf/config_only.py);
--compare does that for every mesh the devices and the model allow.

Parses the command line into one typed config and hands it to shard.run.trainer.run; that is all.
"""

import logging
import sys
from pathlib import Path

from shard import config
from shard.core import registry
from shard.errors import NonFiniteLoss, UserError, exit_from

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"
FLAGS = ("--help", "-h", "--print-config", "--dry-run", "--compare", "--write-config PATH")


def main(argv: list[str]) -> int:
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's progress chatter; our own lines say what happened
    argv, written = _write_config(argv)
    flags = [a for a in argv if a.startswith("-") and "=" not in a]
    for flag in flags:
        if flag not in FLAGS:
            raise UserError(f"unknown option {flag!r}; options are: {', '.join(FLAGS)}")
    args = [a for a in argv if a not in flags]
    path = DEFAULT_CONFIG
    if args and "=" not in args[0]:
        path, args = Path(args[0]), args[1:]
    planning = bool({"--dry-run", "--compare"} & set(flags))  # a plan reads a Hugging Face folder's config.json alone

    if "--help" in flags or "-h" in flags:
        import os
        import shutil

        # The values this config and these overrides resolve to; the built-in defaults if they do not load.
        # What is wrong with them follows the help as the usual one-line error (exit status 2).
        cfg, signature, problem = None, None, None
        source = config.shown_path(Path(path)) + (f" + {len(args)} override(s)" if args else "")
        try:
            cfg = config.load(path, args, planning=planning)
            signature = registry.arguments(registry.resolve(cfg.model.name))
        except UserError as e:
            problem = e
        if cfg is None:
            source = f"{source} did not load: the error follows"
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None  # piped: one line a key
        try:
            print(config.help_text(cfg, signature, source, width))
            sys.stdout.flush()
        except BrokenPipeError:  # `--help | head`: the reader has all it wants
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if problem is not None:
            raise problem
        return 0

    cfg = config.load(path, args, planning=planning)
    model_cls, kwargs = registry.load(cfg.model)
    if "--print-config" in flags:
        print(config.to_yaml(cfg, model_kwargs=registry.with_defaults(model_cls, kwargs)), end="")
        return 0

    from shard.run import distributed, trainer  # JAX's machinery only once the config is known to be good
    from shard.plan import analysis, meshes
    from shard.plan import target

    aimed = target.of(cfg.run)
    if aimed and not {"--dry-run", "--compare"} & set(flags):
        raise UserError(f"run.target={cfg.run.target} compiles for hardware that is not here: add --dry-run or "
                        "--compare (training needs the devices)")
    if written and cfg.mesh.preset != "auto":
        raise UserError("--write-config writes the mesh that mesh=auto chooses: add mesh=auto")
    devices = target.devices(aimed) if aimed else distributed.start(cfg.run, deterministic=cfg.train.deterministic)
    if aimed:
        target.check_mesh(cfg.mesh, aimed, len(devices))
    if "--compare" in flags:
        from shard.hf import config_only

        if note := config_only.note(cfg):
            print(note)
        rows = meshes.compare(cfg, devices, schedules=True)
        print(meshes.comparison_table(rows))
        for path in meshes.write_comparison(cfg.run.dir, rows):
            print(f"wrote {path}")
        return 0
    with distributed.exit_cleanly_if_a_peer_fails():
        if aimed and cfg.mesh.preset == "auto":  # the search: meshes, remat and microbatches, compiled for the target
            from shard.plan import search
            cfg = search.apply(cfg, devices)
        cfg = meshes.apply_auto(cfg, devices)  # mesh=auto: resolved here, once, for the dry run and training alike
        if written:
            print(f"wrote {meshes.write_config(cfg, written)}")
        if "--dry-run" in flags:
            result = analysis.analyse(cfg, devices)
            print(analysis.report(result))
            # a target's plan beside the local one, not over it (the same job, other hardware)
            name = f"plan-{cfg.run.target}.json" if cfg.run.target else "plan.json"
            print(f"wrote {analysis.write(cfg.run.dir, result, name)}")
        else:
            trainer.run(cfg, devices)  # joined above: the processes are started once
    return 0


def _write_config(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--write-config PATH` (or `--write-config=PATH`), and the PATH."""
    for i, a in enumerate(argv):
        if a == "--write-config":
            if i + 1 == len(argv) or argv[i + 1].startswith("-") or "=" in argv[i + 1]:
                raise UserError("--write-config needs a file name: --write-config PATH.yaml")
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if a.startswith("--write-config="):
            return argv[:i] + argv[i + 1:], a.split("=", 1)[1]
    return argv, None


if __name__ == "__main__":
    exit_from(main, sys.argv[1:], {UserError: 2, NonFiniteLoss: 1})
