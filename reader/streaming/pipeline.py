"""One pass of a stream (reader.streaming.stream): buffers loaded ahead, cut into batches, copied
into them, and the batches handed over in step order.

Each buffer is cut into batches (their token rows and ids filled at once) and its
activations copied into them on the gather threads; a buffer's batches are handed over
once its copies are done, while the next buffer's copies run and the one after it is read
(`prefetch_buffers` ahead). Buffers load on a thread of their own (reader.streaming.buffers).
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Iterator

import numpy as np

from actx.reader.streaming import array_pool
from actx.reader.streaming import blocks as blocks_lib
from actx.reader.streaming import gather as gather_lib
from actx.reader.storage import read_window
from actx.reader.streaming import buffers as stream_buffers
from actx.reader.batches import Batch


class BufferPipeline:
    """The state of one pass: slots, buffers loading and cut, copies under way.

    work: (epoch, buffer, tokens to skip) of every buffer the steps need, in order.
    start_step / stop_step: the steps to hand over (stop None: endless).
    seconds: where the cutting thread spends its time, added to as it goes
      (ShuffledStream.producer_seconds).
    queued: batches the consumer may hold beyond the two buffers' worth (prefetch).
    """

    def __init__(self, buffers: stream_buffers.BufferReader,
                 work: Iterator[tuple[int, blocks_lib.Buffer, int]], start_step: int,
                 stop_step: int | None, prefetch_buffers: int, reads_in_flight: int,
                 gather_threads: int, queued: int, seconds: dict[str, float]):
        self.buffers, self.plan, self.work = buffers, buffers.plan, work
        self.stop_step, self.seconds = stop_step, seconds
        # Buffers are reused round-robin: allocated once per pass, freed with it.
        self.slots = [buffers.new_slot() for _ in range(prefetch_buffers + 1)]
        # Futures of the buffers loading or loaded, not yet cut, in order.
        self.loads: collections.deque[concurrent.futures.Future] = collections.deque()
        # Buffers cut whose copies may still read their slot: (loaded, copies).
        self.held: collections.deque[tuple[stream_buffers.Loaded, list]] = \
            collections.deque()
        self.window = read_window.ReadWindow(reads_in_flight)
        self.gather = gather_lib.Gather(gather_threads)
        # Buffers load on a thread of their own, while the buffer before them is cut:
        # mapping shard files and working out the order is per-buffer work that would
        # otherwise stall the cutting, which bounds the stream on a host with many cores.
        self.loader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="actx-reader-load")
        self.issued = 0
        # The newest buffer's copies run on while the one before it is handed over,
        # unless its slot is the only one (then the next read waits for them). Measured
        # on bench/read.py's no-codec store against copying and handing over in turn:
        # about 7% faster, for one more buffer of batches in memory (peak RSS 445 -> 540
        # MB there).
        self.keep_copying = 1 if len(self.slots) > 1 else 0
        self.copied_through = -1  # the copies of every buffer cut up to this one are done
        # Batches of about two buffers (one handed over, one being copied into) and those
        # queued beyond the pool, per hook.
        per_buffer = -(-self.plan.buffer_rows * buffers.run.seq_len
                       // self.plan.batch_size) + 1
        self.pool = array_pool.ArrayPool((2 * per_buffer + queued + 3) * len(buffers.hooks))
        # (batch, the last buffer cut into it), waiting for that buffer's copies.
        self.ready: collections.deque[tuple[Batch, int]] = collections.deque()
        self.step, self.fill, self.out, self.cut = start_step, 0, None, 0
        self.busy_since = time.perf_counter()

    def _top_up(self) -> None:
        """Queues the loads of the next buffers, as many as there are free slots."""
        while len(self.loads) + len(self.held) < len(self.slots):
            item = next(self.work, None)
            if item is None:
                return
            # Its slot is free: the copies out of the buffer that held it are done.
            self.loads.append(self.loader.submit(
                self.buffers.load, *item, slot=self.slots[self.issued % len(self.slots)],
                window=self.window))
            self.issued += 1

    def _hand_over(self, batch: Batch) -> Iterator[Batch]:
        self.window.pump()  # the next buffer's reads go on while batches are handed over
        self.seconds["busy"] += time.perf_counter() - self.busy_since
        yield batch
        self.busy_since = time.perf_counter()

    def _release(self, keep: int) -> None:
        """Waits for the copies of all but the newest `keep` buffers cut, and frees the
        slots of those whose copies are done (their next reads may start)."""
        held = self.held
        while held and (len(held) > keep or all(c.done() for c in held[0][1])):
            t0 = time.perf_counter()
            for copy in held[0][1]:
                copy.result()
            self.seconds["copy_wait"] += time.perf_counter() - t0
            held.popleft()  # its slot takes a read; mapped files unmap when unused
            self.copied_through += 1

    def _next_loaded(self) -> stream_buffers.Loaded:
        """The next buffer, its reads done."""
        t0 = time.perf_counter()
        loaded = self.loads.popleft().result()
        try:
            self.window.wait(loaded.reads)
        except ValueError as e:  # how tensorstore reports a failed read
            raise self.buffers.read_error(loaded, e) from e
        self.seconds["read_wait"] += time.perf_counter() - t0
        return loaded

    def _cut(self, loaded: stream_buffers.Loaded) -> list:
        """Cuts the buffer's tokens into batches (token rows and ids filled now); returns
        the pieces (first stream index, tokens, batch, first row in the batch) whose
        activations are still to copy."""
        plan, order = self.plan, loaded.order
        pieces, pos = [], loaded.skip
        while pos < len(order.rows) and (self.stop_step is None or self.step < self.stop_step):
            epoch, _ = plan.locate(self.step)
            if epoch != loaded.epoch:
                break
            if self.out is None:
                n = plan.batch_tokens(self.step)
                self.out = Batch(self.step, epoch,
                                 {h: self.pool.empty((n, width), dtype) for h, (width, dtype)
                                  in self.buffers.batch_arrays(loaded.sources).items()},
                                 np.empty(n, np.int64), np.empty(n, np.int64),
                                 np.empty(n, np.int32))
            out, fill = self.out, self.fill
            take = min(len(out) - fill, len(order.rows) - pos)
            part, into = slice(pos, pos + take), slice(fill, fill + take)
            pieces.append((pos, take, out, fill))
            out.rows[into] = order.rows[part]
            out.cols[into] = order.cols[part]
            out.input_ids[into] = order.input_ids[part]
            self.fill, pos = fill + take, pos + take
            if self.fill == len(out):
                self.ready.append((out, self.cut))
                self.step, self.fill, self.out = self.step + 1, 0, None
        return pieces

    def batches(self) -> Iterator[Batch]:
        """Batches in step order; stopping it (close) leaves no copy or read running."""
        self.busy_since = time.perf_counter()
        try:
            self._top_up()
            while self.loads:
                self._release(keep=len(self.held))
                self._top_up()
                loaded = self._next_loaded()
                pieces = self._cut(loaded)
                self.held.append((loaded, self.buffers.copy(loaded, pieces, self.gather)))
                del loaded, pieces
                self.cut += 1
                self._release(keep=self.keep_copying)
                self._top_up()
                while self.ready and self.ready[0][1] <= self.copied_through:
                    yield from self._hand_over(self.ready.popleft()[0])
            self._release(keep=0)
            while self.ready:
                yield from self._hand_over(self.ready.popleft()[0])
            self.seconds["busy"] += time.perf_counter() - self.busy_since
        finally:
            # A stopped stream leaves no write into a freed slot or batch: no load queues
            # reads after the window is cancelled (one under way has its reads dropped),
            # and the copies under way finish before the buffers and batches may go.
            self.window.cancel()
            self.loader.shutdown(wait=True, cancel_futures=True)
            self.gather.close()
