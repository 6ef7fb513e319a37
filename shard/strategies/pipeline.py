"""Pipeline parallelism: a model's stacked layers cut into stages over the `stage` mesh axis.

The whole schedule is one SPMD program. The L layers form S x R groups of L/(S R) layers; stage s
holds groups s, s+S, ..., s+(R-1)S (R = 1: GPipe's contiguous blocks; R > 1: a circular schedule,
whose bubble is R times smaller). The global batch is cut into M microbatches. At every iteration
of a scan, all S stages run at once (a vmap over the stage-split dimension) on the microbatch each
holds; their outputs then move one stage on (a roll over the stage dimension, which XLA compiles to
a collective permute). Stage 0 takes a new microbatch, or one coming back from stage S-1 for its next
repeat, and keeps those that have passed every layer. After R M + S - 1 iterations
every microbatch has passed all L layers in order; the S - 1 iterations in which some stages have
nothing to do are the bubble, (S-1)/(R M + S - 1) of the time. Reverse-mode autodiff of the scan is
the backward pipeline.

Where the parameters live: the `layers` dimension maps to the `stage` axis (shard/nn/partition.py),
so each stage's devices hold L/S contiguous rows of every stacked array, the other axes splitting them
further as usual. GPipe runs exactly those layers. The circular schedule runs every S-th group instead,
so its train state keeps the stacked arrays in schedule order (`Layout`: stage s's rows are its groups
s, s+S, ...) and the step moves no weights; checkpoints, the run's result and generation see the
model's own layer order, converted once on restore and on save, so checkpoints move between meshes.

Where the batch lives: outside the stack its rows are split over the stages too (the `batch` rule), so
the embedding, output layer and loss run on 1/S of the rows on each stage. Stage s holds microbatches
sK..sK+K-1 (K = M/S, cut from each device's own rows: `Rows`); stage 0 gathers them once, each stage
sending only its rows, and at the end sends each stage its outputs. `arrange` orders a training batch's
rows so that these microbatches are `train.grad_accum`'s on one device.

Random streams (dropout): each layer's stream is carried from microbatch to microbatch, so microbatch m
draws with the layer's counter advanced m times, and the advanced counters are written back: the draws
of `train.grad_accum=M` on one device. Batch statistics cannot be taken over the whole batch when each
stage sees one microbatch at a time: a stack holding them is refused.
"""

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shard.nn import hooks, partition
from shard.errors import UserError

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


@dataclass(frozen=True)
class Schedule:
    """S stages, R layer groups per stage (1 = GPipe, more = circular), M microbatches; called by
    `shard.nn.hooks.stack` in place of its scan."""
    stages: int
    repeats: int
    microbatches: int

    def __call__(self, layers: nnx.Module, x: jax.Array) -> jax.Array:
        return run(layers, x, self)


