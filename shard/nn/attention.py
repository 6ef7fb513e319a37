"""Attention kernels: which one runs (`train.attention`), and each of them.

- xla: the products and softmax written out for XLA, on any device; the reference. On a CPU a formulation
  XLA:CPU compiles faster; elsewhere jax.nn.dot_product_attention's. `train.attention_precision=bfloat16`
  computes its logits and softmax in bfloat16 and normalises after the value product, as MaxText does.
- cudnn: cuDNN's fused flash attention through jax.nn.dot_product_attention (NVIDIA GPUs, half precision).
- splash: JAX's Pallas splash attention (TPUs), run by each device on its shard of the batch and heads.
- auto: splash on a TPU and cudnn on an NVIDIA GPU where the call fits them, else xla; never refuses.

Models call shard.nn.hooks.attention, which names its inputs and output for remat policies (QUERY, KEY, VALUE,
OUTPUT) and hands the call here unless generation or a context split takes it.
"""

import contextlib
import contextvars
import functools
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from shard.nn import partition, splash
from shard.nn.masks import chunk_segments, chunks, effective, fixed, visible, windows
from shard.errors import UserError

# jax.ad_checkpoint.checkpoint_name's names for attention's inputs and output, which remat policies keep or drop.
QUERY, KEY, VALUE, OUTPUT = "query", "key", "value", "attention"

# Every attention call is a jitted function of (q, k, v), and a packed batch's segment ids, with one of these
# names (a sliding window's or chunk's size after them, or a stack's and how many layers have each), so that
# shard/core/flops.py finds it in a step's jaxpr and counts its FLOPs from the shapes, whichever kernel runs
# inside (fused ones have no matrix product to count).
CAUSAL_NAME, FULL_NAME, WINDOW, WINDOWS = "shard_attention_causal", "shard_attention_full", "_window", "_windows"
CHUNK, CHUNKS = "_chunk", "_chunks"  # after the window's part: a chunk size, or a stack's with their layer counts

CUDNN_DTYPES = ("bfloat16", "float16")
MASKED = -0.7 * float(np.finfo(np.float32).max)  # JAX's large negative for masked logits (finite: no NaN)


@dataclass(frozen=True)
class Settings:
    precision: str = "float32"  # train.attention_precision
    device: object = None       # the job's device (None: the active mesh's, else JAX's default backend)


_SETTINGS: contextvars.ContextVar = contextvars.ContextVar("shard_attention_settings", default=Settings())


@contextlib.contextmanager
def configured(precision: str = "float32", device=None):
    """While tracing: the XLA kernel's precision, and the device the step is compiled for (a run.target's
    compile-only device is not JAX's default backend, which is the CPU then)."""
    token = _SETTINGS.set(Settings(precision, device))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def family(device) -> str:
    """tpu, nvidia (an NVIDIA GPU: cuDNN), gpu (another) or cpu."""
    if device.platform == "tpu":
        return "tpu"
    if device.platform in ("gpu", "cuda", "rocm"):
        return "nvidia" if device.platform == "cuda" or "nvidia" in device.device_kind.lower() else "gpu"
    return "cpu"


def _device():
    if (device := _SETTINGS.get().device) is not None:
        return device
    if (active := partition.active()) is not None:
        return active[0].devices.flat[0]
    return jax.devices()[0]


def check(kernel: str, device, dtype) -> None:
    """Fail early, in one line, when an explicit `train.attention` cannot run on this device and dtype."""
    where = family(device)
    if kernel == "cudnn" and (where != "nvidia" or str(dtype) not in CUDNN_DTYPES):
        raise UserError(f"train.attention=cudnn needs an NVIDIA GPU and train.dtype=bfloat16, got a "
                        f"{device.platform} device and {dtype}; use train.attention=auto or xla")
    if kernel == "splash" and where != "tpu":
        raise UserError(f"train.attention=splash is a TPU kernel (Pallas' Mosaic), got a {device.platform} device; "
                        "use train.attention=auto or xla")


def capped(scores, softcap: float | None):
    """Attention-logit soft-capping (Gemma 2's): softcap * tanh(scores / softcap), in the scores' dtype."""
    if softcap is None:
        return scores
    cap = jnp.asarray(softcap, scores.dtype)
    return cap * jnp.tanh(scores / cap)


