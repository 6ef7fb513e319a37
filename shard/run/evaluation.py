"""Evaluation: the eval split (all of it, or batches spread over it) through the compiled eval step, its sums
fetched once and turned into metrics by the objective (lm's loss, accuracy, R^2, bits per byte; DPO's margins),
per source for a mixture."""

import contextlib
import math

import jax

from shard import data as data_lib
from shard.run import distributed


def prefetch_depth(cfg, devices) -> int:
    """data.prefetch, or by default 2 on accelerators and 0 on CPU: there JAX's asynchronous dispatch
    already reads the next batch while the step runs, and a thread would compete with XLA's."""
    if cfg.data.prefetch is not None:
        return cfg.data.prefetch
    return 0 if devices[0].platform == "cpu" else 2


def evaluate(eval_step, state, data: data_lib.Data, shardings: dict, cfg, objective) -> dict:
    """Each eval metric over the eval split: all of it (`train.eval_batches=0`), or that many batches
    spread evenly over it, from the eval step's sums as `objective` (shard/objectives/) reads them. A mixture
    (`data.eval_parts`) is evaluated source by source: each source's metrics under `<metric>/<label>`, and the
    overall ones from all their sums together."""
    if not data.eval_parts:
        return objective.eval_metrics(eval_totals(eval_step, state, data.eval, data, shardings, cfg))
    parts = {name: eval_totals(eval_step, state, batches, data, shardings, cfg)
             for name, batches in data.eval_parts.items()}
    overall = {k: math.fsum(t[k] for t in parts.values()) for k in next(iter(parts.values()))}
    metrics = objective.eval_metrics(overall)
    for name, totals in parts.items():
        metrics.update({f"{k}/{name}": v for k, v in objective.eval_metrics(totals).items()})
    return metrics


def eval_totals(eval_step, state, eval_batches, data: data_lib.Data, shardings: dict, cfg) -> dict:
    """The eval step's sums over (a selection of) `eval_batches`. Each batch's sums stay on the devices until
    the last batch has run, then one fetch brings them all (no host transfer per batch), added up on the
    host in float64. As in the train loop, at most one batch waits behind the running one: a deep queue of
    programs with collectives deadlocks on CPU (gloo) across processes, and the device never idles with one queued."""
    batches = eval_selection(eval_batches, cfg.train.eval_batches)
    feed = data_lib.device_batches(batches, shardings, start=0, prefetch=min(2, prefetch_depth(cfg, jax.devices())),
                                   batch_size=data.batch_size)
    sums: list = []
    with contextlib.closing(feed):
        for _ in range(len(batches)):
            sums.append(distributed.finished(eval_step(state, next(feed))))
            if len(sums) > 1:
                jax.block_until_ready(sums[-2])
    return {k: math.fsum(float(s[k]) for s in jax.device_get(sums)) for k in sums[0]}


class eval_selection:
    """The eval batches an evaluation reads: every one (n=0, or n >= their number), else n of them
    spread evenly over the split (the middle batch of each of n equal parts), so that a partial eval
    samples the whole held-out text rather than its first files."""

    def __init__(self, batches, n: int):
        total = len(batches)
        self.batches = batches
        self.indices = range(total) if n == 0 or n >= total else [(2 * i + 1) * total // (2 * n) for i in range(n)]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.batches[self.indices[i]]
