"""Grouped matrix products: the rows of x sorted by group, each group's run times its own matrix (a mixture of
experts' tokens through their experts), rows past the groups' runs coming out zero (`jax.lax.ragged_dot`'s
contract). One call, `matmul(x, w, sizes, kernel)`, three ways to compute it:

- xla: `jax.lax.ragged_dot` as XLA lowers it. The TPU compiler keeps it grouped; XLA's CPU and GPU backends
  expand it into a dense product per group (every row times every group's matrix, and the weight gradient the
  same): correct, but the groups' count times the work and, for the gradient, the memory. It is the reference
  the others are checked against, and what the model's FLOP count traces (shard/core/flops.py counts it as the
  grouped work it stands for).
- megablox: JAX's own Pallas megablox kernels (jax.experimental.pallas.ops.tpu.megablox: gmm forward and rows'
  gradient, tgmm the matrices'), MaxText's tiles (512 rows, 1024 of the contracted and of the output dimension,
  each no larger than its dimension); a TPU kernel (elsewhere it runs interpreted: slow, for checking only).
- tokamax: tokamax's ragged_dot kernels (Pallas: Mosaic on TPU, Triton or Mosaic on NVIDIA GPUs), grouped
  forward and gradients. On TPU, for shapes outside its tuned table, its tiles are 128 x 128 x 128, so its cost
  estimate (which the TPU cost model prices) reads each row tile's operands many times over (bench/RESULTS.md).
- tiled: the rows in tiles of `tile` rows, each (tile, group) pair that overlaps computed by one plain matrix
  product in a loop: tiles + groups - 1 products at most, where the dense expansion does tiles x groups; both
  gradients (rows and matrices) are computed the same way, each matrix's gradient accumulated in place. For a
  backend without a grouped kernel (CPU, and GPUs where tokamax does not import).

`auto`: megablox on a TPU, else tiled. (tokamax picks its kernel by JAX's default device, so a
step for run.target's compile-only devices is traced with the target's first device as the default,
shard/core/step.py; its Mosaic TPU kernel takes the rows in tiles of 128, so they are padded to a multiple, and
dimensions of 128 up, else tokamax falls back to its XLA path. On NVIDIA GPUs its Triton and Mosaic kernels'
gradients are not yet measured: `tokamax` is there to ask for them.) Under a mesh, tokamax's kernels need
shard/nn/dropless.py's exchange manual over every mesh axis (`whole_mesh`); so do megablox's.
"""

import contextlib
import contextvars
import functools
import importlib

import jax
import jax.numpy as jnp

from shard.nn import attention

TOKAMAX_ROWS = 128  # tokamax's Mosaic TPU kernel takes rows in tiles of 128 (its default tile_m), and no other count
MEGABLOX_TILES = (512, 1024, 1024)  # MaxText's megablox tiles (its wi_/wo_tile_* defaults): rows, contracted, out

class Tape:
    """The products whose rows are `rows` itself (an experts' mlp's first products: up and gate): their outputs
    recorded, or, given `replay`, taken from it in the same order, only their gradients computed (a grouped product's
    output is not needed for its own gradients). shard/nn/dropless.py keeps each exchange round's so, and its
    backward pass does not compute the experts' first products again."""

    def __init__(self, rows, replay=None):
        self.rows, self.replay, self.outputs = rows, replay, []


_TAPE: contextvars.ContextVar = contextvars.ContextVar("shard_grouped_tape", default=None)


@contextlib.contextmanager
def taped(rows, replay=None):
    tape = Tape(rows, replay)
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


def matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, kernel: str = "xla", device=None) -> jax.Array:
    """x (m, k) rows sorted by group, w (g, k, n), sizes (g,) int32 rows per group -> (m, n), x's dtype. `auto`
    resolved for `device` (default: the first of the default backend). Inside `taped(x)`, recorded or replayed."""
    tape = _TAPE.get()
    if tape is None or x is not tape.rows:
        return _matmul(x, w, sizes, kernel, device)
    if tape.replay is None or len(tape.outputs) >= len(tape.replay):
        out = _matmul(x, w, sizes, kernel, device)
    else:
        out = _replayed(functools.partial(_matmul, kernel=kernel, device=device), x, w, sizes,
                        tape.replay[len(tape.outputs)])
    tape.outputs.append(out)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _replayed(product, x, w, sizes, out):
    """`out`, given as product(x, w, sizes) computed before, with that product's gradients for x and w."""
    return out


def _replayed_fwd(product, x, w, sizes, out):
    return out, (x, w, sizes)


