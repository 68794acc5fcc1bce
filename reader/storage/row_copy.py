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
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType
from typing import Callable

import numpy as np

try:
    _built: ModuleType | None = importlib.import_module("actx.reader._row_copy")
    _NOT_BUILT = ""
except ImportError as e:  # built at install only where a C compiler was at hand
    _built = None
    _NOT_BUILT = str(e)

log = logging.getLogger(__name__)

VERSION = 1  # ACTX_ROW_COPY_VERSION in the source

CopyRows = Callable[[np.ndarray, np.ndarray, np.ndarray], None]

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
    bad = _self_check(fn)
    if bad:
        return None, f"{where}: {bad}"
    return fn, f"native: {where}"


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

    copy_rows.library = getattr(module, "__file__", module.__name__)
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
