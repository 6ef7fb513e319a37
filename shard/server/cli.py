"""python -m shard.serve RUN|HF_FOLDER [--mesh PRESET] [--host 127.0.0.1] [--port 8000] [--slots 8]
                         [--max-queue 256] [--context N] [--prefill-chunk 512] [--burst 8] [--max-body BYTES]
                         [--name NAME] [--seed S] [--step N] [--trust-code] [--quantize int8|int4] [key=value ...]

Loads the run's newest checkpoint (or --step's), or a Hugging Face folder's model and tokenizer, sizes the
cache (--context, by default the model's positions, capped so that every slot's cache fits the device's
memory: run.device_memory_gb, the runtime's figure, or a CPU's RAM), compiles every program a request can
need (warm-up), then serves until SIGTERM or Ctrl-C: it stops taking connections, finishes the running
requests, and exits 0."""

import functools
import logging
import os
import signal

from shard import paths
from shard.cli import Parser
from shard.errors import UserError

DEFAULT_CONTEXT = 1024  # for a model without a fixed context (an LSTM): the longest prompt + answer
MEMORY_SHARE = 0.85     # of a device's memory, for the weights and the cache (the rest: the programs' work)
SMALLEST_CONTEXT = 16


def main(argv: list[str]) -> int:
    from shard.quant import serving
    from shard.use import load

    parser = Parser(prog="python -m shard.serve", description=__doc__.split("\n\n")[1])
    parser.add_argument("run", metavar="RUN", help="run folder (or its checkpoints/ or a step folder), or a Hugging "
                        "Face folder")
    parser.add_argument("--mesh", metavar="PRESET",
                        help="mesh preset to lay the model over (all devices); default: one device")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--slots", type=int, default=8, metavar="N", help="sequences decoded together (the cache's "
                        "rows)")
    parser.add_argument("--max-queue", type=int, default=256, metavar="N",
                        help="requests waiting for a slot; past it, 503")
    parser.add_argument("--context", type=int, metavar="N", help="prompt + answer tokens each slot holds (default: the "
                        f"model's positions, capped to the device's memory; {DEFAULT_CONTEXT} for a model without a "
                        "limit)")
    parser.add_argument("--prefill-chunk", type=int, default=512, metavar="N", help="prompt tokens per prefill call")
    parser.add_argument("--burst", type=int, default=8, metavar="N", help="tokens per step call while no request waits")
    parser.add_argument("--max-body", type=int, default=8 * 2**20, metavar="BYTES",
                        help="bytes of a request body (past it, 413)")
    parser.add_argument("--name", help="the model's name in requests and /v1/models (default: the run folder's)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="of the sampling keys")
    load.add_loading_arguments(parser)
    serving.add_argument(parser)
    args, overrides, whole_mesh = load.parse_loading(parser, argv)
    for flag, value, least in (("--slots", args.slots, 1), ("--max-queue", args.max_queue, 1),
                               ("--context", args.context, 2), ("--prefill-chunk", args.prefill_chunk, 8),
                               ("--burst", args.burst, 1), ("--max-body", args.max_body, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} {value}: must be at least {least}")
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
    from shard.quant import serving
    from shard.server import app, chat, engine, scheduler
    from shard.use import generate, load

    log = logging.getLogger("shard.serve")
    loaded = load.load(args.run, overrides, step=args.step, whole_mesh=whole_mesh, key="RUN",
                       trust_code=args.trust_code)
    folder = (paths.resolve(args.run) if hf.is_folder(args.run)
              else paths.resolve(load.run_config(args.run, "RUN")).parent)
    tok = load.load_tokenizer(args.run, key="RUN")
    generator = serving.quantize_generator(generate.Generator(loaded.model, loaded.mesh if whole_mesh else None,
                                                              loaded.rules, loaded.cfg.train.dtype), args.quantize)
    if not generator.caches():
        raise UserError(f"model {loaded.cfg.model.name}: its attention or recurrence does not go through "
                        "shard.nn.hooks, so it keeps no cache to serve from; python -m shard.generate still runs it")
    # one engine per context: sizing builds the one at the wanted context, served as it is where it fits
    embedded = min(tok.vocab_size, generate.output_vocab(loaded.model))  # gemma-3: 2 tokens past its embedding
    build = functools.cache(lambda context: engine.Engine(generator, args.slots, context, embedded,
                                                          seed=args.seed, chunk=args.prefill_chunk, burst=args.burst))
    context = sized_context(args, generator, build, loaded.cfg.run, log)
    check_refill(generator, context)
    slots = build(context)
    log.info("cache: %s per device (%d slots x %d positions), allocated", _size(slots.allocate()), args.slots, context)
    log.info("warming up: %d programs (prefill chunks of up to %d tokens in buckets %s; steps of up to %d tokens "
             "over %s rows; views %s)", slots.programs(), slots.chunk, slots.buckets, slots.burst, slots.row_buckets,
             slots.views)
    slots.warm_up()
    name = args.name or folder.name
    template = chat.Template(tok)
    queue = scheduler.Scheduler(slots, tok, args.max_queue, ends=generate.stop_ids(tok))
    server = uvicorn.Server(uvicorn.Config(
        app.build(queue, tok, template, name, context, args.max_body, embedded),
        host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=None))
    log.info("serving %s (step %d, context %d, %d slots, end tokens %s) on http://%s:%d", name, loaded.step, context,
             args.slots, sorted(queue.ends), args.host, args.port)
    # uvicorn stops on SIGTERM/SIGINT gracefully, then raises the signal again under the handler it found:
    # one that ignores it lets this process exit 0 after the graceful stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    log.info("stopped: %d requests served, %d recompiles after warm-up", queue.served, slots.recompiles)
    return 0


def check_refill(generator, context: int) -> None:
    """One line where a slot could pass the positions after which the model's cache is to be computed again
    (LongRoPE's long factors): python -m shard.generate does that, as transformers does; the server's slots keep
    theirs."""
    if generator.refill_at is not None and context > generator.refill_at:
        raise UserError(f"--context {context}: this model's LongRoPE (Phi-3's) turns to its long factors once a "
                        f"sequence passes {generator.refill_at} positions, and transformers then recomputes that "
                        "sequence's cache, which the server's slots do not; serve with --context at most "
                        f"{generator.refill_at} (python -m shard.generate recomputes as transformers does)")


def sized_context(args, generator, build, run_cfg, log) -> int:
    """The positions each slot holds: --context, else the model's (a default for a model without a limit),
    capped so that the weights and every slot's cache fit the device's memory. Refused (one line) where the
    asked context passes the model's positions or its cache cannot fit; all by arithmetic, before anything is
    compiled or allocated."""
    import jax
    import jax.numpy as jnp

    from shard.core import state as state_lib
    from shard.plan import hardware

    limit = generator.context
    if args.context is not None and limit is not None and args.context > limit:
        raise UserError(f"--context {args.context}: the model's positions end at {limit}; give at most {limit}")
    wanted = args.context or limit or DEFAULT_CONTEXT
    probe = build(wanted)  # its chunk, vocabulary and row counts (its shapes are traced, nothing compiled)
    # exact at the asked context; a layer's ring stops growing at its window, so the line through it and twice it
    # overestimates every smaller context (a cap)
    small, large = probe.cache_bytes(wanted), probe.cache_bytes(2 * wanted)
    per_position = (large - small) / wanted
    fixed = small - per_position * wanted
    need = lambda context: int(fixed + per_position * context)
    device = generator.mesh.devices.flat[0] if generator.mesh is not None else jax.devices()[0]
    memory = hardware.memory_bytes(device, run_cfg.device_memory_gb) or _ram(device)
    if memory is None:
        log.info("cache: %s per device for %d positions (the device's memory is not known: not checked)",
                 _size(need(wanted)), wanted)
        return wanted
    weights = state_lib.shard_bytes(generator.state)
    # the programs' own work: the weights cast to the compute dtype, a prefill chunk's logits, the copies of
    # the cache a step over a few rows or a long prompt's chunk makes (Engine.working_share)
    cast = state_lib.shard_bytes([jax.ShapeDtypeStruct(leaf.shape, generator.dtype, sharding=leaf.sharding)
                                  for leaf in jax.tree.leaves(generator.state)
                                  if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != generator.dtype])
    logits = probe.chunk * probe.vocab * 4
    share = 1 + probe.working_share()
    room = int(MEMORY_SHARE * memory) - weights - cast - logits
    fits = int((room / share - fixed) // per_position) if per_position else wanted
    said = (f"{args.slots} slots x {wanted} positions need {_size(need(wanted))} of cache per device, and "
            f"{probe.working_share():.0%} more for the programs' copies of it; with the weights' {_size(weights)}"
            + (f", their {_size(cast)} cast to {generator.dtype.name}" if cast else "")
            + f" and a prefill's {_size(logits)} of logits, {MEMORY_SHARE:.0%} of the device's {_size(memory)} "
            f"leaves {_size(max(room, 0))}")
    if fits >= wanted:
        log.info("cache: %s", said)
        return wanted
    if args.context is not None or fits < SMALLEST_CONTEXT:
        hint = (f"give --context {fits} or less, or fewer --slots" if fits >= SMALLEST_CONTEXT else
                "give fewer --slots, or lay the model over more devices (--mesh)")
        raise UserError(f"the cache cannot fit: {said}; {hint} (run.device_memory_gb sets the device's memory)")
    log.info("context capped at %d (the model's is %d): %s; --context sets it", fits, wanted, said)
    return fits


def _ram(device) -> int | None:
    """A CPU device's memory is the machine's."""
    if device.platform != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024

