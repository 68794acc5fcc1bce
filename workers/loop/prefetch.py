"""Reads a host's token rows ahead of the forward pass, on a background thread.

The chips should never wait on storage: while step i runs, the rows of steps i+1..i+depth
are being read. The queue's bound keeps host memory bounded.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from actx.schemas import advice
from actx.schemas import chunk_checksums
from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import layout as layout_lib
from actx.schemas import store_errors
from actx.schemas import ts_context
from actx.schemas import uri as uri_lib
from actx.workers.loop import schedule

STEP_INPUTS = commit_lib.MODEL_INPUTS
# What TokenStore.continuation_flags reads of a host's slice before its steps (a model that
# carries context): every row of these, so their steps' reads come from the cache.
CONTINUATION_INPUTS = ("segment_ids", "positions")


def _rows(lo: int, hi: int) -> str:
    return f"row {lo}" if hi - lo == 1 else f"rows {lo}-{hi - 1}"


class TokenStoreDamagedError(errors.UserError, RuntimeError):
    """A token array's stored chunk that cannot be read as prepare wrote it: damaged after
    prepare (a truncated or overwritten file, a changed byte its checksum catches, an
    object lost: schemas.chunk_checksums). Extracting again reads it again, so the message
    says to prepare the run again, which writes the same tokens (prepare is
    deterministic)."""


@dataclasses.dataclass(frozen=True)
class Batch:
    """One host-local batch: int32 arrays [local_batch, seq_len] and its step."""

    step: schedule.Step
    index: int
    input_ids: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray


class TokenStore:
    """The three token arrays a step needs, opened once per process."""

    def __init__(self, run: uri_lib.Location):
        self._run = run
        # Token arrays never change after prepare: chunks decoded once stay valid in the
        # cache pool, so the slots of one shard, read in different steps, cost one fetch.
        self.arrays = {
            name: ts_context.open_array(layout_lib.array_spec(
                run, layout_lib.token_array_key(name), recheck_cached_data="open"))
            for name in STEP_INPUTS
        }

    def continuation_flags(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(continues [hi - lo] bool, first_positions [hi - lo] int32) of rows [lo, hi).

        Row r continues the document of row r - 1 when its column 0 holds a document token
        whose position is > 0 (prepare starts every document elsewhere at position 0).
        """
        futures = {name: self.arrays[name][lo:hi, 0].read() for name in CONTINUATION_INPUTS}
        seg = self._result(futures["segment_ids"], "segment_ids", lo, hi)
        pos = self._result(futures["positions"], "positions", lo, hi)
        return (seg > 0) & (pos > 0), pos

    def _result(self, future, name: str, lo: int, hi: int) -> np.ndarray:
        """A read's rows; a stored object that cannot be decoded raised as what it is (a
        damaged token store, with the commands that write it again), a store's refusal as
        its one line."""
        try:
            return np.asarray(future.result())
        except ValueError as e:
            key = self._run.join(layout_lib.token_array_key(name))
            error = store_errors.from_tensorstore(e, str(key), retried=True)
            if error is not e:
                raise error from None
            if not chunk_checksums.is_damage(e):
                raise
            raise TokenStoreDamagedError(
                f"{key}: {_rows(lo, hi)} cannot be read ({errors.first_line(e, 400)}): "
                f"the token store was damaged after prepare. `{advice.reprepare(self._run)}` "
                f"writes the same tokens again (from the inputs its run.json names; what is "
                f"committed stays), then `{advice.rerun(self._run)}` extracts the rest"
            ) from None

    def read_rows(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """Rows as given, in that order (any rows: a step's slots run different documents).

        Each run of consecutive row numbers is one read; all reads are in flight at once.
        """
        wanted = sorted(set(rows))
        runs, start = [], wanted[0]
        for prev, row in zip(wanted, wanted[1:] + [None]):
            if row != prev + 1:
                runs.append((start, prev + 1))
                start = row
        futures = {name: [(arr[lo:hi].read(), lo, hi) for lo, hi in runs]
                   for name, arr in self.arrays.items()}
        where = {}
        offset = 0
        for lo, hi in runs:
            for r in range(lo, hi):
                where[r] = offset + r - lo
            offset += hi - lo
        index = np.asarray([where[r] for r in rows])
        return {name: np.concatenate([self._result(f, name, lo, hi) for f, lo, hi in fs])[index]
                for name, fs in futures.items()}


class Prefetcher:
    """Iterates over `steps`, yielding Batches read `depth` steps ahead. An exception
    raised while planning or reading a step reaches the consumer at that step, and is kept
    in `failed`."""

    _DONE = object()

    def __init__(self, tokens: TokenStore, steps: Iterable[schedule.Step], depth: int = 4):
        self._tokens = tokens
        self._steps = steps  # may be a generator (schedule.stream): planned on this thread
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="actx-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i, step in enumerate(self._steps):
                if self._stop.is_set():
                    return
                arrays = self._tokens.read_rows(step.rows)
                self._put(Batch(step, i, arrays["input_ids"], arrays["positions"],
                                arrays["segment_ids"]))
            self._put(self._DONE)
        except BaseException as e:  # surfaced to the consumer, which re-raises it
            self.failed = e
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[Batch]:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def failure_behind(self, error: BaseException) -> BaseException | None:
        """The planning error that came before `error` (raised while the consumer ran the
        steps queued ahead of it), or None. Stops the thread first, so an error it is
        raising is recorded. A multi-host leader whose partition choice fails publishes it;
        the other hosts leave, and the leader's step in flight then fails on a lost peer:
        the choice's error is the cause to report."""
        self.close()
        return self.failed if self.failed is not None and self.failed is not error else None
