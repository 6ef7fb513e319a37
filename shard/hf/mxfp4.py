"""GPT-OSS's checkpoints store each layer's experts in MXFP4 (the OCP microscaling format): for a weight
`experts.gate_up_proj`, a tensor `..._blocks` (experts, out, groups, 16) of bytes, each two 4-bit E2M1 codes (the
low nibble first), and `..._scales` (experts, out, groups) of bytes, each a power of two for its group of 32 values
(the exponent biased by 127). Read here as the float tensor transformers dequantizes them into, (experts, in,
out): the folder's tables then read it like any other (shard/hf/tables.py). The values are exact in float32 (a code
times a power of two), so any dtype the run asks for is the same rounding transformers makes from them."""

import math

import numpy as np

from shard.errors import UserError

CODES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
GROUP = 32  # values per scale
BIAS = 127  # the scales' exponent bias
BLOCKS, SCALES = "_blocks", "_scales"


def method(config: dict, where: str) -> str | None:
    """A folder's quantization_config's quant_method (None: none), one line for one nothing here reads."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if method not in ("mxfp4", "fp8"):
        raise UserError(f"{where}: config.json has quantization_config quant_method={method!r}; only mxfp4 (GPT-OSS's "
                        "experts) and fp8 (block-scaled: DeepSeek's, the -FP8 folders') are read: load an unquantized "
                        "copy, or quantize here with train.quantize")
    return method


def packed(names) -> dict[str, tuple[str, str]]:
    """The weights a folder holds packed: name -> (its blocks' name, its scales' name)."""
    names = set(names)
    return {n[:-len(BLOCKS)]: (n, n[:-len(BLOCKS)] + SCALES) for n in names
            if n.endswith(BLOCKS) and n[:-len(BLOCKS)] + SCALES in names}


def shape(blocks: tuple, scales: tuple, name: str, where: str) -> tuple:
    """The dequantized weight's shape (experts, in, out) from its blocks' (experts, out, groups, 16)."""
    if len(blocks) != 4 or blocks[-1] != GROUP // 2 or tuple(scales) != tuple(blocks[:-1]):
        raise UserError(f"{where}: {name}{BLOCKS} {list(blocks)} and {name}{SCALES} {list(scales)} are not MXFP4 "
                        f"blocks (experts, rows, groups, {GROUP // 2}) and their scales (experts, rows, groups)")
    n, out, groups, _ = blocks
    return n, groups * GROUP, out


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(..., groups, 16) bytes and (..., groups) exponents -> (..., groups x 32) float32."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], GROUP)
    values = np.ldexp(CODES[codes], scales.astype(np.int32)[..., None] - BIAS)
    return values.reshape(*blocks.shape[:-2], -1)


def read(read_tensor, names: tuple[str, str], index: tuple, full: tuple) -> np.ndarray:
    """The block `index` (slices over (experts, in, out)) of the dequantized weight of `full` shape, reading only
    the groups it touches: read_tensor(name, index) reads a block of a stored tensor."""
    experts, rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip(index + (slice(None),) * 3, full))
    first, last = rows.start // GROUP, math.ceil(rows.stop / GROUP)
    blocks = read_tensor(names[0], (experts, cols, slice(first, last), slice(None)))
    scales = read_tensor(names[1], (experts, cols, slice(first, last)))
    values = dequantize(blocks, scales)[..., rows.start - first * GROUP:rows.stop - first * GROUP]
    return values.transpose(0, 2, 1)