def bubble(stages: int, repeats: int, microbatches: int) -> float:
    """The share of a pipelined step in which stages idle: (S-1)/(R M + S - 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def run(layers: nnx.Module, x: jax.Array, p: Schedule) -> jax.Array:
    S, R, M = p.stages, p.repeats, p.microbatches
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    refuse_batch_statistics(rest, S, x.shape[0] // M)
    n_layers = jax.tree.leaves(nnx.state(layers))[0].shape[0]
    per = n_layers // (S * R)
    mesh, rules = partition.active()
    rows = Rows.of(rules, mesh.shape, S)
    # Inside the stages' vmap the stage dimension is the vmap's: the stage's microbatch is split on the rest.
    inner = partition.without_batch_axes(rules, ("stage",))

    on_stages = functools.partial(stage_split, mesh, rows)

    # Stored in schedule order (`Layout`; GPipe's is the layer order): (L, ...) -> (S, R, per, ...) is
    # stage s's groups in the order it runs them, its own rows: nothing moves.
    staged = jax.tree.map(lambda a: on_stages(a.reshape(S, R, per, *a.shape[1:]), 2), params)
    fixed = jax.tree.map(lambda a: a.reshape(S, R, per, *a.shape[1:]), rest)

    tail = x.shape[1:]
    # Stage 0 gathers every stage's microbatches once (S - 1 sends of a stage's rows, to stage 0 only): its row of
    # `io` holds microbatch m at m. What stage S-1 finishes comes round to stage 0 with the stages' roll, and
    # waits in its microbatch's place, for its next repeat or, after the last, to go home to its stage.
    io = on_stages(to_first(on_stages(rows.to_stages(x, M), 1, 2)), 1, 2)     # (S, M, mb, ...)
    shift = on_stages(jnp.zeros((S, *io.shape[2:]), x.dtype), 0, 1)
    stage = jnp.arange(S)
    first = (stage == 0).reshape(S, *[1] * (1 + len(tail)))

    def one_stage(params_s, rest_s, x_s, r):
        """Stage s at one iteration: its repeat r's layers applied to its microbatch."""
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False)
        group = nnx.merge(graphdef, jax.tree.map(pick, params_s), jax.tree.map(pick, rest_s))
        y = hooks.scan(group, x_s)
        return y, nnx.state(group, nnx.Not(nnx.Param))

    stages_at_once = jax.vmap(one_stage, spmd_axis_name="stage")
    totals = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32) if floating(a) else a, fixed)

    def iteration(carry, t):
        io, shift, totals, current = carry
        # What stage S-1 finished one iteration ago has just arrived at stage 0 (the roll): keep it
        # there for its next repeat (it waits M - S iterations when M > S), or as the output.
        k_back = t - S
        back = (k_back >= 0) & (k_back < R * M)
        slot = jnp.maximum(k_back, 0) % M
        io = io.at[:, slot].set(jnp.where(first & back, shift, io[:, slot]))
        # Stage s works on visit k = t - s: microbatch k mod M, repeat k div M, while 0 <= k < R M.
        k = t - stage
        valid = (k >= 0) & (k < R * M)
        r = jnp.clip(k, 0, R * M - 1) // M
        inputs = jnp.where(first, io[:, jnp.maximum(t, 0) % M], shift)
        with partition.activate(mesh, inner):
            outputs, updated = stages_at_once(staged, current, inputs, r)

        def where_valid(new, old):
            return jnp.where(valid.reshape(S, *[1] * (new.ndim - 1)), new, old)

        def add(total, new):  # floats (statistics, auxiliary losses): summed over the stages' real work
            return jax.vmap(lambda tot, rr, v: tot.at[rr].add(v))(total, r, where_valid(new, 0).astype(total.dtype))

        def carry_on(cur, new):  # the rest (random streams' counters): the next microbatch goes on from here
            return jax.vmap(lambda c, rr, v: c.at[rr].set(v))(cur, r, where_valid(new, cur[stage, r]))

        totals = jax.tree.map(lambda tot, new: add(tot, new) if floating(tot) else tot, totals, updated)
        current = jax.tree.map(lambda cur, new: cur if floating(cur) else carry_on(cur, new), current, updated)
        return (io, jnp.roll(outputs, 1, axis=0), totals, current), None

    steps = jnp.arange(R * M + S - 1)
    (io, shift, totals, current), _ = jax.lax.scan(iteration, (io, shift, totals, fixed), steps)
    io = io.at[:, M - 1].set(jnp.where(first, shift, io[:, M - 1]))  # the last microbatch, finished at the last step
    if jax.tree.leaves(rest):  # each layer's variables: floats their mean over the microbatches, the rest carried
        final = jax.tree.map(lambda tot, cur: (tot / M).astype(cur.dtype) if floating(cur) else cur, totals, current)
        nnx.update(layers, jax.tree.map(lambda a: a.reshape(n_layers, *a.shape[3:]), final))
    return rows.from_stages(on_stages(from_first(io, S), 1, 2))


def stage_split(mesh, rows: "Rows", a: jax.Array, whole: int, batch_dim: int | None = None) -> jax.Array:
    """a asked for with its first dimension on `stage`, the next `whole` whole, a batch dimension on the other
    batch axes, the rest as they are."""
    spec = ["stage", *([None] * whole), *([UNCONSTRAINED] * (a.ndim - 1 - whole))]
    if batch_dim is not None:
        spec[batch_dim:] = [rows.others or None] + [None] * (a.ndim - 1 - batch_dim)
    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, PartitionSpec(*spec)))


