"""A trained run (or a Hugging Face folder) scored on EleutherAI's lm-evaluation-harness tasks:

    python -m shard.eval RUN_OR_FOLDER --tasks T1,T2 [--include_path DIR] [--num_fewshot K] [--limit N]
                         [--batch_size B] [--log_samples] [--output_path P] [--gen_kwargs K=V,...]
                         [--apply_chat_template] [--seed S] [--bootstrap_iters N] [--step N] [--trust-code]
                         [key=value ...]

lm_eval's own `simple_evaluate` runs the tasks with the run's model as its model (shard/use/lm_eval_model.py:
loglikelihood, loglikelihood_rolling and generate_until, `--batch_size` sequences a pass); the flags are lm_eval's,
and the results (and with --log_samples each task's samples) are written under --output_path as lm_eval writes
them, the table printed as it prints it. Mesh and device overrides (`mesh=fsdp run.cpu_devices=8`) lay the model
over all devices, for a model too large for one device; otherwise one device. Needs the `eval` extra
(pip install -e '.[eval]').
"""

import functools
import logging
from pathlib import Path

from shard.cli import Parser
from shard.errors import UserError, first_line

INSTALL = "pip install -e '.[eval]'"


def lm_eval_module(what: str = "python -m shard.eval"):
    """lm_eval, or one line saying how to install it."""
    try:
        import lm_eval
        from shard.use import lm_eval_model  # noqa: F401  (its import of lm_eval's internals, checked here)
    except ImportError as e:
        raise UserError(f"{what} needs lm-evaluation-harness (lm_eval), which is not installed or failed to import "
                        f"({first_line(e, 200)}): {INSTALL}") from None
    return lm_eval


@functools.cache
def _manager(include_path: str | None):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def task_manager(tasks: list[str], include_path: str | None, key: str = "--tasks"):
    """lm_eval's TaskManager (with `include_path`'s YAML tasks), every task in `tasks` checked to exist. Indexing
    lm_eval's own thousands of task files takes seconds: one manager a folder serves a process (training's
    evaluations)."""
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include_path {include_path}: not a folder of task YAML files")
    manager = _manager(None if include_path is None else str(Path(include_path).absolute()))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"{key}: unknown task{'s' * (len(unknown) > 1)} {', '.join(unknown)} (lm_eval's own tasks "
                        f"and --include_path's are known; list them with `lm_eval ls tasks`)")
    return manager


def model_of(model, generator, tokenizer, batch_size: int):
    """The lm_eval model over a run's model (`generator` runs it) and tokenizer."""
    from shard.use import generate, lm_eval_model

    vocab = min(tokenizer.vocab_size, generate.output_vocab(model))
    return lm_eval_model.ShardLM(generator, tokenizer, vocab, batch_size=batch_size)


def evaluate(lm, tasks: list[str], manager, num_fewshot: int | None = None, limit: float | None = None,
             log_samples: bool = False, tracker=None, seed: int | None = None, bootstrap_iters: int = 100000,
             gen_kwargs: str | None = None, apply_chat_template: bool = False) -> dict:
    """lm_eval's simple_evaluate of `lm` on `tasks`; a task lm_eval cannot build or run is one line. `seed`: all
    four of lm_eval's seeds (as its --seed N), None its defaults (0, 1234, 1234, 1234)."""
    from lm_eval import simple_evaluate

    seeds = {} if seed is None else {k: seed for k in ("random_seed", "numpy_random_seed", "torch_random_seed",
                                                        "fewshot_random_seed")}
    try:
        return simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, log_samples=log_samples,
                               evaluation_tracker=tracker, task_manager=manager, **seeds,
                               bootstrap_iters=bootstrap_iters, gen_kwargs=gen_kwargs,
                               apply_chat_template=apply_chat_template)
    except UserError:
        raise
    except Exception as e:  # a task's dataset that cannot be read, a template that fails: lm_eval's own words
        raise UserError(f"lm_eval failed on --tasks {','.join(tasks)}: {type(e).__name__}: {first_line(e, 300)}") \
            from None


