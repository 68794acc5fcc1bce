"""Partitions streamed through the batch slots, with no barrier between partitions.

A slot whose document ends takes the next document, from the next partition if need be
(`schedule.stream`), so no slot waits for a partition's longest document, and the steps
never pause at a partition's end. Rows without context are one-row chains, so the same
stream runs every packing. A one-host replica commits a partition as soon as its last row
is durable (on the committer's thread; the output thread hands it over). The hosts of a
multi-host replica run every step in lockstep but finish a partition at different steps,
so every `stop_check_steps` steps they agree, in one small all-gather, on three things:
whether one of them got SIGTERM, which partitions every host has finished (committed then,
in order, by the collective commit), and whether all of them have run out of work. Their
partitions come in one order on every host: agreed before the stream starts, or, when the
replica steals, chosen by the leader as the stream goes (claims and all) and read by the
others from jax.distributed's key-value store, off the steps' path.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import numpy as np

from actx.schemas import manifest as manifest_lib
from actx.workers.loop import fence, outputs, prefetch, schedule
from actx.workers.replicas import distributed
from actx.workers.write import writer
from actx.workers.loop.progress import Progress
from actx.workers.replicas.stop import StopSignal


log = logging.getLogger("actx.worker")

# Multi-host replicas report which partitions they finished as a bitmap over this many
# sequence indices from the oldest one not yet committed; a partition finished beyond it
# waits for the next agreement after the window moves.
AGREEMENT_WINDOW = 1024


class StreamHost(Protocol):
    """What a partition stream needs of its host's worker (`runner.Worker` is one): where
    its rows go, its progress and stop signal, and its partition choice."""

    topo: schedule.Topology
    local_batch: int  # the slots of this host's batch
    manifest: manifest_lib.Manifest
    arrays: writer.ActivationArrays
    timings: outputs.HostTimings
    progress: Progress
    stop: StopSignal
    stop_requested: threading.Event

    def choose_partition(self, tried: set[int], idle: bool,
                         rows_in_hand: int = 0) -> int | None:
        """The next partition: -1 when there is no more, None when nothing yet."""

    def wait_for_work(self) -> None:
        """Waits while there is nothing to take (raises Preempted on SIGTERM)."""

    def host_chains(self, part: manifest_lib.Partition
                    ) -> tuple[int, int, list[schedule.Chain]]:
        """(lo, hi, chains) of this host's slice of `part`."""

    def taken_over(self, pids) -> set[int]:
        """Of `pids` this process may still write, those another attempt has taken
        (committed or claimed)."""


