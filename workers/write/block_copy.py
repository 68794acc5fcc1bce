"""Copying a step's rows into the writer's blocks on several threads.

With `overflow: continue` the slots of a step hold rows scattered over blocks, so each run
of rows is copied from the step's output into its block: one host-side copy, on the output
thread, once per step. On the H200's host (16 cores) one thread copied a step's 235 MB (4
hooks, Qwen2.5-0.5B shapes, 16 × 2048) in 53 ms against a 65 ms step: with the wait for
the outputs, 72 ms of the output thread's time a step, which held end to end at 0.88 of
forward only (bench/RESULTS.md, issue 49). One thread's memory copy runs at what one core
draws; cut into pieces over several threads it runs at what the socket draws. numpy lets
go of the GIL while it copies a dtype that needs no Python (bfloat16 included), so the
pieces run at once.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np

# Below this a step's copies run on the calling thread: handing pieces to threads costs
# tens of microseconds each, and small copies are cache-bound anyway.
MIN_PARALLEL_BYTES = 16 << 20
# No piece smaller than this: a piece must be worth a thread's wake-up.
MIN_PIECE_BYTES = 2 << 20


def default_threads() -> int:
    """Half the cores this process may run on, at most 8 (the writer's threads, the
    dispatching thread and the prefetcher keep the rest); 1 (no threads) below 4 cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return 1 if cores < 4 else min(8, cores // 2)


class BlockCopier:
    """`copy(pairs)`: np.copyto(dst, src) for each pair, split over `threads` threads when
    the pairs hold at least MIN_PARALLEL_BYTES; returns once every byte is copied."""

    def __init__(self, threads: int | None = None):
        self.threads = default_threads() if threads is None else max(1, threads)
        self._executor = (concurrent.futures.ThreadPoolExecutor(self.threads, "actx-copy")
                          if self.threads > 1 else None)

    def copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        total = sum(dst.nbytes for dst, _ in pairs)
        if self._executor is None or total < MIN_PARALLEL_BYTES:
            for dst, src in pairs:
                np.copyto(dst, src)
            return
        piece_bytes = max(MIN_PIECE_BYTES, -(-total // (2 * self.threads)))
        futures = [self._executor.submit(np.copyto, dst, src)
                   for pair in pairs for dst, src in _pieces(*pair, piece_bytes)]
        for future in futures:
            future.result()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _pieces(dst: np.ndarray, src: np.ndarray, piece_bytes: int):
    """(dst, src) cut into pieces of about `piece_bytes`: the flat elements where both are
    contiguous and of one shape, else whole leading-axis rows."""
    count = max(1, min(-(-dst.nbytes // piece_bytes), dst.size))
    if count == 1:
        return [(dst, src)]
    if (dst.shape == src.shape and dst.flags.c_contiguous and src.flags.c_contiguous):
        flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
        bounds = np.linspace(0, dst.size, count + 1).astype(np.int64)
    else:
        count = min(count, dst.shape[0])
        flat_dst, flat_src = dst, np.broadcast_to(src, dst.shape)
        bounds = np.linspace(0, dst.shape[0], count + 1).astype(np.int64)
    return [(flat_dst[a:b], flat_src[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
