"""A frozen base stored quantized (QLoRA, `train.lora.base=nf4|int4|int8|fp8`), or in bfloat16.

Every floating matrix of the model (two or more dimensions besides a stack's `layers`: embeddings, attention,
the feed-forward block, experts, the output layer) is quantized once with qwix, in blocks of 64 along its last
dimension (one scale per block and per index of every other dimension: per layer, per head, per row), absmax
scaled (fp8: float8 e4m3 codes, a block's absmax at 448, as DeepSeek-V3's and the -FP8 checkpoints hold their weights,
in blocks of their own: a folder's FP8 weights are read dequantized, shard/hf/fp8.py, then coded in these blocks);
biases and norm weights (vectors, or marked by `role` metadata: a per-head bias, a projection-wide norm) and weights
marked `full_precision` (a router) stay as they are (`quantizable`, serving's rule too). int8 and fp8 codes keep
the weight's shape; 4-bit ones (int4 as code + 8, nf4's 0..15) are packed two to a uint8 along the last dimension,
which halves it. We pack them ourselves: XLA's own int4 arrays came out of the init with
unpacked layouts that the compiled step refused (XLA:CPU), and Orbax does not store uint4. Codes and scales carry
the weight's logical names, so they are split like the weight on every mesh (a name dropped where the mesh does
not divide the packed or blocked dimension). The step dequantizes them (float32, scale x value): a stack's
weights inside the stack, a layer at a time (shard/strategies/deferred.py), the others before the model.
"""

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src.core import numerics

from shard.nn.partition import logical_names, logical_to_spec, path_keys, plays_vector

KINDS = ("int8", "int4", "nf4", "fp8")
FLOATS = ("float32", "bfloat16")
QTYPE = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4", "fp8": jnp.float8_e4m3fn}
WHOLE = ("int8", "fp8")  # codes a byte each, kept in the weight's shape (the 4-bit ones are packed)
BLOCK = 64
SHIFT = {"int4": 8, "nf4": 0}  # a 4-bit code's offset to 0..15


def quantizable(var) -> bool:
    """Whether quantizing a model (a QLoRA base, --quantize) may store this parameter coded: a floating matrix (two
    or more dimensions besides a stack's `layers`) that a product uses. Not a bias or norm weight, which its model
    marks (`role`) since its rank cannot tell (a per-head bias, OLMo 2's projection-wide q/k norm: an outlier's
    block scale would round the rest to 0), nor a weight marked `full_precision` (a router's top-k choice)."""
    value = var.get_value()
    names = logical_names(var) or (None,) * value.ndim
    meta = var.get_metadata()
    return (jnp.issubdtype(value.dtype, jnp.floating) and sum(n != "layers" for n in names) >= 2
            and not plays_vector(var) and not meta.get("full_precision"))


def quantizes(var) -> bool:
    """Whether a parameter is stored quantized: `quantizable`, its last dimension even (two 4-bit codes a byte)."""
    return quantizable(var) and var.get_value().shape[-1] % 2 == 0


def block(shape) -> int:
    """The block along the last dimension: 64 where it divides it, else the whole dimension."""
    return BLOCK if shape[-1] % BLOCK == 0 else shape[-1]


def _names(names, shape, mesh_shape: dict, rules: dict) -> tuple:
    """The weight's names for its codes or scales, a dimension's name dropped where its mesh axes do not divide it."""
    if not mesh_shape:  # no mesh: the names as they are
        return tuple(names)
    spec = logical_to_spec(names, rules, mesh_shape)
    out = []
    for name, size, entry in zip(names, shape, spec):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        ways = 1
        for a in axes:
            ways *= mesh_shape.get(a, 1)
        out.append(name if size % ways == 0 else None)
    return tuple(out)