# ----------------------------------------------------------------------------- choosing

def _cudnn_misfit(q, k, segments, window, is_causal, softcap=None, sinks=None, chunk=None) -> str:
    """Why cuDNN's fused attention cannot take this call ("" if it can; its dtype is `check`'s)."""
    if q.shape[-1] > 128 or q.shape[-1] % 8:
        return f"a head size <= 128 and a multiple of 8, got {q.shape[-1]}"
    if segments is not None:
        return "no segment ids (data.packing=documents): jax.nn.dot_product_attention's cuDNN path takes none"
    if window is not None and any(w for w, _ in windows(window)[1]) and not is_causal:
        return "a causal mask with a sliding window (cuDNN's window looks back only)"
    if softcap is not None:
        return "no attention-logit soft-capping (jax.nn.dot_product_attention's cuDNN path has none)"
    if sinks is not None:
        return "no attention sinks (jax.nn.dot_product_attention's cuDNN path has none; splash's kernel takes them)"
    if chunk is not None and any(c for c, _ in chunks(chunk, is_causal, window)[1]):
        return ("no chunked attention (attention_chunk_size: jax.nn.dot_product_attention's cuDNN path has no chunk "
                "mask; XLA's and splash's kernels take it)")
    return ""


def choose(kernel: str, q, k, segments=None, window=None, is_causal=True, device=None, softcap=None,
           sinks=None, chunk=None) -> str:
    """The kernel that runs this call: `auto` resolved by the device and the call's shapes; an explicit cudnn
    or splash that cannot take the call refused in one line (the device itself is checked by `check`). Splash's
    kernel takes attention sinks (its online softmax starts from them) and chunks (its ChunkedCausalMask), cuDNN's
    neither."""
    misfit = lambda: _cudnn_misfit(q, k, segments, window, is_causal, softcap, sinks, chunk)  # noqa: E731
    if kernel == "auto":
        where = family(device or _device())
        if where == "tpu" and not splash.misfit(q, k):
            return "splash"
        if where == "nvidia" and str(q.dtype) in CUDNN_DTYPES and not misfit():
            return "cudnn"
        return "xla"
    why = misfit() if kernel == "cudnn" else splash.misfit(q, k) if kernel == "splash" else ""
    if why:
        raise UserError(f"train.attention={kernel} needs {why}; use train.attention=auto or xla")
    return kernel


def run(q, k, v, is_causal: bool, kernel: str, segments=None, window=None, softcap: float | None = None,
        scale: float | None = None, sinks=None, chunk=None, places=None) -> jax.Array:
    """Attention over (batch, length, heads, head_dim) arrays with `kernel` (auto resolved here). `segments`
    (batch, length): a packed batch's document ids, a query seeing only its own document's keys. `window`: a
    query sees only the `window` nearest keys on each side, itself included (causal: the latest ones); None, an
    int or (value, windows) as `windows` reads it. `softcap`: the logits soft-capped (`capped`) before the mask
    and softmax. `scale`: the factor on q.k (None: 1/sqrt(head_dim)). `sinks` (heads,): each query head's sink
    logit, one more in its softmax, weighing no value (`sink_logits`; None: none), a traced argument. `chunk`:
    Llama 4's chunked attention (shard/nn/masks.py), read as a window is; over packed rows by each token's
    position in its document (`places`, (batch, length); None: found from the segment ids)."""
    value, sizes = windows(window)
    cut, cuts = chunks(chunk, is_causal, window)
    if softcap is not None and not softcap > 0:
        raise UserError(f"attention: a logit soft-cap of {softcap}; it must be a positive number")
    kernel = choose(kernel, q, k, segments, window, is_causal, softcap=softcap, sinks=sinks, chunk=chunk)
    precision = _SETTINGS.get().precision if kernel == "xla" else "float32"
    layout = splash.layout(q.shape, k.shape) if kernel == "splash" else None
    cpu = kernel == "xla" and family(_device()) == "cpu"
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    softcap = None if softcap is None else float(softcap)
    places = None if segments is None or not any(c for c, _ in cuts) else places  # chunked packed rows' only
    # Everything the trace depends on is a static argument: JAX caches a jitted function's trace by its
    # arguments, not by the context (mesh, rules, settings) it was traced under.
    return _named(bool(is_causal), sizes, cuts, softcap, scale)(q, k, v, segments, value, sinks, cut, places,
                                                                kernel=kernel, precision=precision, layout=layout,
                                                                cpu=cpu)


