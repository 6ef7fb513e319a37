"""1F1B and interleaved 1F1B (`pipeline.schedule=1f1b`): each microbatch's backward starts as soon as its
forward has passed the last stage, in the same SPMD program as GPipe (shard/strategies/pipeline.py).

Autodiff of a forward scan cannot interleave backwards with later forwards, so this schedule owns the loss and
gradient of the whole step (`OneFOneB.value_and_grad` stands in for jax.value_and_grad of the objective), in
three parts, each a run of the objective with the stack's hook answering differently:
- before: the objective on the whole batch with the stack's input captured (its output unused, so XLA drops
  the head): the input x of every microbatch and the stacked layers' parameters, by one jax.vjp;
- the ticks: a scan over a static table (`Table`). At tick t stage s runs the forward of its visit k = t - s
  (microbatch, repeat) and the backward of visit j = t - (R S - 1) - (S - 1 - s), all stages at once (a vmap over
  the stage-split dimension, as GPipe); activations roll one stage on, cotangents one stage back. Each skips
  (a cond on the tick) where no stage has one. The microbatch whose forward leaves the last stage at tick t
  meets the rest of the objective there (the head and the loss, `head`: a jax.vjp on that microbatch alone,
  weighted 1/M as train.grad_accum weighs its microbatches), and its cotangent starts back at once;
- after: the vjp of `before`, given every microbatch's input cotangent and the stack's summed gradients.
A stage keeps what each visit it has run forward but not backward needs for its backward (the vjp's residuals
less the weights, which are the same every visit; train.remat decides the rest): the 2 R S - 1 slots of a
ring (in flight at stage s: 2 R (S - s) - 1) in place of GPipe's R M + S - 1 iterations; Megatron's stage 0
holds S, its sends overlapping work, where here a microbatch moves one stage a tick each way. The bubble is
GPipe's, (S-1)/(R M + S - 1): the first R S - 1 ticks run forwards only, the last R S - 1 backwards only,
every other tick both (a tick lasts as long as its slowest stage: all stages step together).

With R > 1 (Megatron's interleaved schedule) stage s holds groups s, s+S, ... as the circular schedule does
(`pipeline.Layout`), and visits go in rounds of S microbatches: visit k is microbatch (k // S R) S + k % S at
repeat (k % S R) // S, so a microbatch leaving stage S-1 enters stage 0 for its next repeat on the next tick.

Random streams: each stacked layer's counters advance visit by visit as GPipe's do; the rest of the model draws
once for the whole batch before the stack and once per microbatch after it. Variables the stack updates with
floats (batch statistics, recorded losses) and models with more than one stack are refused.
"""

import contextvars
import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import nnx

from shard.errors import UserError
from shard.nn import hooks, partition
from shard.strategies import pipeline

# How `stack` answers while this schedule traces the objective: a function (layers, x) -> output.
_STACK = contextvars.ContextVar("shard_1f1b_stack", default=None)


