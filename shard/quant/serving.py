"""Weight-only post-training quantization at load time (`python -m shard.serve|shard.generate ... --quantize
int8|int4`), with qwix: each floating matrix of the loaded model (two or more dimensions besides a stack's
`layers`: embeddings, attention, the feed-forward block, experts, the output layer) is held as qwix's QArray,
absmax scaled: int8 with one scale per row of its last dimension, int4 in groups of 128 along it (the whole
dimension where 128 does not divide it). Biases, norm weights, weights marked `full_precision` (a router) and a
layer's own settings stay as they are: QLoRA's rule (shard/quant/base.py's `quantizable`). The compiled prefill
and decoding programs dequantize the weights (code x scale) and cast them to the compute dtype before the model,
which runs unchanged; activations are not quantized.
"""

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from shard.errors import UserError
from shard.quant.base import quantizable

KINDS = ("int8", "int4")
QTYPE = {"int8": jnp.int8, "int4": jnp.int4}
GROUP = 128  # int4's scale group along a matrix's last dimension


def quantized(value, kind: str) -> qwix.QArray:
    last = value.shape[-1]
    tile = GROUP if kind == "int4" and last % GROUP == 0 else last
    return qwix.quantize(value.astype(jnp.float32), QTYPE[kind], channelwise_axes=tuple(range(value.ndim - 1)),
                         tiled_axes={value.ndim - 1: tile})


def quantize_state(state, kind: str):
    """`state` (a model's nnx.State) with each floating matrix's value a QArray of `kind`."""
    if kind not in KINDS:
        raise UserError(f"--quantize {kind}: choose one of {', '.join(KINDS)}")
    one = jax.jit(quantized, static_argnums=1)  # on the weight's own devices, one program per shape
    return jax.tree.map(lambda v: v.replace(one(v.get_value(), kind)) if quantizable(v) else v, state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def dequantize_state(state):
    """The float32 weights a quantized state stands for (traced inside the programs that use them)."""
    return jax.tree.map(lambda x: qwix.dequantize(x) if isinstance(x, qwix.QArray) else x, state,
                        is_leaf=lambda x: isinstance(x, qwix.QArray))


def quantize_generator(generator, kind: str | None):
    """The generator holding its model's weights as `kind` (None: as they are), dequantized in its programs."""
    if kind is None:
        return generator
    generator.state = quantize_state(generator.state, kind)
    generator.weights = dequantize_state
    return generator


def add_argument(parser) -> None:
    """--quantize, for the command lines that load a model to generate with (shard.generate, shard.serve)."""
    parser.add_argument("--quantize", choices=KINDS, help="hold the weights as int8 or int4 (weight-only, "
                        "dequantized in the compiled programs; shard/quant/serving.py); default: as trained")