class PartitionStream:
    """One worker's stream over its partitions; the runner drives it (`Worker.run`).

    sequence: the partitions in the order every host of a multi-host replica takes them;
      None on a one-host replica, which asks the worker's partition choice (claims, work
      stealing) as it goes.
    agreed: where a multi-host replica's sequence goes on once `sequence` is used up: the
      leader's partition choice as it goes (claims, work stealing), the same on every host
      (`distributed.LeaderSequence`, -1 when there is no more); None: `sequence` is all.
    """

    def __init__(self, worker: StreamHost, pool: writer.WriterPool, committer,
                 tried: set[int],
                 sequence: list[int] | None = None,
                 agreed: distributed.LeaderSequence | None = None):
        self.worker = worker
        self.pool = pool
        self.committer = committer
        self.tried = tried
        self.multi_host = worker.topo.hosts_per_replica > 1
        self.sequence = None if sequence is None and agreed is None else list(sequence or ())
        self.agreed = agreed
        self._next_index = 0
        self._lock = threading.Lock()
        # pid -> [partition, writer, rows left, started, index in sequence]
        self._in_hand: dict[int, list] = {}
        self._finished_here: set[int] = set()  # multi-host: written here, not yet committed
        self._committed_indices: set[int] = set()
        self._committed_through = 0  # every sequence index below it is committed
        # One-host replicas: the partitions taken over by another attempt while this
        # process was silent; their rows are run (the slots are planned) but neither
        # written nor committed (workers.loop.fence; multi-host replicas have none).
        self._fence = None if self.multi_host else fence.Fence(worker)

    def hand_empty(self) -> bool:
        """Whether this host has no rows in hand (what the partition choice asks)."""
        return not self._in_hand

    def rows_in_hand(self) -> int:
        """The rows of the partitions in hand this host has still to write (a partition
        chosen now ends after them: the choice of a slow host counts them)."""
        with self._lock:
            return sum(state[2] for state in self._in_hand.values())

    # -- planning (prefetch thread) ----------------------------------------------------
    def steps(self):
        return schedule.stream(self._next_partition, self.worker.local_batch,
                               pad_forever=self.multi_host)

    def _choose(self) -> tuple[int, int] | None:
        """(partition id, its index in the sequence), (-1, -1) when there is no more, or
        None when the leader has not chosen the next one yet (or, on a one-host replica,
        when nothing can be taken yet while rows are in hand)."""
        if self.sequence is None:
            while True:
                pid = self.worker.choose_partition(self.tried, idle=self.hand_empty(),
                                                   rows_in_hand=self.rows_in_hand())
                if pid is not None:
                    return pid, -1
                if self._in_hand:  # the free slots pad; asked again at the next step
                    return None
                # Nothing in hand and nothing to take yet (another replica's partitions
                # may come free): wait here, not in padding steps that burn the device;
                # a commit that failed meanwhile ends the wait (its partition stays held).
                self.committer.raise_failure()
                self.worker.wait_for_work()
        if self._next_index >= len(self.sequence):
            pid = self.agreed.next() if self.agreed is not None else -1
            if pid is None:
                return None
            if pid < 0:
                return -1, -1
            with self._lock:
                self.sequence.append(pid)
        self._next_index += 1
        return self.sequence[self._next_index - 1], self._next_index - 1

    def _next_partition(self):
        w = self.worker
        chosen = self._choose()
        if chosen is None:
            return schedule.NOT_YET
        pid, index = chosen
        if pid < 0:
            return None
        part = w.manifest.partition(pid)
        lo, hi, chain_list = w.host_chains(part)
        part_writer = writer.PartitionWriter(
            w.arrays, (lo, hi), self.pool,
            skip_if=None if self.multi_host else lambda: self._is_taken(pid))
        state = [part, part_writer, hi - lo, time.perf_counter(), index]
        with self._lock:
            self._in_hand[pid] = state
        if self._fence is not None:
            self._fence.opened(pid, part_writer)
        if hi == lo:  # nothing of it on this host
            self._done_here(pid, state)
        return pid, chain_list

    # -- outputs (output thread) ---------------------------------------------------------
    def on_output(self, batch: prefetch.Batch, outs: dict) -> None:
        step = batch.step
        written = np.asarray(step.write)
        timings = self.worker.timings
        pieces = outputs.host_pieces(outs, timings) if written.any() else {}
        stored = np.zeros(len(written), bool)  # the rows written: what this host extracted
        for pid in sorted({p for p, w in zip(step.partitions, step.write) if w}):
            with self._lock:
                state = self._in_hand[pid]
            mine = tuple(w and p == pid for p, w in zip(step.partitions, step.write))
            if not self._is_taken(pid):  # a taker's rows are its own tokens, not these
                outputs.add_rows(state[1], step.rows, mine, pieces, self.pool, timings, batch)
                stored |= mine
            state[2] -= sum(mine)
            if state[2] == 0:
                self._done_here(pid, state)
        progress = self.worker.progress
        progress.add_tokens(int((batch.segment_ids[stored] > 0).sum()))
        with self._lock:
            oldest = min(self._in_hand, default=None)
        with progress.lock:
            # With nothing left in hand the host may already wait for work ("idle", said by
            # the partition choice on the planning thread): this late output keeps that.
            if oldest is not None or progress.state == "starting":
                progress.state = "working"
            progress.partition, progress.step, progress.steps = oldest, batch.index + 1, 0

    def _is_taken(self, pid: int) -> bool:
        """Whether partition `pid` (one-host replicas) was taken over by another attempt."""
        return self._fence is not None and self._fence.is_taken(pid)

    def _done_here(self, pid: int, state: list) -> None:
        if self._is_taken(pid):  # another attempt's now
            with self._lock:
                del self._in_hand[pid]
            return
        with self._lock:
            if self.multi_host:
                self._finished_here.add(pid)
                return
            del self._in_hand[pid]
        self.committer.submit(state[0], state[1], state[3])

    # -- agreement (main thread, multi-host) ------------------------------------------
    def agree(self, batch: prefetch.Batch, settle) -> bool:
        """True when every host is out of work (the loop ends); raises Preempted on an
        agreed SIGTERM. One-host replicas check SIGTERM every step and never agree.
        settle() waits until the steps before `batch` are handled, so every host reports
        what it finished as of the same step."""
        w, where = self.worker, "the partitions in hand"
        if not w.stop.due(batch.index):
            return False
        if not self.multi_host:
            w.stop.stop_if(w.stop_requested.is_set(), batch.index, where)
            return False
        settle()
        flags = self._gather(w.stop_requested.is_set(), batch.step.done)
        w.stop.stop_if(bool(flags[:, 0].any()), batch.index, where)
        return bool(flags[:, 1].all())

    def finish(self) -> None:
        """After the last step: the multi-host replica commits what every host finished
        (every host took the same sequence to its end, so they agree as often)."""
        if not self.multi_host:
            return
        while True:
            through = self._committed_through
            self._gather(False, True)
            if not self._in_hand:
                return
            if self._committed_through == through:
                raise RuntimeError(f"partitions {sorted(self._in_hand)} were planned but not "
                                   f"finished on every host")

    def _gather(self, stop: bool, done: bool) -> np.ndarray:
        """All-gathers [stop, done, bitmap of the sequence indices finished here in the
        agreement window], commits the partitions every host has finished, in sequence
        order; returns [hosts, 2]."""
        base = self._committed_through  # the same on every host: it follows the gathers
        finished = np.zeros(AGREEMENT_WINDOW, bool)
        with self._lock:
            for pid in self._finished_here:
                offset = self._in_hand[pid][4] - base
                if offset < AGREEMENT_WINDOW:
                    finished[offset] = True
        words = np.packbits(finished, bitorder="little")
        local = np.zeros(2 + len(words), np.uint32)
        local[0], local[1] = stop, done
        local[2:] = words
        gathered = distributed.allgather_uint32(local)
        everywhere = np.unpackbits(np.bitwise_and.reduce(gathered[:, 2:].astype(np.uint8),
                                                         axis=0), count=AGREEMENT_WINDOW,
                                   bitorder="little")
        for index in base + np.flatnonzero(everywhere):
            if index in self._committed_indices:
                continue
            self._committed_indices.add(int(index))
            with self._lock:
                pid = self.sequence[index]
                state = self._in_hand.pop(pid)
                self._finished_here.discard(pid)
            self.committer.submit(state[0], state[1], state[3])  # the collective gather
        while self._committed_through in self._committed_indices:
            self._committed_indices.discard(self._committed_through)
            self._committed_through += 1
        return gathered[:, :2]
