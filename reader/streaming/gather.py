"""The stream's one copy of each returned token into its batch, on a pool of threads.

Two ways (reader.streaming.stream picks): `submit_rows` runs reader.storage.row_copy's C kernel, which reads
a buffer in order and scatters its rows into the batches (row i to address i); `submit`
gathers with numpy, out[i] = src[idx[i]], reading the buffer at random. Either way one
core moves fewer bytes per second than the parallel decode feeds it on a host with many
cores, and both release the GIL, so several copies run at once: the stream hands a whole
buffer's copies over in tasks and goes on cutting the next buffer while the pool copies.
With one thread the copy is a plain call on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np

# Rows per copy task: enough bytes (1.8 MB at hidden 896 in bfloat16) that handing the
# task to a thread costs little beside it, few enough that a batch spreads over threads.
ROWS_PER_TASK = 1024
# The native copy runs 2-3 x faster per row: larger tasks for the same overhead, still
# several per buffer so that every thread has its share.
NATIVE_ROWS_PER_TASK = 4096


def default_threads(decoding: bool = True, dequantising: bool = False) -> int:
    """While tensorstore decodes (`decoding`), a quarter of the cores, 1 to 8: the decode
    runs on tensorstore's threads meanwhile and the consumer needs a core too (one thread
    on the 2-core development machine, where a second measured no faster). With nothing
    to decode (every hook copied from mapped files), the copy is all the stream's work:
    one thread per core, up to 8. A copy that dequantises a float8 hook (`dequantising`)
    does about as much work as the decode of its half-size bytes: half the cores, 2 to 8
    (2 against 1 on the 2-core machine: float8 epochs 0.21 s against 0.26, bench/read.py
    --float8; bfloat16's unchanged)."""
    cores = os.cpu_count() or 1
    if not decoding:
        return max(1, min(8, cores))
    return max(2, min(8, cores // 2)) if dequantising else max(1, min(8, cores // 4))


def _take(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    # mode="clip": idx is in range by construction, and the default "raise" gathers into a
    # temporary first (a second copy; 1.7x the time measured here).
    np.take(src, idx, axis=0, out=out, mode="clip")


class Gather:
    """submit(src [n, d], idx [k], out [k, d]) -> futures of the copy; close() ends the
    threads (waiting for copies under way, dropping those not started)."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"gather_threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = (concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="actx-reader-gather") if threads > 1 else None)

    def submit(self, src: np.ndarray, idx: np.ndarray,
               out: np.ndarray) -> list[concurrent.futures.Future]:
        """Starts numpy's gather, out[i] = src[idx[i]]; `out` is complete once every
        returned future is done (none returned: copied already, on this thread)."""
        return self._in_tasks(_take, src, idx, out, ROWS_PER_TASK)

    def submit_rows(self, copy_rows, src: np.ndarray, rows: np.ndarray,
                    addresses: np.ndarray) -> list[concurrent.futures.Future]:
        """Starts reader.storage.row_copy's kernel: row rows[i] of `src` to addresses[i] (the
        memory behind them must stay alive until the returned futures are done)."""
        return self._in_tasks(copy_rows, src, rows, addresses, NATIVE_ROWS_PER_TASK)

    def submit_dequantise(self, dequantise_rows, src: np.ndarray, rows: np.ndarray,
                          addresses: np.ndarray, scales: np.ndarray, scale_rows: np.ndarray,
                          stored: str, bfloat16: bool) -> list[concurrent.futures.Future]:
        """Starts reader.storage.row_copy's float8 kernel: row rows[i] of the float8 `src`
        times scales[scale_rows[i]] to addresses[i], as float32 or bfloat16."""
        def copy(src, rows, addresses, scale_rows):
            dequantise_rows(src, rows, addresses, scales, scale_rows, stored, bfloat16)

        return self._in_tasks(copy, src, rows, addresses, NATIVE_ROWS_PER_TASK, scale_rows)

    def _in_tasks(self, copy, src: np.ndarray, first: np.ndarray, second: np.ndarray,
                  rows_per_task: int, *more: np.ndarray) -> list[concurrent.futures.Future]:
        """copy(src, first, second, *more) split into even tasks of at most rows_per_task
        rows (of first, second and each of `more` alike) over the pool (on this thread
        when there is no pool)."""
        if self._pool is None:
            copy(src, first, second, *more)
            return []
        n = len(first)
        parts = max(1, -(-n // rows_per_task))
        cuts = [n * i // parts for i in range(parts + 1)]  # even parts
        return [self._pool.submit(copy, src, first[a:b], second[a:b], *(m[a:b] for m in more))
                for a, b in zip(cuts[:-1], cuts[1:])]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
