"""Float8 activations with one float32 scale per stored token: the format's one definition.

A hook captured as `float8_e4m3` is stored as two arrays of the same shard layout: its
values, zarr data type "float8_e4m3fn" [rows, seq_len, hidden], and its scales
`<hook>.scale`, float32 [rows, seq_len, 1]. A token's value is `values * scale`, where the
scale is the token's absmax over the hidden axis divided by e4m3's largest finite value
(448), so the largest value of each token is stored exactly at the top of the range. A row
whose absmax is 0 (a generating run's unreached room) gets scale 1 and stays zero; a
padding position holds what the model computed there, quantised as any other token.

Why e4m3 with per-token scales, not e5m2 nor per-block scales: bench/quantised_sae.py
(bench/RESULTS.md, "Float8 activations"). Both arrays are written by the same writer,
checksummed in the same commit marker and checked by `actx verify`.

numpy and ml_dtypes are imported where used: status reads dtypes without them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# Counts changes to the scales' format (activations/actx.json's quantisation_version).
FORMAT_VERSION = 1
SCALE_SUFFIX = ".scale"
SCALE_DTYPE = "float32"
# What a reader hands over from a quantised hook: the dequantised values, in one of these.
READ_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Float8Format:
    """A capture dtype stored as float8 values with per-token scales.

    stored: the zarr v3 / tensorstore / ml_dtypes name of the values' data type.
    max_finite: the type's largest finite value, which a token's absmax maps to.
    max_relative_error: the largest relative rounding error of a normal value (half a unit
      in the last place of its 3 or 2 mantissa bits); a token's relative L2 error is below it.
    """

    stored: str
    max_finite: float
    max_relative_error: float


# The capture dtypes that store float8 (run.json's `capture.dtype`). e4m3's "fn" variant
# has no infinities, which buys the range up to 448.
FORMATS = {"float8_e4m3": Float8Format("float8_e4m3fn", 448.0, 2.0 ** -4)}


def is_quantised(dtype: str) -> bool:
    """Whether a capture dtype or a stored data type is a float8 format."""
    return dtype in FORMATS or any(f.stored == dtype for f in FORMATS.values())


def stored_dtype(dtype: str) -> str:
    """The data type an array of capture dtype `dtype` is stored in (itself, except float8
    capture dtypes: their zarr name)."""
    return FORMATS[dtype].stored if dtype in FORMATS else dtype


def format_of(dtype: str) -> Float8Format:
    """The float8 format of a capture dtype or stored data type."""
    for name, fmt in FORMATS.items():
        if dtype in (name, fmt.stored):
            return fmt
    raise ValueError(f"{dtype!r} is not a float8 format (known: {', '.join(FORMATS)})")


def scale_array(hook: str) -> str:
    """The name of the array holding a quantised hook's per-token scales."""
    return hook + SCALE_SUFFIX