def _replayed_bwd(product, saved, dy):
    x, w, sizes = saved
    _, vjp = jax.vjp(lambda x, w: product(x, w, sizes), x, w)  # its output unused: traced, never computed
    dx, dw = vjp(dy)
    return dx, dw, None, None


_replayed.defvjp(_replayed_fwd, _replayed_bwd)


def _matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, kernel: str = "xla", device=None) -> jax.Array:
    device = device or jax.devices()[0]
    kernel = resolve(kernel, device)
    if kernel == "tokamax":
        import tokamax  # imported where used: a second or two, and only for backends with its kernels
        from absl import flags

        if not flags.FLAGS.is_parsed():  # tokamax reads its options as absl flags, else parsing our command line
            flags.FLAGS.mark_as_parsed()
        m = x.shape[0]
        rows = -(-m // TOKAMAX_ROWS) * TOKAMAX_ROWS  # its TPU kernel's row tiles must divide the rows
        x = jnp.pad(x, ((0, rows - m), (0, 0))) if rows > m else x
        return tokamax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)[:m]
    if kernel == "tiled":
        return _tiled(x, w, sizes.astype(jnp.int32))
    if kernel == "megablox":
        m = x.shape[0]
        rows = -(-m // TOKAMAX_ROWS) * TOKAMAX_ROWS  # whole row tiles (its tiles of 512, 256 or 128 rows divide them)
        x = jnp.pad(x, ((0, rows - m), (0, 0))) if rows > m else x
        out = _megablox(x, w.astype(x.dtype), sizes.astype(jnp.int32), attention.family(device) != "tpu")[:m]
        return jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], out, 0)  # it leaves rows past the groups unset
    return jax.lax.ragged_dot(x, w, sizes)


def resolve(kernel: str, device) -> str:
    """`auto` for a device: JAX's megablox kernels on a TPU, else tiled."""
    if kernel != "auto":
        return kernel
    return "megablox" if attention.family(device) == "tpu" else "tiled"


def whole_mesh(kernel: str, device) -> bool:
    """Whether `kernel` is, for `device`, tokamax's or megablox's: Pallas kernels (Mosaic on a TPU) that the
    partitioner cannot split and whose outputs carry no manual-axis types, so shard/nn/dropless.py's shard_map around
    them is manual over every mesh axis and untyped. (On a CPU tokamax takes its XLA path and megablox runs
    interpreted, the same way: what tests them there.)"""
    return resolve(kernel, device) in ("tokamax", "megablox")


def _tiles(m: int, k: int, n: int) -> tuple[int, int, int]:
    """megablox's tiles for an (m, k) x (k, n) product: MaxText's, each at most its dimension, the rows' the largest
    of 512, 256 and 128 that divides m (a multiple of 128)."""
    tm = next(t for t in (512, 256, 128) if t <= MEGABLOX_TILES[0] and m % t == 0)
    return tm, min(MEGABLOX_TILES[1], k), min(MEGABLOX_TILES[2], n)


def _megablox_module():
    """JAX's megablox kernels' module (its package exports a function of the same name, gmm: hence by path)."""
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _megablox(x, w, sizes, interpret: bool):
    mb = _megablox_module()
    (m, k), n = x.shape, w.shape[2]
    return mb.gmm(x, w, sizes, x.dtype, _tiles(m, k, n), interpret=interpret)


def _megablox_fwd(x, w, sizes, interpret):
    return _megablox(x, w, sizes, interpret), (x, w, sizes)


def _megablox_bwd(interpret, saved, dy):
    """The rows' gradient dy w^T (gmm, w transposed in the kernel) and the matrices' x^T dy per group (tgmm); each
    product's own tiles, as MaxText's custom gradient picks them."""
    mb = _megablox_module()
    x, w, sizes = saved
    (m, k), n = x.shape, w.shape[2]
    dy = dy.astype(x.dtype)
    dx = mb.gmm(dy, w, sizes, x.dtype, _tiles(m, n, k), transpose_rhs=True, interpret=interpret)
    dx = jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], dx, 0)  # rows past the groups: unset, as forward
    dw = mb.tgmm(x.T, dy, sizes, w.dtype, _tiles(m, k, n), num_actual_groups=w.shape[0], interpret=interpret)
    return reduced_like(dx, x), reduced_like(dw, w), None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)