def main(argv: list[str]) -> int:
    from shard.use import generate, load

    parser = Parser(prog="python -m shard.eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", metavar="RUN_OR_FOLDER", help="run folder (or its checkpoints/ or a step folder), or "
                        "a Hugging Face folder")
    parser.add_argument("--tasks", required=True, metavar="T1,T2", help="lm_eval task names, comma-separated")
    parser.add_argument("--include_path", metavar="DIR", help="a folder of task YAML files of your own")
    parser.add_argument("--num_fewshot", type=int, metavar="K", help="examples in each prompt (default: the task's)")
    parser.add_argument("--limit", type=float, metavar="N", help="the first N documents of each task (below 1: that "
                        "fraction)")
    parser.add_argument("--batch_size", type=int, default=1, metavar="B", help="sequences scored or generated a pass")
    parser.add_argument("--log_samples", action="store_true", help="write each document's requests and answers")
    parser.add_argument("--output_path", metavar="P", help="where results (and samples) are written, as lm_eval "
                        "writes them")
    parser.add_argument("--gen_kwargs", metavar="K=V,...", help="generation settings over the tasks' own "
                        "(max_gen_toks, until, temperature, do_sample, top_k, top_p)")
    parser.add_argument("--apply_chat_template", action="store_true", help="each prompt as a conversation through "
                        "the tokenizer's chat template (few-shot examples as turns)")
    parser.add_argument("--seed", type=int, help="lm_eval's four seeds (few-shot sampling among them; default: "
                        "its own, 0, 1234, 1234, 1234)")
    parser.add_argument("--bootstrap_iters", type=int, default=100000, metavar="N",
                        help="resamples for the standard errors lm_eval bootstraps (0: none)")
    load.add_loading_arguments(parser)
    args, overrides, whole_mesh = load.parse_loading(parser, argv)
    tasks = [t for t in (args.tasks or "").split(",") if t]
    if not tasks:
        raise UserError("--tasks: give at least one task name")
    if args.batch_size < 1:
        raise UserError(f"--batch_size {args.batch_size}: must be at least 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num_fewshot {args.num_fewshot}: must be 0 or more")
    if args.limit is not None and not args.limit > 0:
        raise UserError(f"--limit {args.limit:g}: must be more than 0")
    if args.log_samples and not args.output_path:
        raise UserError("--log_samples needs --output_path (where the samples are written)")
    lm_eval_module()
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = task_manager(tasks, args.include_path)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    loaded = load.load(args.run, overrides, step=args.step, whole_mesh=whole_mesh, key="RUN",
                       trust_code=args.trust_code)
    tok = load.load_tokenizer(args.run, key="RUN")
    generator = generate.Generator(loaded.model, loaded.mesh if whole_mesh else None, loaded.rules,
                                   loaded.cfg.train.dtype)
    tracker = None
    if args.output_path:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=args.output_path)
    lm = model_of(loaded.model, generator, tok, args.batch_size)
    results = evaluate(lm, tasks, manager, args.num_fewshot, limit, args.log_samples, tracker, args.seed,
                       args.bootstrap_iters, args.gen_kwargs, args.apply_chat_template)
    from lm_eval.utils import make_table

    samples = results.pop("samples", None)
    if tracker is not None:  # under --output_path, a folder named after the run, as lm_eval names the hf model's
        from lm_eval.utils import sanitize_model_name

        general = tracker.general_config_tracker
        general.model_name = str(args.run)
        general.model_name_sanitized = sanitize_model_name(general.model_name)
        tracker.save_results_aggregated(results=results, samples=samples if args.log_samples else None)
        if args.log_samples:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    print(f"shard ({args.run}, step {loaded.step}), limit: {args.limit}, num_fewshot: {args.num_fewshot}, "
          f"batch_size: {args.batch_size}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


def metrics(results: dict) -> dict[str, float]:
    """`lm_eval/<task>/<metric>` -> value for each task's numeric metrics (lm_eval's "acc,none" named "acc")."""
    out = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            name, _, kind = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "alias":
                out[f"lm_eval/{task}/{name}" + (f"_{kind}" if kind not in ("", "none") else "")] = float(value)
    return out