def is_scale_array(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def stored_arrays(hooks: dict[str, int], dtypes: dict[str, str]) -> dict[str, tuple[int, str]]:
    """Every array stored for `hooks` (name -> last axis) whose stored data types are
    `dtypes`: name -> (last axis, data type), a float8 hook's scale array included."""
    arrays = {}
    for hook, width in hooks.items():
        dtype = stored_dtype(dtypes[hook])
        arrays[hook] = (width, dtype)
        if is_quantised(dtype):
            arrays[scale_array(hook)] = (1, SCALE_DTYPE)
    return arrays


def read_dtype(asked: str | None, where: str = "") -> str:
    """What a reader returns from a quantised hook when asked for `asked` (None: float32);
    a float8 or other dtype it cannot give is refused by name (ValueError)."""
    if asked is None:
        return "float32"
    import numpy as np

    name = np.dtype(asked).name if not isinstance(asked, str) else asked
    if name not in READ_DTYPES:
        raise ValueError(f"{where}dtype={asked!r}: a float8 run's activations are read "
                         f"dequantised, as {' or '.join(READ_DTYPES)}; ask for one of those "
                         f"(to read the stored float8 values and scales themselves, open "
                         f"the arrays with zarr-python: docs/reading.md, \"Float8 runs\")")
    return name


def dequantise(values: "np.ndarray", scale: "np.ndarray", dtype: str = "float32",
               out: "np.ndarray | None" = None) -> "np.ndarray":
    """values [..., hidden] (float8) times scale [..., 1] (float32), in `dtype` (float32 or
    bfloat16; the product is computed in float32 and rounded once); into `out` (of that
    dtype and values' shape) when given."""
    import numpy as np

    if out is None:
        out = np.empty(values.shape, _numpy_dtype(dtype))
    if (is_quantised(values.dtype.name) and values.ndim and values.flags.c_contiguous
            and out.flags.c_contiguous and dtype in READ_DTYPES):
        _dequantise_in_pieces(values, scale, dtype, out)
        return out
    # A float8 value is one of 256: a table lookup turns them into float32 several times
    # faster than ml_dtypes' cast, with the same values (`_lookup`).
    if is_quantised(values.dtype.name):
        product = out if dtype == "float32" else np.empty(values.shape, np.float32)
        _lookup(values, product)
        np.multiply(product, scale, out=product)
    else:
        product = np.multiply(values, scale, dtype=np.float32,
                              out=out if dtype == "float32" else None)
    if product is not out:
        out[...] = product
    return out


def _numpy_dtype(dtype: str) -> "np.dtype":
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


# Values per piece of `_dequantise_in_pieces`: its scratch arrays (256 KiB of float32 and
# as much of uint32) stay in the core's cache, and no piece allocates fresh pages.
_PIECE_VALUES = 1 << 16


def _dequantise_in_pieces(values: "np.ndarray", scale: "np.ndarray", dtype: str,
                          out: "np.ndarray") -> None:
    """`dequantise` of C-contiguous float8 `values` into C-contiguous `out`, a few rows at a
    time through reused scratch arrays: numpy's passes (lookup, multiply, rounding) over a
    whole batch each allocated and faulted in fresh memory and read it back from RAM."""
    import numpy as np

    hidden = values.shape[-1]
    rows = values.reshape(-1, hidden)
    scales = np.broadcast_to(scale, values.shape[:-1] + (1,)).reshape(-1, 1)
    into = out.reshape(-1, hidden)
    step = max(1, _PIECE_VALUES // max(1, hidden))
    product = None if dtype == "float32" else np.empty((min(step, len(rows)), hidden),
                                                      np.float32)
    scratch = None if product is None else np.empty(product.shape, np.uint32)
    for lo in range(0, len(rows), step):
        hi = min(lo + step, len(rows))
        piece = into[lo:hi] if product is None else product[:hi - lo]
        _lookup(rows[lo:hi], piece)
        np.multiply(piece, scales[lo:hi], out=piece)
        if product is not None:
            _round_to_bfloat16(piece, into[lo:hi], scratch[:hi - lo])


def _round_to_bfloat16(product: "np.ndarray", out: "np.ndarray",
                       scratch: "np.ndarray") -> None:
    """out[...] = float32 `product` rounded to bfloat16 to nearest even, bit for bit
    ml_dtypes' cast (NaN kept, quieted), in integer arithmetic through `scratch` (uint32,
    product's shape): half the time of the cast."""
    import numpy as np

    bits = product.view(np.uint32)
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    scratch += bits
    scratch += 0x7FFF
    np.right_shift(scratch, 16, out=out.view(np.uint16), casting="unsafe")
    nan = np.isnan(product)
    if nan.any():  # rounding would carry out of a NaN's mantissa
        out.view(np.uint16)[nan] = (bits[nan] >> 16) | 0x40


def _lookup(values: "np.ndarray", into: "np.ndarray") -> None:
    """into[...] = the float32 value of each float8 of `values` (same shape). Two bytes
    at a time where the rows hold an even number of values: numpy's take converts each
    index to a pointer-sized integer first, so one index per pair of values (a 65,536-entry
    table of pairs, 512 KiB) halves that and measured 2.5x faster than one per value."""
    import numpy as np

    stored, raw = values.dtype.name, values.view(np.uint8) if values.ndim else values
    if (values.ndim and values.shape[-1] % 2 == 0 and values.flags.c_contiguous
            and into.flags.c_contiguous):
        pairs = raw.view(np.uint16)
        np.take(_pair_table(stored), pairs, axis=0, out=into.reshape(*pairs.shape, 2),
                mode="clip")  # in range by construction; "raise" takes a temporary first
    else:
        np.take(float32_table(stored), raw.view(np.uint8), out=into, mode="clip")


_TABLES: dict = {}


def float32_table(stored: str) -> "np.ndarray":
    """float32 [256]: the value of each byte of a float8 type."""
    if stored not in _TABLES:
        import ml_dtypes
        import numpy as np

        _TABLES[stored] = np.arange(256, dtype=np.uint8).view(
            getattr(ml_dtypes, stored)).astype(np.float32)
    return _TABLES[stored]


def _pair_table(stored: str) -> "np.ndarray":
    """float32 [65536, 2]: the values of each pair of bytes of a float8 type, indexed by the
    pair read as a native uint16."""
    key = (stored, "pairs")
    if key not in _TABLES:
        import numpy as np

        pairs = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
        _TABLES[key] = float32_table(stored)[pairs]
    return _TABLES[key]


def quantise(values: "np.ndarray", dtype: str = "float8_e4m3") -> tuple["np.ndarray", "np.ndarray"]:
    """numpy's quantisation of values [..., hidden]: (float8 values, float32 scales
    [..., 1]), the rule the workers apply on the accelerator (workers.model.quantise); for
    benches and for writers that hold their values on the host."""
    import ml_dtypes
    import numpy as np

    fmt = format_of(dtype)
    x = np.asarray(values, np.float32)
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = np.where(absmax > 0, absmax * np.float32(1 / fmt.max_finite), np.float32(1)
                     ).astype(np.float32)
    scaled = np.clip(x / scale, -fmt.max_finite, fmt.max_finite)
    return scaled.astype(getattr(ml_dtypes, fmt.stored)), scale
