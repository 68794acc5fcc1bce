"""A window of block reads: tensorstore reads and decodes at most `in_flight` of them at
a time, in the order they were queued, and the window is topped up between batches.

Why not issue every block of a buffer at once: each read in flight holds its own freshly
allocated decode memory. With a whole buffer's blocks (tens of MB each) in flight together
the allocator maps new memory for every read and the kernel faults every page in; a small
window keeps reusing the same memory (measured with bench/read.py's store, no codec, a
window of 2 blocks against all 8 of a buffer at once: 4k page faults per epoch instead of
~80k, and 0.08 s less CPU per 0.94 GB epoch).

The stream queues a buffer's reads on its loading thread and tops the window up from the
thread that cuts batches, so the window is safe to share between threads.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

import tensorstore as ts


class ReadGroup:
    """The reads of one buffer: futures of those issued, and how many wait in the queue."""

    def __init__(self):
        self.futures: list[ts.Future] = []
        self.queued = 0


class ReadWindow:
    """Reads issued in queue order, at most `in_flight` unfinished at a time."""

    def __init__(self, in_flight: int):
        if in_flight < 1:
            raise ValueError(f"reads_in_flight must be >= 1, got {in_flight}")
        self.in_flight = in_flight
        self._queue: collections.deque = collections.deque()  # (group, read)
        self._running: list[ts.Future] = []
        # Held while the queue or the running reads change, never while blocked on a read
        # (issuing one only starts it).
        self._lock = threading.Lock()
        self._cancelled = False

    def add(self, group: ReadGroup, read: Callable[[], ts.Future]) -> None:
        """Queues `read` (called when the window has room; returns a future). Dropped
        once the window is cancelled."""
        with self._lock:
            if self._cancelled:
                return
            group.queued += 1
            self._queue.append((group, read))

    def pump(self) -> None:
        """Issues queued reads while fewer than `in_flight` are unfinished (non-blocking)."""
        with self._lock:
            self._running = [f for f in self._running if not f.done()]
            while self._queue and len(self._running) < self.in_flight:
                group, read = self._queue.popleft()
                future = read()
                group.queued -= 1
                group.futures.append(future)
                self._running.append(future)

    def wait(self, group: ReadGroup) -> None:
        """Blocks until every read of `group` finished, keeping the window full meanwhile;
        raises the first failed read's error. Groups are waited for in queue order."""
        while True:
            self.pump()
            with self._lock:
                waiting = next((f for f in group.futures if not f.done()), None)
                if waiting is None and not group.queued:
                    break
                # Nothing of the group unfinished but some still queued: the window is
                # full of earlier reads; wait for the oldest.
                waiting = waiting or self._running[0]
            waiting.result()
        for f in group.futures:
            f.result()

    def cancel(self) -> None:
        """Drops the queue and cancels the unfinished reads (a stopped stream); reads
        added later are dropped too."""
        with self._lock:
            self._cancelled = True
            self._queue.clear()
            for f in self._running:
                f.cancel()
            self._running = []