@functools.cache
def _named(is_causal: bool, sizes: tuple, cuts: tuple, softcap: float | None, scale: float):
    def fn(q, k, v, segments, value, sinks, cut, places, kernel, precision, layout, cpu):  # flops.py reads q, k, v
        chunk = effective(cut, cuts)
        if segments is not None and chunk is not None:  # packed rows: each document's chunks documents of their own
            segments, chunk = chunk_segments(segments, places, chunk), None
        static = functools.partial(_static, kernel=kernel, precision=precision, layout=layout, cpu=cpu)
        if kernel == "xla" or (value is None and isinstance(chunk, (int, type(None)))):  # XLA masks by a traced one
            return static(q, k, v, segments, sinks, effective(value, sizes), chunk)
        # a fused kernel takes a static window and chunk: one call compiled per distinct one (a call has a window or
        # a chunk, not both: masks.chunks), the layer's chosen by its value
        picked, spec = (value, sizes) if value is not None else (chunk, cuts)
        index = sum(jnp.where(picked == w, i, 0) for i, (w, _) in enumerate(spec))
        branches = [functools.partial(static, window=w or None, chunk=None) if value is not None
                    else functools.partial(static, window=None, chunk=w or None) for w, _ in spec]
        return jax.lax.switch(index, branches, q, k, v, segments, sinks)

    def _static(q, k, v, segments, sinks, window, chunk, kernel, precision, layout, cpu):
        if kernel == "splash":
            return splash.splash(q, k, v, is_causal, segments, window, layout=layout, softcap=softcap, scale=scale,
                                 sinks=sinks, chunk=chunk)
        options = dict(scale=scale, softcap=softcap, sinks=sinks, chunk=chunk)
        if kernel == "xla" and cpu:
            return xla_cpu(q, k, v, is_causal, segments, window, precision, **options)
        traced = not isinstance(window, (int, type(None)))
        if kernel == "xla" and (precision == "bfloat16" or softcap is not None or traced or sinks is not None
                                or chunk is not None):
            return xla_grouped(q, k, v, is_causal, segments, window, precision, **options)
        # XLA's own (float32 logits and softmax) or cuDNN's fused kernel
        mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
        sides = None if window is None else (window - 1, 0 if is_causal else window - 1)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=is_causal,
                                            local_window_size=sides, implementation=kernel)

    name = (CAUSAL_NAME if is_causal else FULL_NAME) + _suffix(sizes, WINDOW, WINDOWS) + _suffix(cuts, CHUNK, CHUNKS)
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn, static_argnames=("kernel", "precision", "layout", "cpu"))


def _suffix(sizes: tuple, one: str, several: str) -> str:
    """The name's part for a window's or chunk's sizes: "" (none), `one` and the size, or `several` and each size
    with its layer count."""
    if len(sizes) > 1:
        return several + "_".join(f"{w}x{n}" for w, n in sizes)
    return f"{one}{fixed(sizes)}" if fixed(sizes) else ""


_CALL = re.compile(r"(?P<base>{}|{})(?:{}(?P<w>\d+)|{}(?P<ws>\d+x\d+(?:_\d+x\d+)*))?(?:{}(?P<c>\d+)|{}(?P<cs>\d+x\d+"
                   r"(?:_\d+x\d+)*))?".format(CAUSAL_NAME, FULL_NAME, WINDOW, WINDOWS, CHUNK, CHUNKS))


def call_of(name: str) -> tuple | None:
    """(is_causal, window, chunk) of a jitted attention call by its name, else None (shard/core/flops.py): each of
    window and chunk None, an int, or ((size, layers), ...) for a stack's (0: none)."""
    if not (found := _CALL.fullmatch(name)):
        return None
    read = lambda one, several: (int(one) if one else None if several is None else  # noqa: E731
                                 tuple(tuple(int(n) for n in p.split("x")) for p in several.split("_")))
    return found["base"] == CAUSAL_NAME, read(found["w"], found["ws"]), read(found["c"], found["cs"])


