"""lm-evaluation-harness's tasks during training (`train.lm_eval.*`): every `every` steps and at the end, the
model as eval sees it (a strategy's view: DiLoCo's anchor, EMA's average) is scored by lm_eval's simple_evaluate
through shard/use/lm_eval_model.py, on the training mesh, its parameters the state's own arrays (no second copy),
and each task's metrics are logged as `lm_eval/<task>/<metric>` (metrics.jsonl, TensorBoard).

`check` runs before the job is built (lm_eval installed, every task known: an unknown one is one line naming it)
and `check_task` once its data is known (a language model's), both before anything is written."""

import logging

from flax import nnx

from shard.core import state as state_lib
from shard.data import tokenizer as tokenizer_lib
from shard.errors import UserError

KEY = "train.lm_eval.tasks"


def wanted(cfg) -> bool:
    return bool(cfg.train.lm_eval.tasks)


def due(cfg, done: int) -> bool:
    """Whether step `done` (not the last: the end evaluates anyway) evaluates the tasks."""
    every = cfg.train.lm_eval.every
    return wanted(cfg) and bool(every) and done % every == 0 and done != cfg.train.steps


def check(cfg) -> None:
    """One line where the tasks cannot run: lm_eval missing, a task unknown."""
    if not wanted(cfg):
        return
    from shard.use import evaluate

    evaluate.lm_eval_module(KEY)
    evaluate.task_manager(list(cfg.train.lm_eval.tasks), cfg.train.lm_eval.include_path, KEY)


def check_task(cfg, task: str) -> None:
    """One line where the run's data is no language model's."""
    if wanted(cfg) and task != "lm":
        raise UserError(f"{KEY}: lm_eval's tasks score a language model; this run's task is {task}")


def run(cfg, job, state) -> dict[str, float]:
    """The tasks' metrics on `state`'s model: {lm_eval/<task>/<metric>: value}."""
    from shard.use import evaluate, generate

    settings = cfg.train.lm_eval
    view = job.model_view(state)  # e.g. the replicas' global view, the averaged weights
    model = nnx.merge(job.work.graphdef, state_lib.in_device_memory(view.params), view.rest)
    tok = tokenizer_lib.of_run(cfg.data)
    generator = generate.Generator(model, job.mesh, job.rules, cfg.train.dtype, window=cfg.data.seq_len)
    lm = evaluate.model_of(model, generator, tok, settings.batch_size)
    limit = settings.limit
    limit = int(limit) if limit is not None and limit >= 1 else limit
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    results = evaluate.evaluate(lm, list(settings.tasks), evaluate.task_manager(list(settings.tasks),
                                                                                 settings.include_path, KEY),
                                settings.num_fewshot, limit, bootstrap_iters=0)
    return evaluate.metrics(results)
