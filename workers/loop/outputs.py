"""Handling steps' outputs on a thread of their own, so the dispatching thread only dispatches.

The dispatching thread reads a prefetched batch, builds the global inputs, calls the step
and starts the outputs' copy to host memory; then it hands the step here and goes on to the
next one. This thread waits for each step's outputs to reach host memory, puts their rows
into the writers' blocks and hands full blocks to the writer pool (which checksums and
writes them), in dispatch order. At most `steps_in_flight` steps are dispatched and not yet
handled: that bound is what keeps the device fed (the next steps are queued on it while the
host handles this one) and what bounds the device and host memory the outputs hold.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from actx.schemas import commit as commit_lib
from actx.workers.loop import transfer
from actx.workers.write import writer


@dataclasses.dataclass
class HostTimings:
    """Seconds the host spent per kind of work, summed over the steps handled.

    waiting_s: the output thread waiting for a step's outputs to be in host memory (the
      device still computing, or the copy still running).
    copying_s: putting the rows into the writers' blocks (the one host-side copy left).
    writing_s: the writer pool's threads checksumming and writing blocks (off the loop).
    writer_wait_s: the output thread blocked because the writer pool was full (storage
      slower than the device).
    dispatch_wait_s: the dispatching thread blocked because `steps_in_flight` steps were
      not yet handled (the host slower than the device).
    """

    steps: int = 0
    waiting_s: float = 0.0
    copying_s: float = 0.0
    writing_s: float = 0.0
    writer_wait_s: float = 0.0
    dispatch_wait_s: float = 0.0

    def per_step_ms(self) -> dict[str, float]:
        n = max(1, self.steps)
        return {name[:-2]: 1000 * getattr(self, name) / n for name in
                ("waiting_s", "copying_s", "writing_s", "writer_wait_s", "dispatch_wait_s")}

    def summary(self) -> str:
        ms = self.per_step_ms()
        return (f"waiting {ms['waiting']:.1f} ms, copying {ms['copying']:.1f} ms, writing "
                f"{ms['writing']:.1f} ms (writer threads), writer wait {ms['writer_wait']:.1f} "
                f"ms, dispatch wait {ms['dispatch_wait']:.1f} ms, over {self.steps} steps")


def host_pieces(outs: dict, timings: HostTimings) -> dict[str, list[tuple[int, np.ndarray]]]:
    """This host's rows of a step's outputs, once they are in host memory.

    The wait counts as waiting (the device computing or copying). Taking the pieces costs
    no copy on the CPU, where numpy views the outputs' buffers; from pinned host memory
    (GPU, TPU) numpy reads the host buffer jax holds; any copy there counts as copying.
    """
    start = time.perf_counter()
    for x in outs.values():
        x.block_until_ready()
    ready = time.perf_counter()
    pieces = {name: transfer.host_local_pieces(x) for name, x in outs.items()}
    timings.waiting_s += ready - start
    timings.copying_s += time.perf_counter() - ready
    return pieces


def add_rows(part_writer: writer.PartitionWriter, rows, write, pieces,
             pool: writer.WriterPool, timings: HostTimings, batch=None) -> None:
    """part_writer.add_slots, timed as copying (less the time the writer pool made it wait,
    which is the writer's wait). batch: the step's prefetch.Batch, whose token rows the
    commit marker records."""
    start, waited = time.perf_counter(), pool.wait_s
    tokens = (None if batch is None else
              {name: getattr(batch, name) for name in commit_lib.MODEL_INPUTS})
    part_writer.add_slots(rows, write, pieces, tokens)
    timings.copying_s += time.perf_counter() - start - (pool.wait_s - waited)


class OutputThread:
    """Calls handle(batch, outs) for each dispatched step, in order, on its own thread.

    The dispatching thread calls `wait_for_room()` before it dispatches a step and `put()`
    after; an error raised by `handle` reaches the dispatching thread at its next call.
    """

    def __init__(self, handle: Callable[..., None], steps_in_flight: int,
                 timings: HostTimings | None = None):
        if steps_in_flight < 1:
            raise ValueError(f"steps_in_flight must be at least 1, got {steps_in_flight}")
        self._handle = handle
        self._limit = steps_in_flight
        self._timings = timings if timings is not None else HostTimings()
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._unhandled = 0  # dispatched and not yet handled (queued or being handled)
        self._handled = 0  # steps handled so far
        self._error: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="actx-outputs", daemon=True)
        self._thread.start()

    def wait_for_room(self) -> None:
        """Blocks while `steps_in_flight` steps are unhandled; raises the thread's error."""
        start = time.perf_counter()
        with self._cond:
            while self._unhandled >= self._limit and self._error is None:
                self._cond.wait()
            self._raise_error()
        self._timings.dispatch_wait_s += time.perf_counter() - start

    def put(self, *step) -> None:
        """Hands over one dispatched step (the arguments of `handle`)."""
        with self._cond:
            self._raise_error()
            self._queue.append(step)
            self._unhandled += 1
            self._cond.notify_all()

    def wait_handled(self, count: int) -> None:
        """Blocks until the first `count` steps put here are handled."""
        with self._cond:
            while self._handled < count and self._error is None:
                self._cond.wait()
            self._raise_error()

    def drain(self) -> None:
        """Blocks until every step put here is handled; raises the thread's error."""
        with self._cond:
            while self._unhandled and self._error is None:
                self._cond.wait()
            self._raise_error()

    def close(self) -> None:
        """Stops the thread, dropping steps not yet handled (after an error: nothing of a
        partition they belong to is committed, since its rows never reach the writer)."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                step = self._queue.popleft()
            try:
                self._handle(*step)
                self._timings.steps += 1
            except BaseException as e:  # surfaced to the dispatching thread
                with self._cond:
                    self._error = e
                    self._queue.clear()
                    self._cond.notify_all()
                return
            finally:
                del step  # the outputs' host buffers go back as soon as they are handled
            with self._cond:
                self._unhandled -= 1
                self._handled += 1
                self._cond.notify_all()