def tile_rows(m: int, groups: int) -> int:
    """Rows per tile: about eight tiles per group (so the products at group boundaries, at most groups - 1 more
    than the tiles, add an eighth at most), a multiple of 8 between 8 and 512."""
    return max(8, min(512, -(-m // (8 * groups) // 8) * 8))


def _pairs(sizes: jax.Array, tile: int, tiles: int):
    """The (tile, group) pairs whose rows overlap, in row order, padded to tiles + groups - 1 with pairs of no
    rows: each pair's tile, group, and its rows' range [lo, hi) in x."""
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first, last = starts // tile, (ends + tile - 1) // tile  # tiles [first, last) hold the group's rows
    count = jnp.where(sizes > 0, last - first, 0)
    before = jnp.cumsum(count) - count
    p = jnp.arange(tiles + g - 1)
    # the group whose pairs' range holds p (counted, not jnp.searchsorted: it fails on values inside a shard_map)
    group = jnp.clip(jnp.sum(jnp.cumsum(count)[None, :] <= p[:, None], axis=1), 0, g - 1)
    used = p < jnp.sum(count)
    tile_of = jnp.clip(first[group] + p - before[group], 0, tiles - 1)
    lo = jnp.where(used, jnp.maximum(starts[group], tile_of * tile), 0)
    hi = jnp.where(used, jnp.minimum(ends[group], (tile_of + 1) * tile), 0)
    return tile_of, group, lo, hi


def _zeros(shape, *like) -> jax.Array:
    """float32 zeros that vary over the manual mesh axes `like` vary over (inside a shard_map a loop's carry must
    match what its body makes of them)."""
    return jnp.zeros(shape, jnp.float32) + sum(jnp.where(True, 0.0, a.ravel()[0]).astype(jnp.float32) for a in like)


def _varying(a) -> frozenset:
    """The manual mesh axes a traced value varies over inside a shard_map (none outside one)."""
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10; later releases name it vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def reduced_like(cotangent, primal):
    """A cotangent summed over the manual axes it varies over and its primal does not: in a custom backward pass,
    what autodiff's transpose of the primal's implicit broadcast would do (a weight replicated over the devices
    of a shard_map gets the sum of their gradients)."""
    extra = tuple(sorted(_varying(cotangent) - _varying(primal)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent


def _rows_mask(tile_index, lo, hi, tile: int):
    rows = tile_index * tile + jnp.arange(tile)
    return ((rows >= lo) & (rows < hi))[:, None]


@jax.custom_vjp
def _tiled(x, w, sizes):
    return _tiled_forward(x, w, sizes)


def _tiled_forward(x, w, sizes):
    m, k = x.shape
    g, _, n = w.shape
    tile = tile_rows(m, g)
    tiles = -(-m // tile)
    xt = jnp.pad(x, ((0, tiles * tile - m), (0, 0))).reshape(tiles, tile, k)

    def product(out, pair):
        t, e, lo, hi = pair
        rows = jnp.where(_rows_mask(t, lo, hi, tile), xt[t], 0)
        y = jnp.dot(rows, w[e], preferred_element_type=jnp.float32)
        return out.at[t].add(y), None

    out, _ = jax.lax.scan(product, _zeros((tiles, tile, n), x, w, sizes), _pairs(sizes, tile, tiles))
    return out.reshape(-1, n)[:m].astype(x.dtype)


def _tiled_fwd(x, w, sizes):
    return _tiled_forward(x, w, sizes), (x, w, sizes)


def _tiled_bwd(saved, dy):
    x, w, sizes = saved
    m, k = x.shape
    g, _, n = w.shape
    tile = tile_rows(m, g)
    tiles = -(-m // tile)
    pad = lambda a: jnp.pad(a, ((0, tiles * tile - m), (0, 0))).reshape(tiles, tile, a.shape[-1])  # noqa: E731
    xt, dyt = pad(x), pad(dy)

    def products(carry, pair):
        dx, dw = carry
        t, e, lo, hi = pair
        mask = _rows_mask(t, lo, hi, tile)
        rows, grads = jnp.where(mask, xt[t], 0), jnp.where(mask, dyt[t], 0)
        dx = dx.at[t].add(jnp.dot(grads, w[e].T, preferred_element_type=jnp.float32))
        dw = dw.at[e].add(jnp.dot(rows.T, grads, preferred_element_type=jnp.float32))
        return (dx, dw), None

    zeros = (_zeros((tiles, tile, k), x, w, sizes, dy), _zeros((g, k, n), x, w, sizes, dy))
    (dx, dw), _ = jax.lax.scan(products, zeros, _pairs(sizes, tile, tiles))
    dx, dw = dx.reshape(-1, k)[:m].astype(x.dtype), dw.astype(w.dtype)
    return reduced_like(dx, x), reduced_like(dw, w), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
