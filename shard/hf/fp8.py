"""Checkpoints in fine-grained FP8 (`quantization_config.quant_method: fp8`, DeepSeek-V3's and R1's, Qwen3's -FP8
folders): a Linear's `weight` stored as float8 (e4m3) and beside it `weight_scale_inv`, one float per block of the
weight (its grid: rows and columns each split evenly, 128 x 128 as config.json's weight_block_size says). Read here as
the float tensor transformers dequantizes them into (the float8 value times its block's scale, in float32), so the
folder's tables read it like any other (shard/hf/tables.py); tensors without a scale are read as stored."""

import json
import struct

import ml_dtypes
import numpy as np

from shard.errors import UserError

SCALE = "_scale_inv"


def packed(names) -> dict[str, tuple[str, str]]:
    """The weights a folder holds in FP8: name -> (the weight's name, its scale's name)."""
    names = set(names)
    return {n[:-len(SCALE)]: (n[:-len(SCALE)], n) for n in names if n.endswith(SCALE) and n[:-len(SCALE)] in names}


def shape(weight: tuple, scales: tuple, name: str, where: str) -> tuple:
    """The weight's shape, once its scales are checked to split it into whole blocks."""
    if len(weight) != 2 or len(scales) != 2 or any(not s or n % s for n, s in zip(weight, scales)):
        raise UserError(f"{where}: {name} {list(weight)} and {name}{SCALE} {list(scales)} are not an FP8 weight and "
                        "its scales (rows and columns each split into whole blocks, one scale a block)")
    return weight


def read(read_tensor, names: tuple[str, str], index: tuple, full: tuple, scales: tuple) -> np.ndarray:
    """The block `index` (slices over the weight) of the dequantized weight of `full` shape, reading only the scales
    it touches: read_tensor(name, index) reads a block of a stored tensor."""
    rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip(index + (slice(None),) * 2, full))
    tall, wide = full[0] // scales[0], full[1] // scales[1]  # each block's rows and columns
    values = np.asarray(read_tensor(names[0], (rows, cols))).astype(np.float32)
    grid = np.asarray(read_tensor(names[1], (slice(rows.start // tall, (rows.stop - 1) // tall + 1),
                                             slice(cols.start // wide, (cols.stop - 1) // wide + 1))), np.float32)
    at_rows = np.arange(rows.start, rows.stop) // tall - rows.start // tall
    at_cols = np.arange(cols.start, cols.stop) // wide - cols.start // wide
    return values * grid[at_rows][:, at_cols]


def read_codes(file, stored: str, index: tuple) -> np.ndarray:
    """A block of a float8 e4m3 tensor from its safetensors file, memory-mapped (safetensors' own readers take no
    float8 into numpy): the file's header gives the tensor's place, ml_dtypes (JAX's) the dtype."""
    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(size))[stored]
    start, end = entry["data_offsets"]
    codes = np.memmap(file, dtype=ml_dtypes.float8_e4m3fn, mode="r", offset=8 + size + start,
                      shape=tuple(entry["shape"]))
    return np.asarray(codes[index])
