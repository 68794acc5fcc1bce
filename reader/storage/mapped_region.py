"""Several files mapped side by side into one range of virtual memory, seen as one numpy
array [rows, hidden], so a single np.take can gather tokens of many shard files.

Linux only (x86-64, arm64): the range is reserved with an inaccessible anonymous mapping,
then each segment is mapped over its part of it (MAP_FIXED over our own reservation):
a file read-only and shared (its page-cache pages, no copy), or anonymous writable memory.
Segments start at multiples of lcm(page size, row bytes), so every row of the view lies
whole in one segment; bytes between segments stay inaccessible. `available()` says
whether this host can do it; callers fall back to tensorstore where it cannot.

Every array handed out keeps the Region alive, and the Region unmaps its range only when
it is garbage (no array over it remains), so no array can outlive its memory.

Setting up and tearing down the page tables of a mapping costs about a third as much CPU
as copying its bytes once at random (bench/read.py's store: 0.04 s to page in and 0.02 s
to unmap 0.94 GB, against 0.16 s to gather it), so one background thread (the pager)
pages each region in ahead of the copy (which also reads files not yet in the page cache)
and unmaps finished ones, on another core than the copy's.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import queue
import sys
import threading

import numpy as np

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, mmap.PROT_READ, mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE = mmap.MAP_SHARED, mmap.MAP_PRIVATE
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_FIXED = 0x10  # asm-generic/mman-common.h (x86-64 and arm64 alike)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
# Bytes between the reads that page a mapped file in: the kernel's default fault-around
# (one fault maps 16 pages; a page it leaves out is faulted by the copy itself). Measured
# here, faulting 0.94 GB in this way cost 0.04-0.05 s of system time against 0.07-0.08 s
# for madvise(MADV_POPULATE_READ), which walks every page again after faulting it.
_PAGE_IN_STRIDE = 1 << 16
_MACHINES = ("x86_64", "amd64", "aarch64", "arm64")


def available() -> bool:
    """True on the hosts whose mmap flags this module knows (Linux on x86-64 / arm64)."""
    return sys.platform.startswith("linux") and platform.machine().lower() in _MACHINES


_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = libc
    return _libc


_MAP_FAILED = ctypes.c_void_p(-1).value


class _Pager:
    """One daemon thread running tasks in order. `run` never blocks and takes no lock
    (SimpleQueue.put is reentrant), so a Region's __del__ may call it from any thread,
    even in the middle of another call."""

    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="actx-pager",
                                            daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            fn, args = self._tasks.get()
            try:
                fn(*args)
            except Exception:  # paging in is only ahead of time; the copy faults anyway
                pass
            del fn, args  # the task's Region may go now, not at the next task

    def run(self, fn, *args) -> None:
        """Runs fn(*args) on the thread, or here when it is not running (not started
        yet, or this is a forked child)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._tasks.put((fn, args))
        else:
            fn(*args)


_pager = _Pager()


def _new_pager_in_child() -> None:
    global _pager
    _pager = _Pager()  # a forked child has no pager thread: its Regions unmap directly


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pager_in_child)


def _page_in(region: "Region", segments: list[int]) -> None:
    # Reads one byte per stride of each file (np.take releases the GIL): the faults map
    # the pages, and read files not yet in the page cache from disk.
    offsets = np.concatenate([np.arange(region._starts[i],
                                        region._starts[i] + region.segment_bytes[i],
                                        _PAGE_IN_STRIDE) for i in segments] or [[]])
    np.take(region._array(0, region.nbytes, np.uint8), offsets.astype(np.int64))


def _mmap(addr: int | None, length: int, prot: int, flags: int, fd: int) -> int:
    got = _c().mmap(addr, length, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    return got


class Region:
    """Segments of the given byte sizes, laid out in order at aligned offsets.

    row_bytes: bytes of one row of the view; every segment starts at a multiple of it
    (and of the page size), so segment i's first row is `first_row[i]`.
    """

    def __init__(self, segment_bytes: list[int], row_bytes: int):
        self.row_bytes = row_bytes
        unit = math.lcm(mmap.PAGESIZE, row_bytes)
        starts, at = [], 0
        for n in segment_bytes:
            starts.append(at)
            at += max(unit, -(-n // unit) * unit)
        self.nbytes = at
        self.segment_bytes = list(segment_bytes)
        self.first_row = [s // row_bytes for s in starts]
        self._starts = starts
        self._files: list[int] = []
        self._base = _mmap(None, at, _PROT_NONE,
                           _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)

    def map_file(self, i: int, fd: int) -> None:
        """Maps the open file `fd` (segment_bytes[i] long) read-only at segment i."""
        addr, n = self._base + self._starts[i], self.segment_bytes[i]
        _mmap(addr, n, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd)
        self._files.append(i)

    def page_in(self) -> None:
        """Has the pager fault the mapped files in (the task holds the Region alive)."""
        _pager.start()
        _pager.run(_page_in, self, list(self._files))

    def _array(self, start: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        memory = (ctypes.c_char * nbytes).from_address(self._base + start)
        memory.region = self  # the array's base: the Region lives while the array does
        return np.frombuffer(memory, dtype)

    def writable(self, i: int, dtype: np.dtype) -> np.ndarray:
        """Anonymous memory at segment i, as a writable flat array of `dtype`."""
        addr, n = self._base + self._starts[i], self.segment_bytes[i]
        _mmap(addr, n, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED,
              -1)
        return self._array(self._starts[i], n, dtype)

    def rows(self, dtype: np.dtype, hidden: int) -> np.ndarray:
        """The whole region as a read-only [nbytes // row_bytes, hidden] array (only rows
        inside mapped segments may be read)."""
        view = self._array(0, self.nbytes, dtype).reshape(-1, hidden)
        view.flags.writeable = False
        return view

    def __del__(self) -> None:
        if getattr(self, "_base", None) is not None and _pager is not None:
            # Nothing refers to the memory any more, so it may go later, on the pager.
            _pager.run(_c().munmap, self._base, self.nbytes)
            self._base = None