def flops(q_shape, k_shape, v_shape, is_causal: bool, window=None, chunk=None) -> float:
    """Forward FLOPs of one attention call: the scores Q.K^T and the weighted sum P.V, 2 FLOPs per
    multiply-add, over the (query, key) pairs the output depends on. Causal attention counts only the
    pairs on or below the diagonal (L(L+1)/2 of L^2 for equal lengths), a window only the pairs inside it, a chunk
    only the pairs inside a query's chunk: the work actually needed, which is what a fused kernel does; XLA's own
    computes the full square. `window` or `chunk` ((size, layers), ...), a stack's: the mean over its layers (the
    call runs once a layer). Positions as in a row (a packed batch's documents are not counted apart)."""
    if isinstance(window, tuple):
        return sum(n * flops(q_shape, k_shape, v_shape, is_causal, w or None, chunk) for w, n in window) / sum(
            n for _, n in window)
    if isinstance(chunk, tuple):
        return sum(n * flops(q_shape, k_shape, v_shape, is_causal, window, c or None) for c, n in chunk) / sum(
            n for _, n in chunk)
    batch, q_len, heads, head_dim = q_shape
    k_len, v_dim = k_shape[1], v_shape[-1]
    i = np.arange(q_len, dtype=np.int64)  # query i sees keys lo..hi (JAX's causal mask aligned at the top left)
    reach = k_len if window is None else window - 1
    hi = np.minimum(i if is_causal else i + reach, k_len - 1)
    lo = np.maximum(i - reach, 0) if window is not None else 0
    lo = lo if chunk is None else np.maximum(lo, i // chunk * chunk)  # its chunk's first position
    pairs = int(np.maximum(hi - lo + 1, 0).sum())
    return 2.0 * batch * heads * pairs * (head_dim + v_dim)


# ----------------------------------------------------------------------------- xla

def _visible(t: int, s: int, is_causal: bool, window, chunk=None):
    """(t, s): which keys each query sees by position in a row (None: all); a traced window or chunk gives a traced
    mask."""
    return visible(np.arange(t), np.arange(s), is_causal, window, chunk)


def sink_logits(sinks, kv_heads: int):
    """(kv_heads, group, 1) float32: each query head's sink logit (GPT-OSS's attention sinks, a (heads,) array) laid
    out as the grouped kernels lay out heads (head = kv_head * group + g), to broadcast against a row of scores;
    None without sinks."""
    return None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(kv_heads, -1, 1)


def _softmax_values(scores, mask, v, product, precision, sink=None):
    """softmax(scores) . v over the last axis of scores, where `product(p, v)` is the weighted sum. float32:
    JAX's softmax on float32 logits. bfloat16 (MaxText's): exp(s - max) in bfloat16, its product with v,
    then division by the row sums accumulated in float32; no (rows, keys) array is normalised or kept in float32.
    `sink` (broadcasting to scores[..., :1]): one more logit in each row's softmax, whose value is zero: it adds
    to the denominator only (a row that sees no key comes out zero, not the mean of its masked values)."""
    if mask is not None:
        scores = jnp.where(mask, scores, MASKED)
    if precision == "float32" and sink is None:
        return product(jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)
    peak = scores.max(axis=-1, keepdims=True)
    peak = jax.lax.stop_gradient(peak if sink is None else jnp.maximum(peak, sink.astype(peak.dtype)))  # any shift
    weights = jnp.exp(scores - peak)
    total = weights.sum(axis=-1, keepdims=True, dtype=jnp.float32)
    if sink is not None:
        total = total + jnp.exp(sink - peak.astype(jnp.float32))
    if precision == "float32":
        return product((weights / total).astype(v.dtype), v)
    return product(weights, v.astype(weights.dtype), jnp.float32) / total


def _logits(q, k, spec: str, precision: str):
    """The scores Q.K^T: float32 (from inputs of any dtype), or bfloat16 inputs and outputs."""
    if precision == "bfloat16":
        return jnp.einsum(spec, q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), preferred_element_type=jnp.bfloat16)
    return jnp.einsum(spec, q, k, preferred_element_type=jnp.float32)


