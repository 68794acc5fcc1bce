"""The fence of a one-host replica: after a silence, no row over a taker's.

A process frozen (SIGSTOP), on a machine that slept, or cut off from its store long enough
for its heartbeats to look dead may find, when it runs again, that another attempt took
its partitions over (committed them, or claimed them after it). Its rows of those must not
be written over the taker's, and it must not commit them. Whichever thread asks first after
the silence (the output thread before a step's rows, a writer thread before a block's
write: after a freeze every thread resumes at once) looks the open partitions up, once a
silence (`Progress.was_silent`); a partition found taken stays taken.

The hosts of a multi-host replica cannot leave a partition out in step, so they have no
fence: there the bytes' being deterministic is what makes a second writer harmless.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger("actx.worker")


class FencedHost(Protocol):
    progress: object  # workers.loop.progress.Progress

    def taken_over(self, pids) -> set[int]:
        """Of `pids` this process may still write, those another attempt has taken."""


class Fence:
    """The partitions of a one-host replica's process that may still be written (their
    writers), and those another attempt took over."""

    def __init__(self, host: FencedHost):
        self._host = host
        self._lock = threading.Lock()
        self._taken: set[int] = set()
        self._writers: dict = {}  # pid -> PartitionWriter: opened, maybe still writing

    def opened(self, pid: int, part_writer) -> None:
        """Partition `pid`'s writer, from now on written by this process."""
        with self._lock:
            self._forget_writers_done()
            self._writers[pid] = part_writer

    def is_taken(self, pid: int) -> bool:
        """Whether partition `pid` was taken over by another attempt (looked up again
        after each silence of this process's heartbeats)."""
        with self._lock:
            if self._host.progress.was_silent():
                self._leave_taken_over()
            return pid in self._taken

    def _leave_taken_over(self) -> None:
        """After a silence: the partitions whose writers may still write that another
        attempt took meanwhile are written no further and not committed. Caller holds
        the lock."""
        self._forget_writers_done()
        taken = self._host.taken_over(list(self._writers))
        if not taken:
            return
        self._taken |= taken
        progress = self._host.progress
        with progress.lock:
            progress.held = tuple(p for p in progress.held if p not in taken)
        log.warning("this process's heartbeats were silent (frozen, or cut off from the "
                    "store) long enough to look dead; partition(s) %s were taken over "
                    "meanwhile by another attempt: their rows here are not written, and "
                    "this process does not commit them", sorted(taken))

    def _forget_writers_done(self) -> None:
        """Drops the writers that write no more (finished) or are the takers' (taken), so
        the ones kept are the few in flight. Caller holds the lock."""
        for pid in [p for p, w in self._writers.items() if w.finished or p in self._taken]:
            del self._writers[pid]
