"""The stream's native row copy: reader/native/row_copy.c, compiled on first use.

The stream copies every token it returns once, from its buffer into a batch. numpy can
only gather (random reads, ordered writes), which waits on memory for every row; the C
kernel copies a buffer in source order and scatters the rows into the batches with
non-temporal stores (the file says why that is 2-3 x faster). actx ships as a pure-Python
wheel, so the kernel is compiled here, once per host and source version, with the host's C
compiler ($CC, else cc, gcc or clang), into a cache directory ($ACTX_CACHE_DIR, else
$XDG_CACHE_HOME/actx or ~/.cache/actx), and loaded with ctypes (calls release the GIL, so
the stream's copy threads run it in parallel).

Where it cannot be had (no compiler, a read-only home, not Linux or macOS) `kernel()` says
why and the stream copies with numpy instead: the same bytes, slower. The library is
checked on load against numpy on a few rows (aligned and not), and refused if it differs:
a wrong activation is worse than a slow one. ACTX_ROW_COPY=numpy turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Callable

import numpy as np

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "row_copy.c")
VERSION = 1  # ACTX_ROW_COPY_VERSION in the source
_FLAGS = ("-O2", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 30  # it takes about 0.1 s; a compiler that hangs must not stall a stream

CopyRows = Callable[[np.ndarray, np.ndarray, np.ndarray], None]

_lock = threading.Lock()
_loaded: tuple[CopyRows | None, str] | None = None


def kernel() -> tuple[CopyRows | None, str]:
    """(copy_rows, "native: <library>") or (None, why not); loaded once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            if os.environ.get("ACTX_ROW_COPY", "").lower() == "numpy":
                _loaded = None, "ACTX_ROW_COPY=numpy"
            else:
                _loaded = load()
        return _loaded


def cache_dir() -> str:
    if os.environ.get("ACTX_CACHE_DIR"):
        return os.environ["ACTX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "actx")


def _compiler() -> str | None:
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"].split()[0]) and os.environ["CC"]
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def load(compiler: str | None = None, directory: str | None = None) -> tuple[CopyRows | None, str]:
    """Compiles (unless cached) and loads the kernel: (copy_rows, "native: <path>") or
    (None, why not). Never raises for a host that cannot build it."""
    if not (sys.platform.startswith("linux") or sys.platform == "darwin"):
        return None, f"no native row copy on {sys.platform}"
    compiler = compiler or _compiler()
    if compiler is None:
        return None, "no C compiler (set CC, or install cc/gcc/clang)"
    try:
        with open(SOURCE, "rb") as f:
            source = f.read()
    except OSError as e:
        return None, f"{SOURCE}: {e.strerror}"
    key = hashlib.sha256(source + repr((compiler, _FLAGS)).encode()).hexdigest()[:16]
    name = f"row_copy-{VERSION}-{key}-{platform.machine()}.so"
    for where in (directory or cache_dir(),
                  os.path.join(tempfile.gettempdir(), f"actx-{os.getuid()}")):
        path = os.path.join(where, name)
        if not os.path.isfile(path):
            why = _compile(compiler, where, path)
            if why:
                reason = why
                continue
        unsafe = _not_ours(where) or _not_ours(path)
        if unsafe:
            reason = unsafe
            continue
        try:
            fn = _bind(path)
        except OSError as e:
            reason = f"{path}: {e}"
            continue
        bad = _self_check(fn)
        if bad:
            return None, f"{path}: {bad}"
        return fn, f"native: {path}"
    return None, reason


def _not_ours(path: str) -> str:
    """"" when `path` is ours alone to write (owned by this user, not writable by others),
    else why: a library someone else could replace is not loaded."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return f"{path} is not this user's alone (owner {st.st_uid}, mode {st.st_mode:o})"
    return ""


def _compile(compiler: str, directory: str, path: str) -> str:
    """Builds the library at `path` (atomically: a temporary name renamed); "" or why not."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".row_copy-", suffix=".so", dir=directory)
        os.close(fd)
    except OSError as e:
        return f"{directory}: {e.strerror}"
    try:
        res = subprocess.run([*compiler.split(), *_FLAGS, "-o", tmp, SOURCE],
                             capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if res.returncode != 0:
            return f"{compiler} failed: {res.stderr.strip()[-500:] or res.returncode}"
        os.replace(tmp, path)  # another process may have built it too: same bytes
        return ""
    except (OSError, subprocess.SubprocessError) as e:
        return f"{compiler}: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(path: str) -> CopyRows:
    lib = ctypes.CDLL(path)  # CDLL: calls release the GIL
    if lib.actx_row_copy_version() != VERSION:
        raise OSError(f"version {lib.actx_row_copy_version()}, expected {VERSION}")
    fn = lib.actx_copy_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64]

    def copy_rows(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray) -> None:
        """Row src_rows[i] of the C-contiguous 2-D `src` to the address dst[i] (int64;
        each a whole row's bytes of writable memory that stays alive meanwhile)."""
        assert src.ndim == 2 and src.flags.c_contiguous
        assert src_rows.dtype == np.int64 and dst.dtype == np.int64 and len(src_rows) == len(dst)
        src_rows, dst = np.ascontiguousarray(src_rows), np.ascontiguousarray(dst)
        fn(src.ctypes.data, src_rows.ctypes.data, dst.ctypes.data, len(dst),
           src.shape[1] * src.itemsize)

    copy_rows.library = path
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
