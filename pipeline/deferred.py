"""Stored writes done in the background of a DoFn, with its outputs held back until they
are durable.

A unit's tokens or a partition's doc table is written (and fsynced, or uploaded) while the
bundle's thread goes on reading, encoding or filling the next one. An output leaves only
once the writes it stands for have finished (in `process`, or at the latest in
`finish_bundle`, which Beam runs before it commits the bundle), so no later stage ever
sees an output whose data is not yet stored; a failed write fails the bundle, which is
retried as a whole. At most `max_pending` groups of writes are in flight, which bounds the
memory they hold.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Callable, Iterable, Iterator

from actx.pipeline import quiet_beam  # noqa: F401 (first: Beam's import, quietly)
from actx.schemas import store_errors
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import GlobalWindows


class DeferredOutputs:
    """Runs writes on `threads` background threads; releases outputs in submission order."""

    def __init__(self, threads: int = 2, max_pending: int = 2):
        self.executor = concurrent.futures.ThreadPoolExecutor(threads,
                                                              thread_name_prefix="actx-write")
        self.max_pending = max_pending
        self.pending: collections.deque = collections.deque()  # (futures, outputs)

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Starts one write in the background."""
        return self.executor.submit(fn, *args)

    def add(self, futures: Iterable, outputs: Iterable) -> Iterator:
        """Holds `outputs` until `futures` (concurrent or tensorstore futures) are done;
        yields the outputs that may leave now, waiting while too many are in flight."""
        self.pending.append((list(futures), list(outputs)))
        yield from self._release(self.max_pending)

    def _release(self, keep: int) -> Iterator:
        while self.pending and (len(self.pending) > keep
                                or all(f.done() for f in self.pending[0][0])):
            futures, outputs = self.pending.popleft()
            # A write's failure raised here, in the bundle; tensorstore's (a full disk, a
            # bucket's refusal) as the one-line StoreError the prepare prints
            with store_errors.tensorstore_errors():
                for future in futures:
                    future.result()
            yield from outputs

    def finish(self) -> Iterator:
        """Every held output, as windowed values (what `finish_bundle` must return); waits
        for all writes."""
        for out in self._release(0):
            if isinstance(out, TaggedOutput):
                yield TaggedOutput(out.tag, GlobalWindows.windowed_value(out.value))
            else:
                yield GlobalWindows.windowed_value(out)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
