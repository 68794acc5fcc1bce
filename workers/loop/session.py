"""One worker process's extraction session: heartbeats, writer pool and committer, open
while it extracts (`runner.Worker.open_session`), and what a heartbeat says of the
exception that ends a loop (`ended_by`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from actx.schemas import commit as commit_lib
from actx.schemas import version
from actx.workers.loop import progress
from actx.workers.replicas import distributed
from actx.workers.write import commit as commit_step
from actx.workers.write import writer


def ended_by(e: BaseException) -> dict:
    """The last heartbeat's state and message for an exception that ends the loop: a stop
    signal (Ctrl-C, a launcher's or a preemption's SIGTERM, even a second one that raises
    at once as `Stopped`) is a stop, which status reads as stopped, not a failure; the
    state keeps its heartbeat name "preempted" (schemas.heartbeat)."""
    if isinstance(e, KeyboardInterrupt):
        from actx.schemas import stop_signals

        return {"state": "preempted",
                "message": f"stopped by {stop_signals.signal_name(stop_signals.signum_of(e))}; "
                           f"nothing partial was committed"}
    return {"state": "failed", "message": f"{type(e).__name__}: {e}"}


class SessionHost(Protocol):
    """What a session uses of the worker that opens it (`runner.Worker`, which imports
    this module: the session names only these, so the two modules are not a circle)."""

    store: Any
    spec: Any
    host: str
    topo: Any
    attempt: str
    opts: Any
    progress: progress.Progress
    heartbeat_writer: Any
    heartbeat_s: float
    loaded: Any  # its model's `digest` goes into each marker
    numerics: Any  # schemas.activations_info.Numerics, also

    def is_committed(self, pid: int) -> bool: ...

    def run_stream(self, pool: writer.WriterPool, committer: commit_step.Committer,
                   tried: set[int], sequence: list[int] | None = None) -> None: ...

    def host_timings(self, pool: writer.WriterPool) -> Any: ...

    def on_commit(self, pid: int) -> None: ...


class Session:
    """One worker process's heartbeats, writer pool and committer, open while it extracts.

    `extract(pid)` does one partition to its commit; `Worker.run` and the Beam transform
    (adapters/beam_extract.py) both extract through the same step, writer and commit code.
    """

    def __init__(self, worker: SessionHost, tokens_left: int = 0):
        self.worker = worker
        # The rate counts from here, not from the model's loading.
        worker.progress.update(tokens_left=tokens_left, started=time.monotonic())
        self._beats = progress.HeartbeatThread(
            worker.store, worker.host, worker.topo.replica, worker.topo.host_index,
            worker.attempt, worker.progress, worker.heartbeat_s,
            writer=worker.heartbeat_writer, job=worker.opts.job)
        self._beats.start()
        self.pool = writer.WriterPool(worker.opts.writer_threads,
                                      worker.opts.max_pending_mb << 20)
        self.committer = commit_step.Committer(worker.store, worker.spec, worker.topo,
                                               worker.attempt, version.code_version(),
                                               on_commit=worker.on_commit,
                                               model_digest=worker.loaded.model.digest,
                                               numerics=worker.numerics)

    def extract(self, pids: list[int]) -> list[int]:
        """Extracts and commits the partitions of `pids` that are not committed, as
        `Worker.run` would (streamed with no barrier between them);
        returns those it ran. Nothing partial is committed when it raises."""
        w = self.worker
        todo = [p for p in pids if not w.is_committed(p)]
        if w.topo.hosts_per_replica > 1:  # one list on every host: the leader's
            todo = distributed.broadcast_ints(todo)
        if not todo:
            return []
        w.progress.update(held=tuple(todo))
        try:
            w.run_stream(self.pool, self.committer, set(), sequence=todo)
            self.committer.drain()
        except BaseException as e:
            w.progress.update(**ended_by(e))
            raise
        w.progress.update(state="idle", partition=None, held=())
        return todo

    def committed_by_me(self, pid: int) -> bool:
        """Whether this process's attempt holds the partition's marker (a duplicate attempt
        that lost the create-only race does not)."""
        marker = commit_lib.read_marker(self.worker.store, pid)
        return marker is not None and marker.attempt == self.worker.attempt

    def close(self, state: str | None = None) -> None:
        """Writes the last heartbeat (with `state`, when given) and stops the threads."""
        if state is not None:
            self.worker.progress.update(state=state, partition=None)
        self._beats.stop()
        self.committer.close()
        self.pool.shutdown()
        self.worker.host_timings(self.pool)  # the writer threads' share, for whoever asks