def to_first(a: jax.Array) -> jax.Array:
    """(S, K, ...), stage s's rows at s -> (S, S K, ...) whose stage-0 row holds them all in order (the other
    rows zero): stage s sends its rows to stage 0 only (a static slice moved to another stage, which XLA
    compiles to a collective permute of that one pair)."""
    S = a.shape[0]
    rest = [(0, 0)] * (a.ndim - 1)
    return jnp.concatenate([jnp.pad(a[s:s + 1], [(0, S - 1), *rest]) for s in range(S)], axis=1)


def from_first(a: jax.Array, stages: int) -> jax.Array:
    """The inverse of `to_first`: (S, S K, ...) whose stage-0 row holds every stage's rows -> (S, K, ...), each
    stage its own (stage 0 sends each stage its rows, one pair at a time)."""
    S, K = stages, a.shape[1] // stages
    rest = [(0, 0)] * (a.ndim - 2)
    return sum(jnp.pad(a[:1, s * K:(s + 1) * K], [(s, S - 1 - s), (0, 0), *rest]) for s in range(S))


@dataclass(frozen=True)
class Rows:
    """How a batch's rows sit on the devices, seen from the stages: the batch axes before `stage` cut the batch
    into `lead` blocks, each block into S stage blocks, each of those into `follow` blocks (one device's rows).
    The stages' microbatches are cut from each device's own rows, so that none moves: stage s's microbatch
    sK + k is the k-th of K slices of every device's rows on stage s."""
    stages: int
    lead: int
    follow: int
    others: tuple  # the batch axes beside `stage`, which split each microbatch

    @classmethod
    def of(cls, rules: dict, mesh_shape, stages: int) -> "Rows":
        axes = partition.batch_axes(rules, mesh_shape)
        at = axes.index("stage") if "stage" in axes else len(axes)
        size = lambda names: math.prod(mesh_shape[a] for a in names)
        return cls(stages, size(axes[:at]), size(axes[at + 1:]), tuple(a for a in axes if a != "stage"))

    def to_stages(self, a: jax.Array, micro: int) -> jax.Array:
        """(B, ...) -> (S, K, B/M, ...)."""
        S, A, F, K = self.stages, self.lead, self.follow, micro // self.stages
        tail = a.shape[1:]
        c = a.shape[0] // (A * S * F * K)
        blocks = a.reshape(A, S, F, K, c, *tail).transpose(1, 3, 0, 2, 4, *range(5, 5 + len(tail)))
        return blocks.reshape(S, K, A * F * c, *tail)

    def from_stages(self, a: jax.Array) -> jax.Array:
        """The inverse of `to_stages`: (S, K, B/M, ...) -> (B, ...)."""
        S, K, A, F = a.shape[0], a.shape[1], self.lead, self.follow
        tail = a.shape[3:]
        c = a.shape[2] // (A * F)
        blocks = a.reshape(S, K, A, F, c, *tail).transpose(2, 0, 3, 1, 4, *range(5, 5 + len(tail)))
        return blocks.reshape(S * K * A * F * c, *tail)


def arrange(batch: dict, micro: int, stages: int) -> dict:
    """A training batch's rows reordered so that the stages' microbatches (`Rows`) are `train.grad_accum`'s:
    microbatch m holds examples m, m+M, ... (`partition.microbatches`), in that order, on any mesh. A model
    with random streams then draws each microbatch's masks for the same examples as on one device; what
    moves is the batch's tokens, not activations."""
    mesh, rules = partition.active()
    rows = Rows.of(rules, mesh.shape, stages)
    K = micro // stages

    def one(a):
        moved = rows.from_stages(partition.microbatches(a, micro).reshape(stages, K, -1, *a.shape[1:]))
        # Laid out as the batch is: XLA moves these rows here, not the activations made from them later.
        return partition.constrain(moved, ("batch",) + (None,) * (a.ndim - 1))

    return {k: one(v) for k, v in batch.items()}


