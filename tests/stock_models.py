"""Models a user might bring, written with Flax's stock layers and default initializers: no logical
names, nothing about meshes. Tests train them as `model.name=stock_models:Class`."""
import os
import time

import jax
import jax.numpy as jnp
from flax import linen, nnx


class StockMLP(nnx.Module):
    def __init__(self, in_features: int = 64, hidden: int = 256, classes: int = 10, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(in_features, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.l3 = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.l1(x.reshape(x.shape[0], -1)))
        return self.l3(jax.nn.relu(self.l2(x)))


class StockBlock(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class StockTransformer(nnx.Module):
    def __init__(self, vocab: int = 256, d: int = 128, heads: int = 4, layers: int = 2, max_len: int = 32, *,
                 rngs: nnx.Rngs):
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(max_len, d, rngs=rngs)
        self.blocks = nnx.List([StockBlock(d, heads, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


class DropoutMLP(nnx.Module):
    """Random state inside the model: nnx.Dropout draws from the model's own nnx.Rngs stream."""

    def __init__(self, in_features: int = 16, hidden: int = 64, classes: int = 8, rate: float = 0.2, *,
                 rngs: nnx.Rngs):
        self.l1 = nnx.Linear(in_features, hidden, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.l2 = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.l1(x.reshape(x.shape[0], -1)))))


_CALLS: dict = {}


class SlowMLP(nnx.Module):
    """A deliberately slow model for the stop-request tests. Building it takes `init_seconds`; each
    forward pass does `work` chained 512 x 512 matrix products (device time, dispatched asynchronously
    like any real step) and, if `seconds` > 0, sleeps on the host in a callback that appends "train"
    or "eval" to `trace` (as does "init" when the model is built), so a test knows the run's phase."""

    def __init__(self, in_features: int = 16, classes: int = 8, work: int = 0, seconds: float = 0.0,
                 init_seconds: float = 0.0, trace: str = "", hang_after: int = 0, hang_once: str = "", *,
                 rngs: nnx.Rngs):
        """`hang_after` > 0: forward pass number `hang_after` never returns on process 0 (a hung step; JAX runs
        the host callback on the first device only), unless the file `hang_once` exists; hanging creates it,
        so a restarted job goes through."""
        self.l = nnx.Linear(in_features, classes, rngs=rngs)
        self.work, self.seconds, self.trace = work, seconds, trace
        self.hang_after, self.hang_once = hang_after, hang_once
        self.deterministic = False  # model.eval() sets it: the forward passes of eval say "eval"
        self._event("init")
        time.sleep(init_seconds)

    def _event(self, what: str) -> None:
        if self.trace:
            with open(self.trace, "a") as f:
                f.write(what + "\n")

    def _maybe_hang(self) -> None:
        _CALLS[id(self)] = calls = _CALLS.get(id(self), 0) + 1  # not on the module: nnx forbids that in a trace
        if self.hang_after and calls >= self.hang_after and jax.process_index() == 0 \
                and not os.path.exists(self.hang_once):
            open(self.hang_once, "w").close()
            time.sleep(3600)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        if self.seconds:
            what = "eval" if self.deterministic else "train"
            jax.debug.callback(lambda: (self._event(what), time.sleep(self.seconds), self._maybe_hang()))
        busy = jnp.full((512, 512), 1e-3) * jnp.mean(x)  # depends on the input: not folded at compile time
        for _ in range(self.work):
            busy = jnp.tanh(busy @ busy)
        return self.l(x) + 0 * jnp.sum(busy)


class HostCallbackMLP(nnx.Module):
    """Calls back into NumPy on the host in its forward pass: trains, but no exchange format can hold it."""

    def __init__(self, in_features: int = 16, classes: int = 8, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(in_features, classes, rngs=rngs)

    def __call__(self, x):
        import numpy as np

        return self.l1(jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(x.shape, x.dtype), x))


class _Residual(nnx.Module):
    """x + W(norm(relu(x))): `norm` is a Dropout or a BatchNorm, i.e. state the forward pass updates."""

    def __init__(self, d: int, norm: str, rate: float, rngs: nnx.Rngs):
        self.w = nnx.Linear(d, d, rngs=rngs)
        self.norm = nnx.Dropout(rate, rngs=rngs) if norm == "dropout" else nnx.BatchNorm(d, rngs=rngs)

    def __call__(self, x):
        return x + self.w(self.norm(jax.nn.relu(x)))


class StackedResidual(nnx.Module):
    """A stack of residual layers run through `shard.nn.hooks.stack` (so a pipeline can cut it into stages),
    each with dropout (`norm="dropout"`) or batch statistics (`norm="batchnorm"`) inside."""

    def __init__(self, in_features: int = 16, d: int = 32, layers: int = 4, classes: int = 8, norm: str = "dropout",
                 rate: float = 0.3, *, rngs: nnx.Rngs):
        from shard.models.layers import stacked

        self.inp = nnx.Linear(in_features, d, rngs=rngs)
        self.blocks = stacked(layers, lambda r: _Residual(d, norm, rate, r), rngs)
        self.out = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, x):
        from shard.nn.hooks import stack

        return self.out(stack(self.blocks, self.inp(x.reshape(x.shape[0], -1))))


class BatchCenteredMLP(StockMLP):
    """Centres its hidden features over the batch: its examples meet in the forward pass, and no state it
    carries says so, so the class does."""
    examples_interact = True

    def __call__(self, x):
        h = jax.nn.relu(self.l1(x.reshape(x.shape[0], -1)))
        h = h - h.mean(axis=0, keepdims=True)
        return self.l3(jax.nn.relu(self.l2(h)))


class _LinenBatchNormNet(linen.Module):
    """A plain Flax Linen network with batch statistics: the kind a user brings from Linen code."""
    hidden: int = 32
    classes: int = 8

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Dense(self.hidden, use_bias=False)(x.reshape(x.shape[0], -1))  # the norm's bias stands in
        x = linen.BatchNorm(use_running_average=not train)(x)
        return linen.Dense(self.classes)(jax.nn.relu(x))


class LinenBatchNormMLP(nnx.Module):
    """The Linen network through nnx.bridge: trained with mutable batch statistics, evaluated with their running
    averages (model.eval() sets `use_running_average`, as it does on nnx.BatchNorm)."""

    def __init__(self, in_features: int = 16, hidden: int = 32, classes: int = 8, *, rngs: nnx.Rngs):
        self.net = nnx.bridge.ToNNX(_LinenBatchNormNet(hidden, classes), rngs=rngs)
        nnx.bridge.lazy_init(self.net, jnp.zeros((1, in_features)))
        self.use_running_average = False

    def __call__(self, x):
        if self.use_running_average:
            return self.net(x, train=False)
        return self.net(x, mutable=["batch_stats"])


class LinenBatchNormImmutable(LinenBatchNormMLP):
    """The same, called as Linen's apply is by default: its batch statistics immutable, which Linen refuses."""

    def __call__(self, x):
        return self.net(x)
