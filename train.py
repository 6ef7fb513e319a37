"""Train a model: `python train.py [CONFIG.yaml] [key=value ...] [--print-config] [--dry-run] [--compare] [--help]`.

--dry-run compiles the step and reports its memory and communication (plan.json) without training;
--compare does that for every mesh the devices and the model allow.

Parses the command line into one typed config and hands it to shard.trainer.run; that is all.
"""

import logging
import sys
from pathlib import Path

from shard import config, registry
from shard.errors import NonFiniteLoss, UserError

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"
FLAGS = ("--help", "-h", "--print-config", "--dry-run", "--compare")


def main(argv: list[str]) -> int:
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's progress chatter; our own lines say what happened
    flags = [a for a in argv if a.startswith("-") and "=" not in a]
    for flag in flags:
        if flag not in FLAGS:
            raise UserError(f"unknown option {flag!r}; options are: {', '.join(FLAGS)}")
    args = [a for a in argv if a not in flags]
    path = DEFAULT_CONFIG
    if args and "=" not in args[0]:
        path, args = Path(args[0]), args[1:]

    if "--help" in flags or "-h" in flags:
        try:
            name = config.load(path, args).model.name
            signature = registry.arguments(registry.resolve(name))
        except UserError:
            name, signature = "", None
        print(config.help_text(signature, name))
        return 0

    cfg = config.load(path, args)
    model_cls = registry.resolve(cfg.model.name)
    registry.check_kwargs(model_cls, cfg.model.kwargs, cfg.model.name)
    if "--print-config" in flags:
        print(config.to_yaml(cfg, model_kwargs=registry.with_defaults(model_cls, cfg.model.kwargs)), end="")
        return 0

    from shard import distributed, trainer  # JAX's machinery only once the config is known to be good

    if "--dry-run" in flags or "--compare" in flags:
        from shard import plan

        devices = distributed.start(cfg.run, deterministic=cfg.train.deterministic)
        if "--compare" in flags:
            rows = plan.compare(cfg, devices)
            print(plan.comparison_table(rows))
            print(f"wrote {plan.write(cfg.run.dir, rows, 'compare.json')}")
        else:
            cfg = plan.apply_auto(cfg, devices)
            result = plan.analyse(cfg, devices)
            print(plan.report(result))
            print(f"wrote {plan.write(cfg.run.dir, result, 'plan.json')}")
        return 0

    with distributed.exit_cleanly_if_a_peer_fails():
        trainer.run(cfg)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