def floating(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def refuse_batch_statistics(rest, stages: int, micro_size: int) -> None:
    """Batch statistics (BatchNorm) in the stacked layers would be each microbatch's, not the batch's: a
    layer cannot see the whole batch before it passes any microbatch on."""
    flat = nnx.to_flat_state(rest)
    stats = ["/".join(map(str, path)) for path, var in flat if isinstance(var, nnx.BatchStat)]
    if stats:
        raise UserError(f"mesh.stage={stages}: the stacked layers hold batch statistics ({stats[0]}, e.g. BatchNorm), "
                        f"which a pipeline would take over each microbatch of {micro_size} examples, not over the "
                        "batch; use a mesh without a stage axis, or a normalisation without batch statistics "
                        "(LayerNorm, RMSNorm)")


# ----------------------------------------------------------------------------- the circular schedule's layout

@dataclass(frozen=True)
class Layout:
    """How a circular schedule's train state keeps each stacked array: in schedule order, row block s
    holding stage s's groups s, s+S, ..., s+(R-1)S, so that the stage split of the `layers` dimension
    gives each stage the layers it runs. `stacked`: the model-relative path and rank of every variable
    in a stack; any state leaf whose path ends with one (a parameter, its optimizer moments, DiLoCo's
    outer copy) is one, its layers dimension the one its extra leading dimensions (replicas) push on."""
    stages: int
    repeats: int
    stacked: tuple

    def layer_dim(self, path, leaf) -> int | None:
        names = partition.path_keys(path)
        names = names[:-1] if names and names[-1] == "value" else names
        for var_path, ndim in self.stacked:
            if names[-len(var_path):] == var_path:
                return leaf.ndim - ndim
        return None

    def convert(self, tree, to_schedule: bool):
        """tree (arrays in their shardings) with every stacked array's layers regrouped, in place of its
        order: layer order -> schedule order (`to_schedule`), or back. One gather over `stage` each."""
        S, R = self.stages, self.repeats
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        moving = {i: d for i, (path, leaf) in enumerate(leaves) if (d := self.layer_dim(path, leaf)) is not None}

        def regroup(a, d):
            before, after = (R, S) if to_schedule else (S, R)
            shape = (*a.shape[:d], before, after, a.shape[d] // (S * R), *a.shape[d + 1:])
            return a.reshape(shape).swapaxes(d, d + 1).reshape(a.shape)

        arrays = [leaves[i][1] for i in moving]
        moved = jax.jit(lambda xs: [regroup(a, d) for a, d in zip(xs, moving.values())],
                        out_shardings=[a.sharding for a in arrays])(arrays)
        values = [leaf for _, leaf in leaves]
        for i, a in zip(moving, moved):
            values[i] = a
        return jax.tree.unflatten(treedef, values)


def layout(p: Schedule | None, stacked: tuple) -> Layout | None:
    """The state's layout under schedule p: a Layout for a circular schedule, None where the layer order
    is the schedule's (GPipe, no pipeline)."""
    return None if p is None or p.repeats == 1 else Layout(p.stages, p.repeats, stacked)


def stacked_variables(graphdef, abstract_state, inputs) -> tuple:
    """The model-relative path and rank of every variable in a stack, found by tracing the model once,
    abstractly, with each `shard.nn.hooks.stack` call recording its layers in place of running them."""
    found = []

    def forward(params, rest, x):
        model, stacks = nnx.merge(graphdef, params, rest), []
        with hooks.use(pipeline=lambda layers, y: stacks.append(layers) or y):
            model(x)
        prefixes = [path for path, node in nnx.iter_graph(model) if any(node is s for s in stacks)]
        found.extend((tuple(map(str, path)), jax.tree.leaves(var)[0].ndim)
                     for path, var in nnx.to_flat_state(nnx.state(model)) if any(path[:len(q)] == q for q in prefixes))
        return jnp.zeros(())

    jax.eval_shape(forward, abstract_state.params, abstract_state.rest, inputs)
    return tuple(found)


def to_schedule(layout_: Layout | None, state):
    """A state in the model's layer order (restored, initialised) as the step keeps it."""
    return state if layout_ is None else layout_.convert(state, True)


def to_layers(layout_: Layout | None, state):
    """The step's state in the model's layer order (to save, or to hand to anything outside the step)."""
    return state if layout_ is None else layout_.convert(state, False)