def _each(params, fn):
    return jax.tree_util.tree_map_with_path(fn, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _put(tree: dict, keys: tuple, value) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def scale_of(scales: dict, path) -> "nnx.Param | None":
    """The scales of the weight at this parameter path (a tree path), None for one stored as it is."""
    return _get(scales, path_keys(path))


def _get(tree: dict, keys: tuple):
    for k in keys:
        tree = tree.get(k) if isinstance(tree, dict) else None
    return tree


def quantize(params, kind: str, mesh_shape: dict, rules: dict):
    """(codes, scales): `params` with each quantized matrix's value replaced by its codes, and the scales as
    a nested dict by the matrices' paths (nnx.Params, float32). bfloat16: the floats cast, no scales."""
    if kind in FLOATS:  # a weight marked full_precision keeps float32 (transformers' _keep_in_fp32_modules)
        cast = lambda p, v: v.replace(v.get_value().astype(kind)) if isinstance(v, nnx.Variable) and \
            jnp.issubdtype(v.get_value().dtype, jnp.floating) and not v.get_metadata().get("full_precision") else v
        return _each(params, cast), {}
    scales: dict = {}

    def one(path, var):
        if not isinstance(var, nnx.Variable) or not quantizes(var):
            return var
        w = var.get_value().astype(jnp.float32)
        axes = dict(channelwise_axes=tuple(range(w.ndim - 1)), tiled_axes={w.ndim - 1: block(w.shape)})
        if kind == "nf4":  # qwix's absmax scale (the int8 one's times its bound), then the code book's nearest entry
            scale = qwix.quantize(w, jnp.int8, **axes).scale * numerics.get_symmetric_bound(jnp.int8)
            q = qwix.QArray(nf4_codes(w / jnp.repeat(scale, block(w.shape), axis=-1)), scale, None, "nf4")
        else:
            q = qwix.quantize(w, QTYPE[kind], **axes)
        codes = q.qvalue if kind in WHOLE else pack(q.qvalue.astype(jnp.int8) + SHIFT[kind])
        names = logical_names(var)
        with nnx.use_eager_sharding(False):  # logical names, mapped by the rules
            if names is None:  # a model without logical names: nor have its codes and scales (the automatic rule)
                _put(scales, path_keys(path), nnx.Param(q.scale))
                return var.replace(codes)
            _put(scales, path_keys(path), nnx.Param(q.scale, out_sharding=_names(names, q.scale.shape,
                                                                                   mesh_shape, rules)))
            return nnx.Param(codes, out_sharding=_names(names, codes.shape, mesh_shape, rules))

    return _each(params, one), scales


# nf4 coded elementwise, each array keeping its shape: qwix's own fp_to_nf4 / nf4_to_fp map over the array
# raveled, which under a sharded layout is the whole weight in one piece, and its encoder's argmin holds 16
# distances per weight (the TPU compiler asked 513 GiB a chip of temporaries for a Llama-3-8B shape on v5p-8).


def nf4_codes(x):
    """The nearest code (0..15, int8) of values in [-1, 1]: how many midpoints between entries lie below."""
    book = numerics.get_nf4_buckets()  # qwix's code book (QLoRA's Appendix E); called here, not at import: JAX starts
    mids = (book[1:] + book[:-1]) / 2
    return sum((x > m).astype(jnp.int8) for m in mids)


def nf4_values(codes):
    """The code book's values of codes 0..15, as a chain of selects (elementwise, fused with what uses it)."""
    book = numerics.get_nf4_buckets()
    out = jnp.zeros(codes.shape, jnp.float32)
    for i in range(1, 16):
        out = jnp.where(codes == i, book[i], out)
    return jnp.where(codes == 0, book[0], out)


def pack(codes):
    """4-bit codes (0..15, int8) two to a uint8 along the last dimension: even indices low, odd high."""
    c = codes.astype(jnp.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed):
    """The codes (0..15, int8) `pack` stored."""
    both = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(jnp.int8)


def dequantize(params, scales: dict, kind: str):
    """The float32 weights the codes and scales stand for (the bfloat16 base: its values as float32)."""
    def one(path, var):
        if not isinstance(var, nnx.Variable) or not jnp.issubdtype(var.get_value().dtype, jnp.number):
            return var
        scale = _get(scales, path_keys(path))
        value = var.get_value()
        if scale is None and not jnp.issubdtype(value.dtype, jnp.floating):
            return var
        return var.replace(dequantize_value(value, None if scale is None else scale[...], kind))

    return _each(params, one)


def dequantize_value(value, scale, kind: str):
    """One weight as float32: its codes times their scales (scale None: a float weight, cast)."""
    if scale is None:
        return value.astype(jnp.float32)
    if kind == "nf4":
        return nf4_values(unpack(value)) * jnp.repeat(scale, block(value.shape[:-1] + (2 * value.shape[-1],)), axis=-1)
    codes = value if kind in WHOLE else (unpack(value) - SHIFT[kind]).astype(jnp.int4)
    return qwix.dequantize(qwix.QArray(codes, scale, None, QTYPE[kind]))


def stored_bytes(tree) -> int:
    """Bytes of one device's shards of an abstract tree in its stored types."""
    bits = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else leaf.shape
        n = 1
        for d in shape:
            n *= d
        bits += n * jax.dtypes.itemsize_bits(leaf.dtype)
    return bits // 8