@dataclass(frozen=True)
class Table:
    """Which visit each stage runs forward and backward at each tick (arrays or ints alike)."""
    stages: int
    repeats: int
    microbatches: int

    @property
    def ticks(self) -> int:
        S, R = self.stages, self.repeats
        return self.microbatches * R + R * S + S - 2

    @property
    def slots(self) -> int:
        return 2 * self.repeats * self.stages - 1

    def visit(self, k):
        """Visit k's (microbatch, repeat)."""
        S, R = self.stages, self.repeats
        return (k // (S * R)) * S + k % S, (k % (S * R)) // S

    def forward(self, t, s):
        """(valid, microbatch, repeat, slot) of the forward stage s runs at tick t."""
        k = t - s
        valid = (k >= 0) & (k < self.microbatches * self.repeats)
        k = k % (self.microbatches * self.repeats)
        return (valid, *self.visit(k), k % self.slots)

    def backward(self, t, s):
        """(valid, microbatch, repeat, slot) of the backward stage s runs at tick t: repeats in reverse order."""
        S, R = self.stages, self.repeats
        j = t - (R * S - 1) - (S - 1 - s)
        valid = (j >= 0) & (j < self.microbatches * R)
        j = j % (self.microbatches * R)
        m, back = self.visit(j)
        k = j + (R - 1 - 2 * back) * S  # the forward visit of (m, R - 1 - back)
        return valid, m, R - 1 - back, k % self.slots


@dataclass(frozen=True)
class OneFOneB:
    """S stages, R groups each (1 = 1F1B, more = interleaved), M microbatches. In the model's hooks it runs the
    stack as GPipe's forward (evaluation); the train step differentiates through `value_and_grad`. `held`: what
    tracing found a stage holds (bytes of one slot), for the plan."""
    stages: int
    repeats: int
    microbatches: int
    stacked: tuple = ()
    held: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __call__(self, layers: nnx.Module, x: jax.Array) -> jax.Array:
        answer = _STACK.get()
        if answer is not None:
            return answer(layers, x)
        return pipeline.run(layers, x, pipeline.Schedule(self.stages, self.repeats, self.microbatches))

    def value_and_grad(self, fn, has_aux: bool = True):
        assert has_aux, "the train step's objective returns (total, (rest, loss, stats))"
        return functools.partial(value_and_grad, self, fn)


@dataclass
class Stack:
    """What the run before the stack found: its layers' graph, their other state, how many stacks ran, and the
    stack's input with its layers' parameters (the run's outputs)."""
    graphdef: object = None
    rest: object = None
    calls: int = 0
    captured: tuple = ()


def answering(fn, answer):
    """fn with `stack` answering `answer(layers, x)`."""
    def run(*args):
        token = _STACK.set(answer)
        try:
            return fn(*args)
        finally:
            _STACK.reset(token)
    return run


def value_and_grad(p: OneFOneB, fn, params, rest, batch):
    """((total, (rest, loss, stats)), grads) of `fn(params, rest, batch)` over M microbatches, as
    jax.value_and_grad(fn, has_aux=True) with train.grad_accum=M would give them."""
    S, R, M = p.stages, p.repeats, p.microbatches
    table = Table(S, R, M)
    batch = pipeline.arrange(batch, M, S)
    found = Stack()

    def capture(layers, x):
        graphdef, weights, others = nnx.split(layers, nnx.Param, ...)
        found.graphdef, found.rest, found.calls = graphdef, others, found.calls + 1
        found.captured = (x, weights)
        return x

    def before(params):
        answering(fn, capture)(params, rest, batch)
        return found.captured

    (x, weights), before_vjp = jax.vjp(before, params)
    refuse(found, S, x.shape[0] // M)
    n_layers = jax.tree.leaves(weights)[0].shape[0]
    per = n_layers // (S * R)
    mesh, rules = partition.active()
    rows = pipeline.Rows.of(rules, mesh.shape, S)
    inner = partition.without_batch_axes(rules, ("stage",))
    on_stages = functools.partial(pipeline.stage_split, mesh, rows)
    staged = jax.tree.map(lambda a: on_stages(a.reshape(S, R, per, *a.shape[1:]), 2), weights)
    counters = jax.tree.map(lambda a: a.reshape(S, R, per, *a.shape[1:]), found.rest)
    graphdef = found.graphdef

    # What the head differentiates: the parameters outside the stack (those inside get no gradient there).
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    inside = [pipeline.Layout(S, R, p.stacked).layer_dim(path, leaf) is not None for path, leaf in leaves]
    outside = [leaf for (_, leaf), i in zip(leaves, inside) if not i]

    def whole(out):
        it = iter(out)
        return jax.tree.unflatten(treedef, [jax.lax.stop_gradient(leaf) if i else next(it)
                                            for (_, leaf), i in zip(leaves, inside)])

    io = on_stages(pipeline.to_first(on_stages(rows.to_stages(x, M), 1, 2)), 1, 2)  # (S, M, mb, ...): row 0 has all
    micro = jax.tree.map(lambda a: rows.to_stages(a, M).reshape(M, -1, *a.shape[1:]), batch)
    stage = jnp.arange(S)
    first, last = stage == 0, stage == S - 1
    mb_shape = io.shape[2:]
    column = lambda v: v.reshape(S, *[1] * len(mb_shape))

    def group_forward(group_weights, group_rest, x_s):
        group = nnx.merge(graphdef, group_weights, group_rest)
        return hooks.scan(group, x_s), nnx.state(group, nnx.Not(nnx.Param))

    pick = lambda r: lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False)
    pullback = {}  # a kept visit's vjp again: its tree, and where the group's weights go back into it

    def stage_forward(weights_s, rest_s, x_s, r):
        """Stage s's group r on its microbatch: the output, the group's new state, and what the backward needs:
        the vjp's residuals less the group's weights (the same arrays every visit: the backward picks them)."""
        w = jax.tree.map(pick(r), weights_s)
        # the counters are an input too: NNX's scan refuses variables of an outer trace (their cotangents: float0)
        y, vjp, new = jax.vjp(group_forward, w, jax.tree.map(pick(r), rest_s), x_s, has_aux=True)
        leaves, pullback["tree"] = jax.tree.flatten(vjp)
        ws = jax.tree.leaves(w)
        pullback["weights"] = [next((i for i, a in enumerate(ws) if a is leaf), None) for leaf in leaves]
        return y, new, [leaf for leaf, i in zip(leaves, pullback["weights"]) if i is None]

    def stage_backward(weights_s, kept, r, dy):
        ws, it = jax.tree.leaves(jax.tree.map(pick(r), weights_s)), iter(kept)
        vjp = jax.tree.unflatten(pullback["tree"], [next(it) if i is None else ws[i] for i in pullback["weights"]])
        dw, _, dx = vjp(dy)
        return dw, dx

    def head(outside_, y, batch_m, rest_m, now):
        def substitute(layers, _):
            nnx.update(layers, jax.tree.map(lambda a: a.reshape(n_layers, *a.shape[3:]), now))
            return y
        return answering(fn, substitute)(whole(outside_), rest_m, batch_m)

    # The head runs on every stage at once with its own copy of the parameters outside the stack, so their gradient
    # stays a partial sum per stage until the end, not a reduction over the stages at every tick: where the
    # microbatch's rows split over the stages each takes its share (1/S of the head's work each), else each runs
    # its own output and only the last stage's counts (no activation leaves a stage).
    split = mb_shape[0] % (S * math.prod(mesh.shape[a] for a in rows.others)) == 0
    share = jnp.full(S, 1 / S) if split else last.astype(jnp.float32)
    copies = [on_stages(jnp.broadcast_to(a, (S, *a.shape)), 0) for a in outside]

    def parts(a):
        a = a.reshape(S, a.shape[0] // S, *a.shape[1:]) if split else jnp.broadcast_to(a, (S, *a.shape))
        return on_stages(a, 0, 1)

    def heads(copies_, ys, batch_m, rest_m, now):
        def one(o, y_s, batch_s):
            return head(o, y_s, batch_s, rest_m, now)
        with partition.activate(mesh, inner):
            total, aux = jax.vmap(one, spmd_axis_name="stage")(copies_, ys, jax.tree.map(parts, batch_m))
        mean = lambda a: jnp.tensordot(share, a.astype(jnp.float32), 1).astype(a.dtype)
        return mean(total), jax.tree.map(lambda a: mean(a) if pipeline.floating(a) else a[S - 1], aux)

    def tick(carry, t):
        inputs, cots, dx_io, saved, current, grads, head_grads, head_rest, sums = carry
        # forward: stage 0 takes its microbatch's embedding on its first repeat, the others what arrived
        f_valid, f_m, f_r, f_slot = table.forward(t, stage)
        inputs = jnp.where(column(first & (f_r == 0)), io[:, f_m[0]], inputs)

        def forwards(current):
            with partition.activate(mesh, inner):
                y, new, kept = jax.vmap(stage_forward, spmd_axis_name="stage")(staged, current, inputs, f_r)
            keep = lambda cur, n: jax.vmap(lambda c, r, v, ok: c.at[r].set(jnp.where(ok, v, c[r])))(cur, f_r, n,
                                                                                                       f_valid)
            return y, jax.tree.map(keep, current, new), kept

        idle = lambda c: (jnp.zeros_like(inputs), c, [jnp.zeros(k.shape, k.dtype) for k in blank])
        outputs, current, kept = jax.lax.cond(jnp.any(f_valid), forwards, idle, current)
        put = lambda buf, v: jax.vmap(lambda b, i, x, ok: b.at[i].set(jnp.where(ok, x, b[i])))(buf, f_slot, v,
                                                                                                 f_valid)
        saved = [put(buf, v) for buf, v in zip(saved, kept)]

        # the microbatch whose last forward ended at the last stage: its head, loss and output cotangent
        done, m = f_valid[S - 1] & (f_r[S - 1] == R - 1), f_m[S - 1]

        def loss_and_cotangent(head_rest):
            batch_m = jax.tree.map(lambda a: a[m], micro)
            ys = parts(outputs[S - 1]) if split else outputs
            total, vjp, (new_rest, loss, stats) = jax.vjp(
                lambda o, y: heads(o, y, batch_m, head_rest, current), copies, ys, has_aux=True)
            d_out, dys = vjp(jnp.ones_like(total) / M)
            # the last stage's output cotangent, at the last stage (the other rows of `dys`: unused)
            dy = jnp.broadcast_to(dys.reshape(mb_shape), (S, *mb_shape)) if split else dys
            return dy, d_out, (total, loss, stats), new_rest

        shapes = jax.eval_shape(loss_and_cotangent, head_rest)
        dy, d_out, seen, head_rest = jax.lax.cond(
            done, loss_and_cotangent,
            lambda r: (*jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[:3]), r), head_rest)
        head_grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), head_grads, d_out)
        sums = jax.tree.map(lambda a, v: a + v.astype(jnp.float32), sums, seen)

        # backward: the last stage starts from the head's cotangent on a microbatch's last repeat
        b_valid, b_m, b_r, b_slot = table.backward(t, stage)
        cots = jnp.where(column(last & (b_r == R - 1)), dy.astype(cots.dtype), cots)

        def backwards(grads):
            take = lambda buf: jax.vmap(lambda b, i: b[i])(buf, b_slot)
            with partition.activate(mesh, inner):
                dw, dx = jax.vmap(stage_backward, spmd_axis_name="stage")(staged, [take(b) for b in saved], b_r,
                                                                           cots)
            add = lambda acc, g: jax.vmap(lambda a, r, v, ok: a.at[r].add(jnp.where(ok, v, 0).astype(a.dtype)))(
                acc, b_r, g, b_valid)
            return dx, jax.tree.map(add, grads, dw)

        dx, grads = jax.lax.cond(jnp.any(b_valid), backwards, lambda g: (jnp.zeros_like(cots), g), grads)
        # stage 0 on a microbatch's first repeat: its input's cotangent, kept for the embedding's backward
        home = b_valid[0] & (b_r[0] == 0)
        dx_io = dx_io.at[:, b_m[0]].set(jnp.where(column(first & home), dx, dx_io[:, b_m[0]]))
        return (jnp.roll(outputs, 1, axis=0), jnp.roll(dx, -1, axis=0), dx_io, saved, current, grads,
                head_grads, head_rest, sums), None

    zeros = lambda a, dtype=None: jnp.zeros(a.shape, dtype or a.dtype)
    slots = lambda a: on_stages(jnp.zeros((S, table.slots, *a.shape[1:]), a.dtype), 1)
    shift = on_stages(jnp.zeros((S, *mb_shape), x.dtype), 0, 1)
    first_batch = jax.tree.map(lambda a: a[0], micro)
    ys = parts(shift[0]) if split else shift
    total, (_, loss, stats) = jax.eval_shape(lambda r: heads(copies, ys, first_batch, r, counters), rest)
    sums = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (total, loss, stats))
    with partition.activate(mesh, inner):  # what a visit keeps for its backward, each stage a ring of slots
        _, _, blank = jax.eval_shape(jax.vmap(stage_forward, spmd_axis_name="stage"), staged, counters, shift,
                                     jnp.zeros(S, jnp.int32))
    carry = (shift, shift, jnp.zeros_like(io), [slots(k) for k in blank], counters,
             jax.tree.map(lambda a: zeros(a, jnp.float32), staged), [zeros(a) for a in copies], rest, sums)
    p.held["slot_bytes"] = sum(k.size // S * k.dtype.itemsize for k in blank)
    p.held["slots"] = table.slots
    carry, _ = jax.lax.scan(tick, carry, jnp.arange(table.ticks))
    _, _, dx_io, _, current, grads, head_grads, head_rest, sums = carry

    dx = rows.from_stages(on_stages(pipeline.from_first(dx_io, S), 1, 2))
    stack_grads = jax.tree.map(lambda g, w: g.reshape(w.shape).astype(w.dtype), grads, weights)
    (before_grads,) = before_vjp((dx.astype(x.dtype), stack_grads))
    it = iter(head_grads)
    grads = jax.tree.unflatten(treedef, [g if i else g + next(it).sum(0).astype(g.dtype)
                                         for g, i in zip(jax.tree.leaves(before_grads), inside)])
    total, loss, stats = jax.tree.map(lambda s: s / M, sums)
    return (total, (head_rest, loss, stats)), grads


def refuse(found: Stack, stages: int, micro_size: int) -> None:
    """What this schedule cannot run, in one line."""
    pipeline.refuse_batch_statistics(found.rest, stages, micro_size)
    if found.calls != 1:
        raise UserError(f"pipeline.schedule=1f1b with mesh.stage={stages}: the model runs {found.calls} stacks of "
                        "layers through shard.nn.hooks.stack, and 1F1B pipelines one; use pipeline.schedule=gpipe")
    leaves = jax.tree_util.tree_flatten_with_path(found.rest)[0]
    floats = ["/".join(map(str, partition.path_keys(path))) for path, leaf in leaves if pipeline.floating(leaf)]
    if floats:
        raise UserError(f"pipeline.schedule=1f1b: the stacked layers update float state ({floats[0]}: recorded losses "
                        "or statistics), which 1F1B cannot average over the microbatches; use pipeline.schedule=gpipe")
