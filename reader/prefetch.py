"""A generator run ahead in a daemon thread, handing items over through a bounded queue.

The consumer's loop and the producer's reads then overlap; `close()` never waits behind a
full queue, and an exception in the producer reaches the consumer after the items queued
before it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

_DONE = object()
_POLL_S = 0.1  # how often a blocked hand-over looks at the stop event


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Puts `item` unless `stop` is set first; True when it was put."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class Prefetcher:
    """Iterates `produce()` in a thread, at most `depth` items ahead of the consumer."""

    def __init__(self, produce: Callable[[], Iterator[Any]], depth: int, name: str):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._produce, self._depth, self._name = produce, depth, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self, out: queue.Queue, stop: threading.Event) -> None:
        items = self._produce()
        try:
            for item in items:
                if not _put(out, item, stop):
                    return
        except BaseException as e:  # handed to the consumer, which re-raises it
            _put(out, e, stop)
            return
        finally:
            items.close()  # runs the producer's own cleanup in this thread
        _put(out, _DONE, stop)

    def __iter__(self) -> Iterator[Any]:
        self.close()
        stop = self._stop = threading.Event()
        out: queue.Queue = queue.Queue(maxsize=self._depth)
        thread = self._thread = threading.Thread(target=self._run, args=(out, stop),
                                                 daemon=True, name=self._name)
        thread.start()
        try:
            while True:
                try:
                    item = out.get(timeout=_POLL_S)
                except queue.Empty:
                    # Stopped by close() from elsewhere, or the thread ended without a
                    # word (it always puts _DONE or its exception unless stopped).
                    if stop.is_set() or (not thread.is_alive() and out.empty()):
                        return
                    continue
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def thread(self) -> threading.Thread | None:
        """The producing thread while one runs (None once closed)."""
        return self._thread

    def close(self, timeout: float = 30.0) -> None:
        """Stops the thread (idempotent): it stops at its next hand-over; waits up to
        `timeout` seconds, then leaves the daemon thread to finish its read alone."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
