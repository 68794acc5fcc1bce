"""The stream's native row copy: reader/native/row_copy.c, built at install time.

The stream copies every token it returns once, from its buffer into a batch. numpy can
only gather (random reads, ordered writes), which waits on memory for every row; the C
kernel copies a buffer in source order and scatters the rows into the batches with
non-temporal stores (the file says why that is 2-3 x faster). setup.py builds it as the
extension module `reader._row_copy` (an optional Extension: `pip install` and `pip install
-e .` build it where a C compiler and the Python headers are at hand, and install without
it elsewhere); its calls release the GIL, so the stream's copy threads run it in parallel.

Where it was not built, `kernel()` says why, logs it once, and the stream copies with
numpy instead: the same bytes, slower. The module is checked on load against numpy on a
few rows (aligned and not), and refused if it differs: a wrong activation is worse than a
slow one. ACTX_ROW_COPY=numpy turns it off.

A float8 hook (schemas.quantised) is copied by the same kernel's `dequantise_rows`
(`dequantise_kernel()`): each row's bytes through the float8 type's 256-entry float32 table
times the token's scale, straight into the batch's float32 or bfloat16 rows, in the one
pass of the copy. Without it the stream copies the float8 bytes and the scales, and the
batch is dequantised afterwards (schemas.quantised.dequantise: the same values, another
pass over them).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType
from typing import Callable

import numpy as np

from actx.schemas import quantised

try:
    _built: ModuleType | None = importlib.import_module("actx.reader._row_copy")
    _NOT_BUILT = ""
except ImportError as e:  # built at install only where a C compiler was at hand
    _built = None
    _NOT_BUILT = str(e)

log = logging.getLogger(__name__)

VERSION = 2  # ACTX_ROW_COPY_VERSION in the source

CopyRows = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
# dequantise_rows(src, rows, addresses, scales, scale_rows, stored, bfloat16): see _bind.
DequantiseRows = Callable[..., None]

_lock = threading.Lock()
_loaded: tuple[CopyRows | None, str] | None = None


def kernel() -> tuple[CopyRows | None, str]:
    """(copy_rows, "native: <module file>") or (None, why not); loaded once per process,
    and the numpy fallback logged once when it is what the stream gets."""
    global _loaded
    with _lock:
        if _loaded is None:
            if os.environ.get("ACTX_ROW_COPY", "").lower() == "numpy":
                _loaded = None, "ACTX_ROW_COPY=numpy"
                log.info("reader: tokens are copied into batches with numpy "
                         "(ACTX_ROW_COPY=numpy)")
            else:
                _loaded = load()
                if _loaded[0] is None:
                    log.warning("reader: tokens are copied into batches with numpy, 2-3 x "
                                "slower than the native copy: %s", _loaded[1])
        return _loaded


def load(module: ModuleType | None = None) -> tuple[CopyRows | None, str]:
    """The built kernel (or `module`'s), checked: (copy_rows, "native: <file>") or (None,
    why not). Never raises for an install without it."""
    module = _built if module is None else module
    if module is None:
        return None, (f"actx.reader._row_copy was not built at install ({_NOT_BUILT}); "
                      f"reinstall actx where a C compiler and the Python headers are at "
                      f"hand (pip install --force-reinstall --no-deps actx-lm, or "
                      f"pip install -e . in a checkout)")
    where = getattr(module, "__file__", module.__name__)
    if module.version() != VERSION:
        return None, f"{where}: version {module.version()}, expected {VERSION}; reinstall actx"
    fn = _bind(module)
    bad = _self_check(fn) or _self_check_dequantise(fn.dequantise_rows)
    if bad:
        return None, f"{where}: {bad}"
    return fn, f"native: {where}"


def dequantise_kernel() -> tuple[DequantiseRows | None, str]:
    """(dequantise_rows, "native: <module file>") or (None, why not): the float8 copy of
    the kernel `kernel()` loads (the same module, checked the same way)."""
    copy_rows, why = kernel()
    return (None, why) if copy_rows is None else (copy_rows.dequantise_rows, why)


def _bind(module: ModuleType) -> CopyRows:
    native_copy = module.copy_rows

    def copy_rows(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray) -> None:
        """Row src_rows[i] of the C-contiguous 2-D `src` to the address dst[i] (int64;
        each a whole row's bytes of writable memory that stays alive meanwhile)."""
        assert src.ndim == 2 and src.flags.c_contiguous
        assert src_rows.dtype == np.int64 and dst.dtype == np.int64 and len(src_rows) == len(dst)
        src_rows, dst = np.ascontiguousarray(src_rows), np.ascontiguousarray(dst)
        native_copy(src.ctypes.data, src_rows.ctypes.data, dst.ctypes.data, len(dst),
                    src.shape[1] * src.itemsize)

    native_dequantise = module.dequantise_rows

    def dequantise_rows(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray,
                        scales: np.ndarray, scale_rows: np.ndarray, stored: str,
                        bfloat16: bool) -> None:
        """Row src_rows[i] of the C-contiguous 2-D float8 `src` (values of the float8 type
        `stored`), times scales[scale_rows[i]] (float32, C-contiguous [m, 1]), to the
        address dst[i] as float32 or (`bfloat16`) bfloat16: each a whole row's worth of
        writable memory (hidden * 4 or 2 bytes) that stays alive meanwhile."""
        assert src.ndim == 2 and src.flags.c_contiguous and src.itemsize == 1
        assert scales.dtype == np.float32 and scales.flags.c_contiguous
        assert src_rows.dtype == np.int64 and dst.dtype == np.int64 and len(src_rows) == len(dst)
        assert scale_rows.dtype == np.int64 and len(scale_rows) == len(dst)
        src_rows, dst = np.ascontiguousarray(src_rows), np.ascontiguousarray(dst)
        scale_rows = np.ascontiguousarray(scale_rows)
        table = quantised.float32_table(stored)
        native_dequantise(src.ctypes.data, src_rows.ctypes.data, scales.ctypes.data,
                          scale_rows.ctypes.data, dst.ctypes.data, len(dst), src.shape[1],
                          table.ctypes.data, bool(bfloat16))

    copy_rows.library = getattr(module, "__file__", module.__name__)
    copy_rows.dequantise_rows = dequantise_rows
    return copy_rows


def _self_check(copy_rows: CopyRows) -> str:
    """"" when the kernel copies as numpy does (16-byte rows and not, aligned and not)."""
    rng = np.random.default_rng(0)
    for width in (64, 7):  # uint16: 128-byte rows (streamed), 14-byte rows (memcpy)
        src = rng.integers(0, 1 << 16, (32, width), dtype=np.uint16)
        rows = rng.permutation(32)[:20].astype(np.int64)
        raw = np.zeros(21 * width * 2 + 64, np.uint8)
        for shift in (0, 2):  # a 16-byte aligned target and one that is not
            start = (-raw.ctypes.data) % 16 + shift
            out = raw[start:start + 20 * width * 2].view(np.uint16).reshape(20, width)
            out[:] = 0
            addresses = out.ctypes.data + np.arange(20, dtype=np.int64) * width * 2
            order = rng.permutation(20)
            copy_rows(src, rows[order], addresses[order])
            if not np.array_equal(out, src[rows]):
                return f"self-check failed (rows of {width * 2} bytes, offset {shift})"
    return ""


def _self_check_dequantise(dequantise_rows: DequantiseRows) -> str:
    """"" when the float8 copy gives schemas.quantised.dequantise's values bit for bit
    (every byte value, float32 and bfloat16, streamed rows and not)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    for stored in sorted({f.stored for f in quantised.FORMATS.values()}):
        for width in (256, 7):  # 8-value multiples go out streamed; 7 through plain stores
            src = rng.permutation(np.arange(32 * width) % 256).astype(np.uint8).reshape(
                32, width).view(getattr(ml_dtypes, stored))
            scales = np.exp2(rng.integers(-20, 20, (32, 1))).astype(np.float32) * \
                rng.uniform(0.5, 1, (32, 1)).astype(np.float32)
            rows = np.sort(rng.permutation(32)[:20]).astype(np.int64)
            for dtype in quantised.READ_DTYPES:
                want = quantised.dequantise(src[rows], scales[rows], dtype)
                itemsize = want.itemsize
                raw = np.zeros(20 * width * itemsize + 64, np.uint8)
                for shift in (0, 4):
                    start = (-raw.ctypes.data) % 16 + shift
                    out = raw[start:start + 20 * width * itemsize].view(want.dtype).reshape(
                        20, width)
                    out[:] = 0
                    order = rng.permutation(20)
                    addresses = out.ctypes.data + order.astype(np.int64) * width * itemsize
                    dequantise_rows(src, rows[order], addresses, scales, rows[order], stored,
                                    dtype == "bfloat16")
                    if not np.array_equal(out.view(np.uint8), want.view(np.uint8)):
                        return (f"self-check failed (float8 {stored} as {dtype}, rows of "
                                f"{width} values, offset {shift})")
    return ""
