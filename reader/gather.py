"""The stream's one copy of each returned token: out[i] = src[idx[i]], split over threads.

The copy reads the buffer at random, so one core moves fewer bytes per second than the
parallel decode feeds it on a host with many cores; np.take releases the GIL, so parts of
a batch copy on several threads at once. With one thread it is a plain call.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np

# Below this many rows per thread, handing work to a thread costs more than it saves.
MIN_ROWS_PER_THREAD = 256


def default_threads(decoding: bool = True) -> int:
    """While tensorstore decodes (`decoding`), a quarter of the cores, 1 to 8: the decode
    runs on tensorstore's threads meanwhile and the consumer needs a core too (one thread
    on the 2-core development machine, where a second measured no faster). With nothing
    to decode (every hook copied from mapped files), the copy is all the stream's work:
    one thread per core, up to 8."""
    cores = os.cpu_count() or 1
    return max(1, min(8, cores // 4 if decoding else cores))


def _take(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    # mode="clip": idx is in range by construction, and the default "raise" gathers into a
    # temporary first (a second copy; 1.7x the time measured here).
    np.take(src, idx, axis=0, out=out, mode="clip")


class Gather:
    """Callable (src [n, d], idx [k], out [k, d]) -> None; close() ends its threads."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"gather_threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = (concurrent.futures.ThreadPoolExecutor(
            threads - 1, thread_name_prefix="actx-reader-gather") if threads > 1 else None)

    def __call__(self, src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
        parts = min(self.threads, len(idx) // MIN_ROWS_PER_THREAD)
        if self._pool is None or parts < 2:
            _take(src, idx, out)
            return
        cuts = np.linspace(0, len(idx), parts + 1).astype(np.int64)
        futures = [self._pool.submit(_take, src, idx[a:b], out[a:b])
                   for a, b in zip(cuts[1:-1], cuts[2:])]
        _take(src, idx[:cuts[1]], out[:cuts[1]])  # this thread's part
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # every part is awaited in __call__
