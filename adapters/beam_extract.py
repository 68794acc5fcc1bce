"""Extraction as a Beam transform: the same workers, scheduled, retried and autoscaled by a
data engine (Beam's local runners, Dataflow GPU or TPU workers, Flink, Spark).

`ExtractPartitions` takes partition ids and yields a `CommitRecord` per partition. Each
worker process loads the model once onto its local devices (one replica per process, shared
by the DoFn instances of the process) and extracts a bundle's partitions as one stream with
the same step, writer and commit code as `actx extract` (`workers.loop.session.Session`).
Retries are safe: a failed or duplicated attempt leaves no marker or loses the create-only
marker race, so each partition is committed exactly once. This is the one module that
imports both Beam and JAX (through workers.loop.runner). A generating run (spec.generate) goes through the same
session: its worker (workers/generate/worker.py) generates a bundle's partitions one after
another, and a retried or duplicated partition writes the same tokens, since what is
generated depends on the run's seed, the document and the sample alone.

Command line (what `actx submit` runs for `target.extract: beam`, and what docs/dataflow.md
shows): `python -m actx.adapters.beam_extract --run RUN [worker flags] [Beam flags]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import threading

from actx.pipeline import quiet_beam  # noqa: F401 (first: Beam's import, quietly)
import apache_beam as beam
from apache_beam.metrics import Metrics

from actx.schemas import activations_info as info_lib
from actx.schemas import errors, flags, layout, run_dir, worker_options
from actx.schemas import extraction as extraction_lib

log = logging.getLogger("actx.beam_extract")
NAMESPACE = "actx"


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """What happened to one partition.

    partition: its id. outcome: "committed" (by this attempt), "already committed" (found
    committed; nothing was done) or "committed by another attempt" (a duplicate attempt
    lost the create-only marker race; the committed data is the winner's).
    tokens / rows: the partition's size. host: the worker process that handled it.
    """

    partition: int
    outcome: str
    tokens: int
    rows: int
    host: str


class _ProcessReplica:
    """One model replica per worker process, shared by the DoFn instances (threads) of the
    process: loaded on first use, its session closed when the last instance tears down."""

    _lock = threading.Lock()
    _by_options: dict = {}

    def __init__(self, opts: worker_options.WorkerOptions):
        from actx.workers.flax import worker as flax_worker  # JAX: only in worker processes

        self.worker = flax_worker.worker_for_run(opts)
        self.session = self.worker.open_session()
        self.step_lock = threading.Lock()  # one partition at a time on the devices
        self.users = 0

    @classmethod
    def acquire(cls, opts: worker_options.WorkerOptions) -> "_ProcessReplica":
        with cls._lock:
            replica = cls._by_options.get(opts)
            if replica is None:
                replica = cls._by_options[opts] = cls(opts)
            replica.users += 1
            return replica

    @classmethod
    def loaded(cls, opts: worker_options.WorkerOptions) -> bool:
        with cls._lock:
            return opts in cls._by_options

    @classmethod
    def release(cls, opts: worker_options.WorkerOptions) -> None:
        with cls._lock:
            replica = cls._by_options.get(opts)
            if replica is None:
                return
            replica.users -= 1
            if replica.users == 0:
                del cls._by_options[opts]
                replica.session.close(state="done")


class ExtractPartitionFn(beam.DoFn):
    """Partition id in, CommitRecord out; the model loads once per worker process."""

    def __init__(self, opts: worker_options.WorkerOptions):
        self._opts = opts
        self._replica = None
        self._process_opts = None
        self._committed = Metrics.counter(NAMESPACE, "partitions_committed")
        self._skipped = Metrics.counter(NAMESPACE, "partitions_already_committed")
        self._lost = Metrics.counter(NAMESPACE, "partitions_lost_race")
        self._tokens = Metrics.counter(NAMESPACE, "tokens")
        self._bytes = Metrics.counter(NAMESPACE, "activation_bytes")

    def setup(self):
        # One heartbeat per worker process: its machine and pid name it. The first is
        # written now, before the model loads (which takes the longest), and names the
        # bundle's partitions once they arrive: a process killed at any point (SIGKILL,
        # out of memory) leaves a heartbeat that status and the launcher see as dead.
        host = self._opts.host_name or f"beam-{socket.gethostname()}-{os.getpid()}"
        self._process_opts = dataclasses.replace(self._opts, host_name=host)
        # The run as the extraction sees it: its markers and heartbeats are its own.
        self._run = extraction_lib.scoped(run_dir.open_run(self._opts.run),
                                          self._opts.extraction or "")
        if not _ProcessReplica.loaded(self._process_opts):  # else its session beats
            self._early_beat(())

    def _early_beat(self, held: tuple[int, ...]) -> None:
        """The process's heartbeat before its replica (and the replica's heartbeat thread)
        exists."""
        import time

        from actx.schemas import heartbeat as heartbeat_lib

        host = self._process_opts.host_name
        beat = heartbeat_lib.Heartbeat(
            host=host, replica=0, process_index=0, state="starting",
            attempt=f"{host}-{os.getpid()}-setup", updated_at=time.time(), held=held,
            machine=heartbeat_lib.this_machine(), pid=os.getpid(), job=self._opts.job)
        try:
            heartbeat_lib.HeartbeatWriter(self._run.store, host).beat(beat, force=True)
        except Exception as e:  # a missed heartbeat must not stop extraction
            log.warning("heartbeat write failed: %s", e)

    def _load_beating(self, held: tuple[int, ...]) -> "_ProcessReplica":
        """Loads the process's replica, beating (naming `held`) meanwhile: a long load is
        no silence that status would take for a dead process. (Once another DoFn instance
        of the process has loaded it, its session beats.)"""
        if _ProcessReplica.loaded(self._process_opts):
            return _ProcessReplica.acquire(self._process_opts)
        stop = threading.Event()

        def beat():
            while True:
                self._early_beat(held)
                if stop.wait(self._opts.heartbeat_s):
                    return

        beats = threading.Thread(target=beat, daemon=True, name="actx-early-heartbeat")
        beats.start()
        try:
            return _ProcessReplica.acquire(self._process_opts)
        finally:
            stop.set()
            beats.join(timeout=30)

    def start_bundle(self):
        self._taken: list = []  # this bundle's partitions, extracted together at its end

    def process(self, partition_id: int):
        part = self._run.manifest.partition(int(partition_id))
        if self._run.store.exists(layout.commit_key(part.id)):
            self._skipped.inc()
            yield CommitRecord(part.id, "already committed", part.tokens, part.row_count,
                               self._process_opts.host_name)
        else:
            self._taken.append(part)

    def finish_bundle(self):
        """Extracts the bundle's partitions as one stream, the way a worker process runs
        its partitions (no barrier between them), and emits a record per partition once
        all are committed. A failure fails the bundle; its retry skips what committed."""
        from apache_beam.transforms import window
        from apache_beam.utils.windowed_value import WindowedValue

        taken, self._taken = self._taken, []
        if not taken:
            return
        if self._replica is None:  # the model loads once per process, at its first bundle
            self._replica = self._load_beating(tuple(p.id for p in taken))
        worker = self._replica.worker
        with self._replica.step_lock:
            ran = set(self._replica.session.extract([p.id for p in taken]))
        info = info_lib.read_info(worker.store)
        for part in taken:
            mine = part.id in ran and self._replica.session.committed_by_me(part.id)
            if mine:
                self._committed.inc()
                self._tokens.inc(part.tokens)
                if info is not None:
                    self._bytes.inc(info.bytes_per_row(worker.manifest.seq_len)
                                    * part.row_count)
            else:
                self._lost.inc()
            record = CommitRecord(part.id, "committed" if mine else
                                  "committed by another attempt", part.tokens, part.row_count,
                                  worker.host)
            yield WindowedValue(record, window.GlobalWindow().max_timestamp(),
                                [window.GlobalWindow()])

    def teardown(self):
        if self._process_opts is not None and self._replica is not None:
            _ProcessReplica.release(self._process_opts)
            self._process_opts = None


class ExtractPartitions(beam.PTransform):
    """Partition ids → CommitRecords. A reshuffle first spreads the partitions over the
    workers, so a slow worker does not hold a bundle of them."""

    def __init__(self, opts: worker_options.WorkerOptions):
        super().__init__()
        self._opts = opts

    def expand(self, partition_ids):
        return (partition_ids
                | "Spread" >> beam.Reshuffle()
                | "Extract" >> beam.ParDo(ExtractPartitionFn(self._opts)))


def uncommitted(opened: run_dir.OpenedRun, only=None) -> list[int]:
    """Ids of the uncommitted partitions of an opened run (as one extraction sees it:
    `schemas.extraction.scoped`), restricted to `only`."""
    done = opened.committed(len(opened.manifest.partitions))
    wanted = None if only is None else set(only)
    return [p.id for p in opened.manifest.partitions
            if p.id not in done and (wanted is None or p.id in wanted)]


def extractions(opened: run_dir.OpenedRun, wanted: str | None) -> dict[str, run_dir.OpenedRun]:
    """{name: the run as it sees it} for the extractions `wanted` names ("base,chat",
    "all"; None: the default one, ""), each checked to exist in the run."""
    return extraction_lib.scoped_all(opened, wanted or "default")


def run_extract(settings: worker_options.ExtractSettings, run: "str | run_dir.OpenedRun",
                job: str, pipeline_args: list[str], only=None,
                expect_fingerprint: str | None = None, extraction: str | None = None) -> int:
    """Extracts the uncommitted partitions of each extraction `extraction` names (None: the
    default one) through the transform, one pipeline per extraction, one after another
    (one model per pipeline); returns how many partitions they were given (0: nothing to
    do). `run`: its location, or the run opened already."""
    from actx.pipeline import options as options_lib  # the runner, named explicitly

    opened = run if isinstance(run, run_dir.OpenedRun) else run_dir.open_run(run)
    location = str(opened.location)
    given = 0
    wanted = extractions(opened, extraction)
    for name, scoped in wanted.items():
        ids, fingerprint = uncommitted(scoped, only), scoped.spec.fingerprint
        # A named extraction has its own spec; the launcher's is the root one.
        if not name and expect_fingerprint and expect_fingerprint != fingerprint:
            raise errors.NotARunError(
                f"{location}: run fingerprint {fingerprint} differs from the launcher's spec "
                f"({expect_fingerprint}); use the spec the run was made with, or a new run")
        if not ids:
            continue
        if name:
            log.info("extraction %r: %d partition(s)", name, len(ids))
        opts = worker_options.WorkerOptions.for_job(
            settings, run=location, job=job, expect_fingerprint=fingerprint, steal=False,
            replicas=1, replica=0, host_name=None, coordinator=None, num_processes=None,
            process_id=None, only=None, extraction=name or None)
        pipeline = options_lib.make_pipeline(pipeline_args)
        _ = (pipeline
             | "Partitions" >> beam.Create(ids)
             | "ExtractPartitions" >> ExtractPartitions(opts))
        pipeline.run().wait_until_finish()
        given += len(ids)
    return given


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m actx.adapters.beam_extract", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other flags are Beam PipelineOptions (--runner, --direct_num_workers, ...).")
    # The worker's own flags: launchers derive them from the same WorkerOptions. Each Beam
    # worker process is a replica of one host that takes what the runner gives it, so the
    # placement flags are accepted and replaced.
    flags.add_arguments(p, worker_options.WorkerOptions)
    return p


def main(argv: list[str] | None = None) -> int:
    args, pipeline_args = _parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = flags.from_namespace(worker_options.WorkerOptions, args)
    try:
        opened = run_dir.open_run(args.run)
        n = run_extract(settings, opened, args.job, pipeline_args, args.only,
                        args.expect_fingerprint, args.extraction)
        scoped = extractions(opened, args.extraction)
    except errors.UserError as e:
        print(f"actx extract (beam): error: {e}", file=sys.stderr)
        return 2
    left = sum(len(uncommitted(s, args.only)) for s in scoped.values())
    print(f"extract (beam): {n} partition(s) given to the pipeline"
          + (f" ({len(scoped)} extractions)" if list(scoped) != [""] else "")
          + f"; {left} left uncommitted", flush=True)
    return 1 if left else 0


if __name__ == "__main__":
    # Run through the package's module, not __main__, so the DoFn and its records pickle
    # under their importable names for Beam's worker processes.
    from actx.adapters import beam_extract

    sys.exit(beam_extract.main())