def xla_cpu(q, k, v, is_causal, segments=None, window=None, precision="float32", scale=None, softcap=None,
            sinks=None, chunk=None):
    """The XLA kernel written so XLA's CPU backend compiles it faster: the scale applied to the queries rather
    than the scores, the causal mask one (length, length) table rather than a mask the size of the scores, and
    the products as 3-D batched products over (batch x key/value heads) with a query head's group folded into
    its rows, rather than 4-D products and a vmap over groups. The default GPT's step on 2 cores: 62.9 -> 59.6
    ms for the first two, about 2 ms more for the 3-D products (bench/RESULTS.md). `scale` (None: 1/sqrt(head_dim)),
    `softcap` and `sinks` as `run` takes them; a window or `chunk` may be a traced int (0: none), by row place."""
    b, t, heads, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads  # query heads per key/value head (heads = kv_head * groups + group, as JAX's)
    q = q * jnp.asarray(d ** -0.5 if scale is None else scale, q.dtype)
    q = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4).reshape(b * kv_heads, groups * t, d)
    k, v = (a.transpose(0, 2, 1, 3).reshape(b * kv_heads, s, a.shape[-1]) for a in (k, v))
    scores = capped(_logits(q, k, "nqd,nsd->nqs", precision), softcap)
    mask = _visible(t, s, is_causal, window, chunk)
    mask = None if mask is None else jnp.tile(mask, (groups, 1))
    if segments is not None:  # packed rows: a query sees its own document's keys only
        same = segments[:, :, None] == segments[:, None, :]  # (b, t, s)
        same = jnp.broadcast_to(same[:, None, None], (b, kv_heads, groups, t, s)).reshape(b * kv_heads, groups * t, s)
        mask = same if mask is None else mask & same
    product = lambda p, v, acc=None: jnp.einsum("nqs,nsd->nqd", p, v, preferred_element_type=acc)  # noqa: E731
    sink = sink_logits(sinks, kv_heads)  # each row's, as the query rows lie: (b x kv_heads, groups x t, 1)
    sink = None if sink is None else jnp.broadcast_to(sink, (b, kv_heads, groups, t)).reshape(b * kv_heads, -1, 1)
    out = _softmax_values(scores, mask, v, product, precision, sink).astype(v.dtype)
    return out.reshape(b, kv_heads, groups, t, -1).transpose(0, 3, 1, 2, 4).reshape(b, t, heads, -1)


def xla_grouped(q, k, v, is_causal, segments=None, window=None, precision="bfloat16", scale=None, softcap=None,
                sinks=None, chunk=None):
    """The XLA kernel on any device with a query head's group as its own axis (each array keeps the batch and
    head axes the mesh splits): train.attention_precision=bfloat16 off the CPU, a soft-cap, a traced window,
    sinks, a chunk (jax.nn.dot_product_attention has none of the last three)."""
    t, s = q.shape[1], k.shape[1]
    mask = _visible(t, s, is_causal, window, chunk)
    if segments is not None:  # packed rows, as in xla_cpu
        same = (segments[:, :, None] == segments[:, None, :])[:, None, None]  # (b, 1, 1, t, s)
        mask = same if mask is None else mask & same
    return grouped(q, k, v, mask, precision, scale, softcap, sinks)


def grouped(q, k, v, mask, precision="float32", scale=None, softcap=None, sinks=None):
    """softmax(capped(scale q.k)) . v with a mask that broadcasts to (batch, kv_heads, group, queries, keys) (None:
    none), and each query head's sink logit (`sinks`) in its softmax, written for XLA: xla_grouped's, context
    parallelism's over gathered keys and values, generation's."""
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = (q * jnp.asarray(d ** -0.5 if scale is None else scale, q.dtype)).reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = capped(_logits(qg, k, "btkgd,bskd->bkgts", precision), softcap)
    product = lambda p, v, acc=None: jnp.einsum("bkgts,bskd->bkgtd", p, v, preferred_element_type=acc)  # noqa: E731
    sink = sink_logits(sinks, kv_heads)
    out = _softmax_values(scores, mask, v, product, precision, None if sink is None else sink[..., None])
    return out.astype(v.dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, heads, -1)
