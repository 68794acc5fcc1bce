"""MXFP4, the format gpt-oss's Hub checkpoints store their experts' projections in:
`<name>_blocks` [..., rows, groups, 16] uint8, two 4-bit (E2M1) values a byte, low
nibble first, and `<name>_scales` [..., rows, groups] uint8, one power-of-two exponent
(biased by 127) per group of 32 values. `dequantize` turns the pair back into the
unquantised tensor HF's `convert_moe_packed_tensors` gives ([..., groups * 32, rows]:
the last two axes swapped, as `<name>` is stored unquantised). numpy only: no JAX."""

from __future__ import annotations

import numpy as np

# The 16 values of a 4-bit E2M1 code (sign bit highest).
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
GROUP = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks' shape, scales' shape) of an unquantised tensor of `shape` [..., in, out]
    (the groups run along `in`)."""
    *lead, inner, outer = shape
    if inner % GROUP:
        raise ValueError(f"MXFP4 groups of {GROUP} values do not divide {inner}")
    return (*lead, outer, inner // GROUP, GROUP // 2), (*lead, outer, inner // GROUP)


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """The float tensor [..., groups * 32, rows] of MXFP4 `blocks` and `scales`, computed
    in float32 (every MXFP4 value times its power of two is exact there) and cast; one
    leading index (an expert) at a time, so the float32 temporaries stay one expert's."""
    blocks = np.asarray(blocks, np.uint8)
    scales = np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    *lead, rows, groups, width = blocks.shape
    exponents = scales.astype(np.int32) - 127
    out = np.empty((*lead, groups * width * 2, rows), dtype)
    for index in np.ndindex(*lead):
        values = _PAIRS[blocks[index]].reshape(rows, groups, width * 2)  # a byte: 2 values
        # ldexp, not a product with 2 ** e: 2 ** 128 overflows where 0.5 * 2 ** 128 does not.
        with np.errstate(over="ignore"):  # as transformers: a huge scale gives inf
            np.ldexp(values, exponents[index][..., None], out=values)
        out[index] = values.reshape(rows, groups * width * 2).T.astype(dtype)
    return out


# Each byte's two values, low nibble first: one gather per byte instead of two.
_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]],
                  axis=-1)
