"""python -m shard.serve RUN|HF_FOLDER [--mesh PRESET] [--host 127.0.0.1] [--port 8000] [--slots 8]
                         [--max-queue 256] [--context N] [--name NAME] [--seed S] [--step N] [--trust-code]
                         [key=value ...]

Loads the run's newest checkpoint (or --step's), or a Hugging Face folder's model and tokenizer, compiles
every program a request can need (warm-up), then serves until
SIGTERM or Ctrl-C: it stops taking connections, finishes the running requests, and exits 0."""

import argparse
import logging
import signal
import sys

from shard import paths
from shard.errors import UserError

DEFAULT_CONTEXT = 1024  # for a model without a fixed context (an LSTM): the longest prompt + answer


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(f"{message}; usage: python -m shard.serve RUN [--mesh PRESET] [--host HOST] [--port PORT] "
                        "[--slots N] [--max-queue N] [--context N] [--name NAME] [--step N] [--trust-code] "
                        "[key=value ...]")


def main(argv: list[str]) -> int:
    from shard.use import load

    parser = _Parser(prog="python -m shard.serve", description=__doc__.split("\n\n")[1])
    parser.add_argument("run", metavar="RUN", help="run folder (or its checkpoints/ or a step folder), or a Hugging "
                        "Face folder")
    parser.add_argument("--mesh", help="mesh preset to lay the model over (all devices); default: one device")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--slots", type=int, default=8, help="sequences decoded together (the cache's rows)")
    parser.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot; past it, 503")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                        help="prompt + answer tokens, for a model without a fixed context (max_len)")
    parser.add_argument("--name", help="the model's name in requests and /v1/models (default: the run folder's)")
    parser.add_argument("--seed", type=int, default=0, help="of the sampling keys")
    load.add_loading_arguments(parser)
    args, overrides, whole_mesh = load.parse_loading(parser, argv)
    if args.slots < 1 or args.max_queue < 0 or args.context < 2:
        raise UserError(f"--slots {args.slots}, --max-queue {args.max_queue}, --context {args.context}: need at "
                        "least 1 slot, a queue of 0 or more, a context of 2 or more")
    if args.mesh:
        overrides, whole_mesh = [f"mesh={args.mesh}", *overrides], True
    handler = logging.StreamHandler()  # this server's lines (uvicorn keeps its own), not every library's
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("shard.serve").addHandler(handler)
    logging.getLogger("shard.serve").setLevel(logging.INFO)
    logging.getLogger("shard.serve").propagate = False  # a library may have given the root logger a handler too
    return serve(args, overrides, whole_mesh)


def serve(args, overrides, whole_mesh) -> int:
    import uvicorn

    from shard import hf
    from shard.serve import app, chat, engine, scheduler
    from shard.use import generate, load

    log = logging.getLogger("shard.serve")
    loaded = load.load(args.run, overrides, step=args.step, whole_mesh=whole_mesh, key="RUN",
                       trust_code=args.trust_code)
    folder = paths.resolve(args.run) if hf.is_folder(args.run) else paths.resolve(load.run_config(args.run, "RUN")).parent
    tok = load.load_tokenizer(args.run, key="RUN")
    generator = generate.Generator(loaded.model, loaded.mesh if whole_mesh else None, loaded.rules,
                                   loaded.cfg.train.dtype)
    if not generator.caches():
        raise UserError(f"model {loaded.cfg.model.name}: its attention or recurrence does not go through shard.hooks, "
                        "so it keeps no cache to serve from; python -m shard.generate still runs it")
    capacity = generator.context or args.context
    slots = engine.Engine(generator, args.slots, capacity, tok.vocab_size, seed=args.seed)
    log.info("warming up: prefill for prompts of up to %s tokens, and the step over %d slots", slots.buckets,
             args.slots)
    slots.warm_up()
    name = args.name or folder.name
    template = chat.Template(tok)
    queue = scheduler.Scheduler(slots, tok, args.max_queue)
    server = uvicorn.Server(uvicorn.Config(
        app.build(queue, tok, template, name, capacity),
        host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=None))
    log.info("serving %s (step %d, context %d, %d slots) on http://%s:%d", name, loaded.step, capacity, args.slots,
             args.host, args.port)
    # uvicorn stops on SIGTERM/SIGINT gracefully, then raises the signal again under the handler it found:
    # one that ignores it lets this process exit 0 after the graceful stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    log.info("stopped: %d requests served, %d recompiles after warm-up", queue.served, slots.recompiles)
    return 0


if __name__ == "__main__":
    from shard.errors import exit_from

    exit_from(main, sys.argv[1:])
