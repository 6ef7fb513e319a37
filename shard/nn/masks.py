"""Which keys a query sees, for every path of shard.nn.hooks.attention (XLA's kernels, context parallelism's,
generation's): sliding windows and chunks as models hand them, read into what the kernels take, and the visibility
of keys by position.

A window or a chunk size is None or 0 (none), a positive int, or (value, sizes) for layers that differ inside one
scanned stack: `sizes` the static tuple of every layer's (0: none), `value` this layer's, a traced int32
(models/layers.py's PerLayer). A window: a query sees only the `window` nearest keys. A chunk (Llama 4's chunked
attention, transformers' chunked_overlay on a causal mask): a query at position p sees a key at s only if s <= p and
s // chunk == p // chunk.
"""

import jax
import jax.numpy as jnp
import numpy as np

from shard.errors import UserError


def _sizes(spec, what: str, each: str) -> tuple:
    """(value, sizes) of a window or chunk spec: `sizes` ((size, layers), ...) the distinct sizes (0: none) and how
    many layers have each, static; `value` None where there is one size (then static), else the traced one."""
    value, every = spec if isinstance(spec, tuple) else (spec, (spec,))
    every = tuple(0 if w is None else w for w in every)
    if any(not isinstance(w, (int, np.integer)) or isinstance(w, bool) or w < 0 for w in every):
        raise UserError(f"attention: {what} {every}; each is {each}")
    sizes = tuple((int(w), every.count(w)) for w in sorted(set(every)))
    return (None if len(sizes) == 1 else value), sizes


def windows(window) -> tuple:
    """(value, sizes) of a call's sliding window (`_sizes`)."""
    return _sizes(window, "sliding windows", "a number of keys >= 1, or 0 for a global layer")


def chunks(chunk, is_causal: bool, window=None) -> tuple:
    """(value, sizes) of a call's chunk size (`_sizes`), refused in one line where the call is not causal (a chunk
    narrows a causal mask) or also has a sliding window (no model has both; no kernel is written for both)."""
    value, sizes = _sizes(chunk, "chunk sizes", "a number of tokens >= 1, or 0 for an unchunked layer")
    if any(c for c, _ in sizes):
        if not is_causal:
            raise UserError(f"attention: chunked attention (chunk sizes {', '.join(str(c) for c, _ in sizes)}) is "
                            "causal attention within each chunk; got is_causal=False")
        spans = windows(window)[1]
        if any(w for w, _ in spans):
            raise UserError(f"attention: a sliding window ({', '.join(str(w) for w, _ in spans)}) and chunked "
                            f"attention (chunk sizes {', '.join(str(c) for c, _ in sizes)}) on one call; a call (a "
                            "stack's layers together) takes windows or chunks, not both")
    return value, sizes


def fixed(sizes: tuple) -> int | None:
    """The one static size of `sizes` (None: none, or several sizes)."""
    return sizes[0][0] or None if len(sizes) == 1 else None


def effective(value, sizes: tuple):
    """What the masks take: None (none), a static int, or the traced value (0: none)."""
    return fixed(sizes) if value is None else value


def visible(qpos, kpos, is_causal: bool, window=None, chunk=None):
    """(..., t, s) bool: which keys each query sees by position, from qpos (..., t) and kpos (..., s), NumPy or
    JAX arrays; None where it sees all. `window`, `chunk`: an int, or a traced int32 where 0 means none."""
    if not is_causal and window is None and chunk is None:
        return None
    static = (isinstance(qpos, np.ndarray) and isinstance(kpos, np.ndarray)
              and all(isinstance(x, (int, type(None))) for x in (window, chunk)))
    xp = np if static else jnp
    qpos, kpos = xp.asarray(qpos), xp.asarray(kpos)
    apart = qpos[..., :, None] - kpos[..., None, :]  # how far back each key lies
    seen = apart >= 0 if is_causal else None
    if window is not None:
        near = xp.abs(apart) < window
        near = near if isinstance(window, int) else near | (window == 0)
        seen = near if seen is None else seen & near
    if chunk is not None:
        size = chunk if isinstance(chunk, int) else jnp.maximum(chunk, 1)
        same = (qpos // size)[..., :, None] == (kpos // size)[..., None, :]
        same = same if isinstance(chunk, int) else same | (chunk == 0)
        seen = same if seen is None else seen & same
    return seen


def chunk_segments(segments, places, chunk, order=None):
    """Packed rows' segment ids (batch, length) with each chunk of a document a segment of its own, so that a causal
    mask over them is the chunked one: a token's id becomes the row place of its chunk's first token, found from its
    position in its document (`places`, (batch, length); None: counted from the document's first token), which a
    row's places alone do not show; a chunk begun before the row's piece of its document (a position that does not
    start at 0) from the document's first place, so no id is another document's. Rows laid out in `order` (context
    parallelism's load-balanced one) are read in order. `chunk`: an int, or a traced int (0: the documents' ids)."""
    if chunk is None:
        return segments
    seg = segments if order is None else segments[:, np.argsort(order)]
    index = jnp.arange(seg.shape[-1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    begins = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # each token's document's first place
    rows = index if order is None else jnp.asarray(order, jnp.int32)
    begins = begins if order is None else begins[:, np.asarray(order)]
    places = rows - begins if places is None else places
    first = jnp.maximum(rows - places % (chunk if isinstance(chunk, int) else jnp.maximum(chunk, 1)), begins)
    return first if isinstance(chunk, int) else jnp.where(chunk > 0, first, segments)
