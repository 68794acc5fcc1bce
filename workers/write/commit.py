"""Committing a partition: wait until every host's shards are durable, then the marker.

One-host replicas commit on a background thread, so the chips start the next partition
while the last shards of the previous one drain to storage. Multi-host replicas commit in
the loop, because gathering every host's checksums is a collective that must run in the
same order on all hosts. The rule itself (create-only marker, written last) lives in
`schemas.commit`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Callable

import numpy as np

from actx.schemas import activations_info as info_lib
from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import runspec as runspec_lib
from actx.workers.loop import faults, schedule
from actx.workers.replicas import distributed
from actx.workers.write import writer

log = logging.getLogger("actx.worker")


class RunRemovedError(errors.UserError, RuntimeError):
    """The run's files were removed while a worker extracted it."""


class Committer:
    def __init__(self, store, spec: runspec_lib.RunSpec, topo: schedule.Topology, attempt: str,
                 code_version: str, on_commit: Callable[[int], None] = lambda pid: None,
                 model_digest: str | None = None, numerics: info_lib.Numerics | None = None):
        """model_digest / numerics: this worker's, as its markers record them (what
        activations/actx.json holds for the run's first attempt)."""
        self._store = store
        self._spec = spec
        self._topo = topo
        self._attempt = attempt
        self._code_version = code_version
        self._model_digest = model_digest or None
        self._numerics = numerics
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, "actx-commit")
                          if topo.hosts_per_replica == 1 else None)
        self._pending: list[concurrent.futures.Future] = []
        self._on_commit = on_commit
        # The first background commit's failure, for a thread that waits for work and
        # would not submit again to learn it (raise_failure).
        self._failure: BaseException | None = None

    def submit(self, part: manifest_lib.Partition, part_writer: writer.PartitionWriter,
               started: float) -> None:
        """Commits `part` once its writes are durable (in the background where allowed)."""
        self._raise_failures()
        if self._executor is None:
            self._finish(part, part_writer, started)
        else:
            future = self._executor.submit(self._finish, part, part_writer, started)
            future.add_done_callback(self._note_failure)
            self._pending.append(future)

    def _note_failure(self, future: concurrent.futures.Future) -> None:
        if self._failure is None and not future.cancelled() and future.exception():
            self._failure = future.exception()

    def raise_failure(self) -> None:
        """Re-raises a background commit's failure, from any thread: a host waiting for
        work (its failed partitions still held, so no other host takes them) stops with
        it, where it would wait for ever."""
        if self._failure is not None:
            raise self._failure

    def drain(self) -> None:
        """Waits for every submitted partition; re-raises the first failure."""
        for future in self._pending:
            future.result()
        self._pending.clear()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _raise_failures(self) -> None:
        for future in [f for f in self._pending if f.done()]:
            future.result()
            self._pending.remove(future)

    def _finish(self, part: manifest_lib.Partition, part_writer: writer.PartitionWriter,
                started: float) -> None:
        try:
            checksums = part_writer.finish()
        except writer.TakenOver as e:
            log.warning("partition %d is not committed by this process: another attempt "
                        "took it over while this one was silent (%s)", part.id, e)
            return
        except Exception:
            # A write into a directory removed under it fails in the store's own words
            # (a rename to a path that is gone): said as what happened, where it did. An
            # `rm -r` still under way may have taken a shard's folder and not yet
            # actx.json: the arrays' metadata is looked at too, and once more a moment
            # later (on this failure only).
            metadata_keys = [f"{layout.activation_array_key(h)}/zarr.json"
                             for h in part_writer.dtypes]
            for wait_s in (0.0, 1.0):
                time.sleep(wait_s)
                self._check_run_stands(part, metadata_keys)
            raise
        faults.maybe_crash("before_commit")
        merged = self._gather(part, checksums)
        if merged is None:  # not the replica's leader
            return
        prefix = writer.TOKENS_PREFIX
        token_sums = {name[len(prefix):]: sums for name, sums in merged.items()
                      if name.startswith(prefix)}
        merged = {name: sums for name, sums in merged.items() if not name.startswith(prefix)}
        # A token array whose rows were not given with the activations (a generating
        # worker reads no segment ids) is not recorded.
        blocks = len(next(iter(merged.values()), []))
        token_sums = {name: sums for name, sums in token_sums.items()
                      if blocks and len(sums) == blocks}
        marker = commit_lib.CommitMarker(
            partition=part.id, fingerprint=self._spec.fingerprint, row_start=part.row_start,
            row_count=part.row_count, tokens=part.tokens,
            block_rows=self._spec.layout.rows_per_shard, checksums=merged,
            dtypes={h: part_writer.dtypes[h] for h in merged}, attempt=self._attempt,
            hosts=tuple(f"r{self._topo.replica}h{h}" for h in range(self._topo.hosts_per_replica)),
            timings_s={"total": round(time.perf_counter() - started, 3)},
            code_version=self._code_version, created_at=time.time(),
            token_checksums=token_sums or None, model_digest=self._model_digest,
            numerics=self._numerics)
        self._check_run_stands(part)
        if commit_lib.commit(self._store, marker) or self._is_own(marker):
            self._on_commit(part.id)

    def _check_run_stands(self, part: manifest_lib.Partition, also=()) -> None:
        """Refuses to commit into a run whose files were removed under this worker (its
        run.json, or activations/actx.json, which the workers write before any data; and
        `also`, more keys written before any data): a marker there would say finished
        about data that is gone."""
        gone = [key for key in (runspec_lib.RUN_SPEC_KEY, layout.ACTIVATIONS_INFO_KEY, *also)
                if not self._store.exists(key)]
        if len(gone) > 2:
            gone = gone[:2] + [f"{len(gone) - 2} more"]
        if gone:
            run = self._store.location
            next_step = ("submit the same config again: it prepares the run afresh"
                         if runspec_lib.RUN_SPEC_KEY in gone else
                         f"`{advice.repair(run)}` turns the committed partitions back "
                         f"into pending, then `{advice.rerun(run)}` extracts them again")
            raise RunRemovedError(
                f"{run}: {' and '.join(gone)} removed while this worker extracted (the run "
                f"directory, or its activations/, was deleted); partition {part.name} is "
                f"not committed, nor is any other from now on; {next_step}")

    def _is_own(self, marker: commit_lib.CommitMarker) -> bool:
        """After a refused create: whether the standing marker is this attempt's own (a
        retried write meeting what its lost first try wrote). Otherwise another attempt
        won the race, its marker stands, and this one counts nothing."""
        standing = commit_lib.read_marker(self._store, marker.partition)
        if standing is not None and standing.attempt == marker.attempt:
            if standing.checksums != marker.checksums:  # one attempt, one set of bytes
                log.error("partition %d: the marker of this attempt (%s) holds other "
                          "checksums than its data now has; `%s` will say which blocks",
                          marker.partition, marker.attempt,
                          advice.verify(self._store.location))
            log.warning("partition %d: the marker this attempt wrote was already there (a "
                        "lost response, retried); counted once", marker.partition)
            return True
        other = standing.attempt if standing is not None else "?"
        same = standing is not None and standing.checksums == marker.checksums
        log.warning("partition %d was already committed by attempt %s; its marker stands "
                    "(%s)", marker.partition, other,
                    "same checksums" if same else "OTHER checksums: is the run deterministic?")
        return False

    def _gather(self, part: manifest_lib.Partition,
                checksums: dict[str, list[str]]) -> dict[str, list[str]] | None:
        """Every host's block checksums in row order, on the leader (None elsewhere).

        The gather is also the barrier: it returns once every host's writes are durable.
        """
        hosts = self._topo.hosts_per_replica
        if hosts == 1:
            return checksums
        hooks = sorted(checksums)
        shards = -(-part.row_count // self._spec.layout.rows_per_shard)
        max_blocks = -(-shards // hosts)
        local = np.zeros((len(hooks), max_blocks + 1), np.uint32)
        for i, hook in enumerate(hooks):
            local[i, 0] = len(checksums[hook])
            local[i, 1:1 + len(checksums[hook])] = [int(c, 16) for c in checksums[hook]]
        gathered = distributed.allgather_uint32(local)
        if self._topo.host_index != 0:
            return None
        return {hook: [f"{int(c):08x}" for h in range(hosts)
                       for c in gathered[h, i, 1:1 + gathered[h, i, 0]]]
                for i, hook in enumerate(hooks)}
