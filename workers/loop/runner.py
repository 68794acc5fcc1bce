"""The per-host extraction loop: partitions in, committed activation shards out.

Each host of a replica runs this same loop in lockstep. This thread only dispatches steps:
up to `steps_in_flight` steps run ahead of the host, whose outputs travel to host memory
asynchronously (pinned host memory where the backend has it) and are handled on a thread of
their own (`workers.loop.outputs`): their rows go into whole-shard blocks that a bounded pool
writes, and a partition is committed once its last row is durable on every host
(`workers.write.commit`). Partitions stream through the batch slots with no barrier between them
(`workers.loop.partition_stream`), whatever the packing; a long document's rows go through one slot
in successive steps (`workers.loop.schedule`). A SIGTERM stops the loop between steps without
committing the partition in hand. What a run must be for this worker to write into it is
checked first (`workers.loop.admission`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

import numpy as np

from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import run_dir
from actx.schemas import config as config_lib
from actx.schemas import extraction as extraction_lib
from actx.schemas import layout
from actx.schemas import parallelism
from actx.schemas import request_budget
from actx.schemas import manifest as manifest_lib
from actx.schemas import ts_context
from actx.schemas import worker_options
from actx.workers.write import commit as commit_step
from actx.workers.loop import (admission, faults, outputs, prefetch, progress, schedule,
                               partition_stream, transfer)
from actx.workers.model import loaded as loaded_model
from actx.workers.replicas import distributed, chooser
from actx.workers.write import metadata, writer
from actx.workers.loop.session import Session, ended_by
from actx.workers.replicas.stop import Preempted, StopSignal

log = logging.getLogger("actx.worker")
# When this process began (this module is imported at its start): a heartbeat of its job
# from before is another launch's under the same job name.
_PROCESS_STARTED_AT = time.time()


class Worker:
    def __init__(self, opts: worker_options.WorkerOptions,
                 opened: run_dir.OpenedRun | None = None):
        """`opened`: the run `opts.run` names, if the caller has opened it (after
        `ts_context.configure` with these options, as `workers.main` does)."""
        import jax

        from actx.workers.model import sharding

        self.opts = opts
        self.jax = jax
        self._started_at = time.time()
        if opened is None:  # the store's limits hold from the run's first read
            ts_context.configure(opts.gcs_request_concurrency, opts.gcs_request_retries)
            opened = run_dir.open_run(opts.run)
        # One extraction per worker (schemas.extraction): its spec, and a view of the run's
        # store that keeps its activations, numerics record, markers and claims apart.
        self.extraction = opts.extraction or ""
        self.location, self.manifest = opened.location, opened.manifest
        self.store = opened.extraction(self.extraction).store
        self.spec = extraction_lib.read_spec(opened, self.extraction)
        admission.check_spec(self.location, self.spec, self.manifest, opts.expect_fingerprint,
                             run_spec=opened.spec)
        n = len(self.manifest.partitions)
        unknown = sorted(set(opts.only or ()) - set(range(n)))
        if unknown:  # exits 2 (workers.main), as `actx rerun --only` does
            raise ValueError(f"--only: partition(s) {unknown} do not exist (the run has {n} "
                             f"partition(s), 0..{n - 1}); nothing was extracted")
        self.topo = schedule.Topology(
            replicas=opts.replicas, replica=opts.replica,
            hosts_per_replica=jax.process_count(), host_index=jax.process_index())
        split = parallelism.hosts_problem(opts.batch_size, self.topo.hosts_per_replica)
        if split:
            raise ValueError(f"batch size: {split}")
        model = parallelism.model_parallel_problem(opts.model_parallel,
                                                   jax.local_device_count())
        if model:
            raise ValueError(f"model_parallel: {model}")
        self.local_batch = opts.batch_size // self.topo.hosts_per_replica
        self.mesh = sharding.make_mesh(data=-1, model=opts.model_parallel)
        sharding.check_batch(opts.batch_size, self.mesh)
        self._warn_idle_hosts()
        self.host = opts.host_name or (
            f"{socket.gethostname()}-r{self.topo.replica}h{self.topo.host_index}")
        self.attempt = f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.stop = StopSignal(self.topo.hosts_per_replica, opts.stop_check_steps)
        self.stop_requested = self.stop.requested  # set on SIGTERM (workers.replicas.stop)
        self.progress = progress.Progress()
        # Every host of the pod beats: the interval grows with them, so the pod's heartbeats
        # stay within the bucket's budget for them (schemas.request_budget).
        self.heartbeat_s = request_budget.heartbeat_interval_s(
            opts.heartbeat_s, self.topo.replicas * self.topo.hosts_per_replica)
        self.choice = chooser.Chooser(
            self.store, self.manifest, self.topo, opts.job, self.attempt, only=opts.only,
            steal=opts.steal)
        # Heartbeats start before the model loads, so status shows a host that is loading
        # (or that failed to) instead of nothing; the session's thread takes over after.
        startup = progress.HeartbeatThread(
            self.store, self.host, self.topo.replica, self.topo.host_index, self.attempt,
            self.progress, self.heartbeat_s, job=opts.job)
        self.heartbeat_writer = startup.writer
        self.progress.update(phase="loading the model")  # `loading` adds what and how big
        startup.start()
        try:
            self._admit(jax, opts)
        except BaseException as e:
            interrupted = isinstance(e, KeyboardInterrupt)
            # A worker the run refuses (launched with other settings than the run's
            # numerics record, another model) did nothing to the run: status shows a
            # refused attempt, which goes once the run completes, not a failed host.
            refused = isinstance(e, admission.RunMismatch)
            self.progress.update(
                state="preempted" if interrupted else "refused" if refused else "failed",
                message="interrupted while starting; nothing was committed" if interrupted
                else f"refused: {e}; nothing was committed" if refused
                else f"failed while starting: {type(e).__name__}: {e}")
            startup.stop()
            raise
        startup.stop(final_beat=False)

    def _metadata_writer_gone(self) -> str | None:
        """Why the process that writes the run's metadata will not (None: it may). Its
        heartbeats count from this process's start, not this worker's: with several
        extractions, one after another, the writer may have died during an earlier one,
        and its launcher marked it failed in this one's heartbeats before this worker
        began (it waited the whole 900 s for it)."""
        return metadata.writer_gone(self.store, self.opts.job,
                                    min(self._started_at, _PROCESS_STARTED_AT))

    def _architecture(self) -> str | None:
        """The HF architecture of a checkpoint's model (None for a Flax model)."""
        arch = getattr(getattr(self.loaded.model, "config", None), "architecture", None)
        return arch if isinstance(arch, str) else None

    def _transformer_lens_differs(self) -> str | None:
        """Where TransformerLens's model of this checkpoint differs from HF's (a Phi-3
        with partial rotary or rope_scaling), for the reader's TransformerLens names."""
        from actx.workers.model import capture as capture_lib

        return capture_lib.transformer_lens_difference(getattr(self.loaded.model, "config",
                                                               None))

    def _admit(self, jax, opts: worker_options.WorkerOptions) -> None:
        """Loads the model and checks the run against it (the rest of `__init__`)."""
        self.loaded = self.load_model()
        # A long document continued into a partition runs its warm-up rows first, in the
        # same slot: the model decides how many, so the order waits for it.
        self.choice.order_by_warmup(self.loaded.warmup_rows or 0)
        self.progress.update(phase="checking the run against the model")
        admission.check_token_layout(self.store, self.location)
        self.numerics = admission.numerics_key(jax, self.mesh, opts.batch_size,
                                               opts.model_parallel,
                                               attention=self.loaded.attention)
        self._committed = commit_lib.committed_partitions(self.store)
        hook_dtypes = self.hook_dtypes()
        # One process writes what every host would (actx.json, each zarr.json); the others
        # wait for it and read it (workers.write.metadata).
        writes = metadata.writes_metadata(self.topo.replica, self.topo.host_index)
        if not writes:
            self.progress.say_phase("waiting for process 0 of replica 0 to write the run's "
                                    "metadata")
        admission.check_activation_info(self.store, self.location, self.spec,
                                        self.loaded.hooks, self.loaded.model.digest,
                                        self.numerics,
                                        opts.allow_numerics_change,
                                        nothing_committed=not self._committed,
                                        hook_dtypes=hook_dtypes,
                                        architecture=self._architecture(),
                                        transformer_lens_differs=self._transformer_lens_differs(),
                                        writes=writes, writer_gone=self._metadata_writer_gone)
        admission.check_activation_metadata(self.store, self.location, self.loaded.hooks)
        self.arrays = writer.ActivationArrays(
            self.location.join(layout.extraction_prefix(self.extraction)), self.loaded.hooks,
            self.manifest.total_rows, self.manifest.seq_len, self.spec.capture.dtype,
            self.spec.layout, hook_dtypes, store=None if writes else self.store,
            writer_gone=self._metadata_writer_gone)
        self.tokens = prefetch.TokenStore(self.location)
        self.timings = outputs.HostTimings()
        # A generating worker runs its own steps (workers.generate.worker): no extract step.
        fn = self.loaded.fn
        self.transfer = None if fn is None else transfer.HostTransfer(jax, fn, opts.batch_size)
        # `concat` rows are one causal stream across documents: the model must not apply
        # the per-document mask there, while segment ids still tell padding apart.
        self.one_segment_per_row = self.spec.packing.mode == "concat"
        self._compiled = False

    def hook_dtypes(self) -> dict[str, str] | None:
        """Each stored array's dtype where it is not the capture's (None: none)."""
        from actx.workers.model import capture as capture_lib

        return capture_lib.hook_dtypes(self.loaded.hooks, self.spec.capture.dtype)

    def loading(self, what: str, path: str) -> None:
        """Says that weights are loading, with their size when the checkpoint is a local
        directory."""
        from actx.workers.model import checkpoint

        size = checkpoint.local_weight_bytes(path)
        self.progress.say_phase(f"loading weights: {what}"
                                + (f" ({size / 2**20:,.1f} MB)" if size else ""))

    def load_model(self) -> loaded_model.LoadedModel:
        """The run's model on the mesh with its step (`loaded_model.LoadedModel`): the one
        part of the worker that differs for a user's Flax model (`workers.flax.worker`)
        or a generating run (`workers.generate.worker`)."""
        return loaded_model.load_checkpoint(self.jax, self.spec, self.manifest, self.mesh,
                                            self.opts, self.loading)

    def _warn_idle_hosts(self) -> None:
        hosts, rps = self.topo.hosts_per_replica, self.spec.layout.rows_per_shard
        shards = self.spec.layout.partition_rows // rps
        if hosts > 1 and shards % hosts:
            log.warning("a partition holds %d shards of %d rows, not a multiple of the %d "
                        "hosts: some hosts run padding steps; choose partition_rows a multiple "
                        "of %d", shards, rps, hosts, hosts * rps)

    def numerics_key(self) -> dict:
        """What, besides the RunSpec, decides the bytes a step produces (as recorded in
        activations/actx.json)."""
        return config_lib.to_dict(self.numerics)

    # -- partition choice (workers.replicas.choice_policy) ----------------------------------
    def _candidates(self) -> list[int]:
        """This replica's own partitions (within `only`), in order."""
        return list(self.choice.own)

    def _own_left(self) -> list[int]:
        """This replica's own partitions left, by the start-up listing, not a marker read
        each: a replica that does not steal is their only writer, and the reads, one after
        another before the first step, grew with the run (100k partitions: an hour)."""
        return [p for p in self._candidates() if p not in self._committed]

    def is_committed(self, pid: int) -> bool:
        """Whether partition `pid` has its commit marker."""
        # One object read per candidate; the start-up listing covers the common case.
        if pid in self._committed or self.store.exists(layout.commit_key(pid)):
            self._committed.add(pid)
            return True
        return False

    def taken_over(self, pids) -> set[int]:
        """Of partitions this process may still write (a one-host replica's), those
        another attempt has taken: committed by it (a marker of another attempt, or one
        that does not read), or claimed after this one. Asked after a silence of this
        process's heartbeats (`Progress.was_silent`): its rows of them must not be written
        over the taker's."""
        taken = set()
        for pid in pids:
            try:
                marker = commit_lib.read_marker(self.store, pid)
            except ValueError:  # damaged: not this process's, which writes whole markers
                marker = None
                taken.add(pid)
            if (marker is not None and marker.attempt != self.attempt) \
                    or self.choice.claimed_by_another(pid):
                taken.add(pid)
        return taken

    def choose_partition(self, tried: set[int], idle: bool = True,
                         rows_in_hand: int = 0) -> int | None:
        """The next partition to extract: -1 when there is no more, None when there is
        nothing to take now but there may be later (ask again). Its own first; when
        stealing, claimed, and another replica's only where its owner will not reach it
        soon (workers.replicas.choice_policy). idle: whether this host has no rows in hand;
        rows_in_hand: how many it has still to write (the partition stream says both while
        it runs)."""
        pid = self.choice.choose(tried, self.is_committed, idle=idle,
                                 rows_in_hand=rows_in_hand)
        with self.progress.lock:
            self.progress.stolen_from = dict(self.choice.stolen_from)
            self.progress.given_up = dict(self.choice.given_up)
            self.progress.idle_reason = self.choice.why_waiting if pid is None and idle else ""
        if pid is not None and pid >= 0:
            # Claimed ahead of the partition in hand (prefetch): if this process dies,
            # status shows it stale with the one in hand, not pending.
            self.progress.hold(pid)
        return pid

    def wait_for_work(self) -> None:
        """With nothing in hand and nothing to take yet: waits a heartbeat interval, or
        raises Preempted at once on SIGTERM (nothing is in hand to lose)."""
        self.progress.update(state="idle", partition=None)  # `idle_reason` says why
        if self.stop_requested.wait(max(0.2, self.opts.heartbeat_s)):
            raise Preempted("stopped while waiting for work (nothing was in hand)")

    # -- one partition -----------------------------------------------------------------
    def _handle(self, batch: prefetch.Batch, outs: dict, part_writer: writer.PartitionWriter,
                pool: writer.WriterPool):
        written = np.asarray(batch.step.write)
        if written.any():
            outputs.add_rows(part_writer, batch.step.rows, batch.step.write,
                             outputs.host_pieces(outs, self.timings), pool, self.timings,
                             batch)
        self.progress.add_tokens(int((batch.segment_ids[written] > 0).sum()))
        self.progress.update(step=batch.index + 1)

    def host_chains(self, part: manifest_lib.Partition
                    ) -> tuple[int, int, list[schedule.Chain]]:
        """(lo, hi, chains) of this host's slice of `part`: a long document's rows, with
        the warm-up rows it needs when it began before the slice, form one chain."""
        lo, hi = schedule.host_slice(part, self.topo, self.spec.layout.rows_per_shard)
        if hi == lo:
            return lo, hi, []
        if self.loaded.max_context is None:  # rows are independent: one chain each
            return lo, hi, schedule.chains(lo, hi)
        continues, first_positions = self.tokens.continuation_flags(lo, hi)
        return lo, hi, schedule.chains(lo, hi, continues, first_positions,
                                       self.manifest.seq_len, self.loaded.warmup_rows)

    def plan_steps(self, part: manifest_lib.Partition) -> list[schedule.Step]:
        """This host's steps: one row per slot, a long document's rows through one slot in
        successive steps. Hosts of a replica agree on the step count (the longest plan)."""
        rows_per_shard = self.spec.layout.rows_per_shard
        if self.loaded.max_context is None:
            return schedule.plan_steps(part, self.topo, rows_per_shard, self.local_batch)
        lo, hi, chain_list = self.host_chains(part)
        filler = lo if hi > lo else part.row_start
        steps = schedule.assign(chain_list, self.local_batch, filler)
        n_steps = distributed.max_int(len(steps))
        return schedule.pad_steps(steps, n_steps, self.local_batch, filler)

    def _stop_agreed(self, step_index: int) -> bool:
        if not self.stop.due(step_index):
            return False
        here = self.stop_requested.is_set()
        return distributed.any_process(here) if self.stop.multi_host else here

    def _run_steps(self, steps, on_output, where: str, agree=None) -> None:
        """Runs `steps`, calling on_output(batch, outs) for each on the output thread
        (`workers.loop.outputs`) while up to `steps_in_flight` steps run ahead of it.

        agree(batch, settle), when given, replaces the SIGTERM check and ends the loop by
        returning True. It runs after each step is dispatched; settle() waits until every
        step before it is handled, so what the hosts of a replica agree on is a function of
        the step index, the same on all of them.
        A Preempted stop first handles every step already dispatched: partitions whose rows
        all ran are committed; any other error drops them, and the planning thread's error,
        when it failed first, is the one raised.
        """
        prefetcher = prefetch.Prefetcher(self.tokens, steps, self.opts.prefetch_depth)
        handler = outputs.OutputThread(on_output, self.opts.steps_in_flight, self.timings)
        try:
            for batch in prefetcher:
                if agree is None:
                    self.stop.stop_if(self._stop_agreed(batch.index), batch.index, where)
                segment_ids = batch.segment_ids
                if self.one_segment_per_row:
                    segment_ids = (segment_ids > 0).astype(np.int32)
                inputs = [self.transfer.tokens(batch.input_ids),
                          self.transfer.tokens(batch.positions), self.transfer.tokens(segment_ids)]
                handler.wait_for_room()  # the inputs' copies to the devices overlap it
                compiling = not self._compiled  # the first call compiles the step
                if compiling:
                    compile_started = time.perf_counter()
                    self.progress.say_phase("compiling the step (its first call)")
                fn = self.loaded.fn
                if self.loaded.max_context is not None:
                    outs = fn(*inputs, continues=self.transfer.slots(
                        np.asarray(batch.step.continues, bool)))
                else:
                    outs = fn(*inputs)
                if compiling:
                    self._compiled = True
                    log.info("compiled in %.1fs", time.perf_counter() - compile_started)
                    self.progress.say_phase("warming up: the first step runs")
                outs = self.transfer.start_to_host(outs)
                faults.maybe_crash("step")
                handler.put(batch, outs)
                del outs  # the output thread holds them until they are handled
                if agree is not None and agree(
                        batch, lambda index=batch.index: handler.wait_handled(index)):
                    break
            handler.drain()
        except Preempted:
            handler.drain()
            raise
        except Exception as e:  # an interrupt (KeyboardInterrupt) stays what is raised
            cause = prefetcher.failure_behind(e)
            if cause is None or isinstance(cause, Preempted):  # a stop causes no failure
                raise
            log.error("the steps in flight failed too, after planning did: %s: %s",
                      type(e).__name__, e)
            raise cause from None
        finally:
            handler.close()
            prefetcher.close()

    def run_partition(self, pid: int, pool: writer.WriterPool,
                      committer: commit_step.Committer) -> None:
        """One partition with its own steps (every host of the replica runs as many),
        drained before it returns. Extraction streams (`run_stream`); this is the plain
        schedule the stream's bytes are tested against, and what benchmarks plan with."""
        part = self.manifest.partition(pid)
        started = time.perf_counter()
        steps = self.plan_steps(part)
        part_writer = writer.PartitionWriter(
            self.arrays, schedule.host_slice(part, self.topo, self.spec.layout.rows_per_shard),
            pool)
        self.progress.update(state="working", partition=pid, step=0, steps=len(steps))
        self._run_steps(steps, lambda batch, outs: self._handle(batch, outs, part_writer, pool),
                        f"partition {pid}")
        committer.submit(part, part_writer, started)

    def run_stream(self, pool: writer.WriterPool, committer: commit_step.Committer,
                   tried: set[int], sequence: list[int] | None = None) -> None:
        """Every partition left (or `sequence`, in order), streamed with no barrier between
        them (workers.loop.partition_stream): a slot whose document (or row) ends takes the next one,
        from the next partition if need be."""
        agreed = None
        if sequence is None and self.topo.hosts_per_replica > 1:
            # Hosts take the partitions in one order: the leader's.
            if self.opts.steal:  # chosen (and claimed) as the stream goes
                sequence = []
                agreed = distributed.LeaderSequence(  # `stream` exists before it is asked
                    lambda: self.choose_partition(tried, idle=stream.hand_empty(),
                                                  rows_in_hand=stream.rows_in_hand()),
                    wait=self.wait_for_work, stop=self.stop_requested)
            else:
                mine = self._own_left() if self.topo.host_index == 0 else []
                sequence = distributed.broadcast_ints(mine)
        stream = partition_stream.PartitionStream(self, pool, committer, tried, sequence, agreed)
        self._run_steps(stream.steps(), stream.on_output, "the partitions in hand",
                        agree=stream.agree)
        stream.finish()

    # -- the whole job -----------------------------------------------------------------
    def open_session(self, tokens_left: int = 0) -> "Session":
        """Starts this process's heartbeats, writer pool and committer: what extracting
        partitions needs, whoever picks them (`run` here, or a Beam DoFn)."""
        return Session(self, tokens_left)

    def run(self) -> int:
        candidates = [p for p in self._candidates() if p not in self._committed]
        session = self.open_session(sum(self.manifest.partition(p).tokens
                                        for p in candidates) // self.topo.hosts_per_replica)
        tried: set[int] = set()
        code = 0
        try:
            try:
                self.run_stream(session.pool, session.committer, tried)
            finally:
                # Partitions whose steps all ran are complete: commit them even when
                # stopping, so a preemption loses only the partitions in hand. (When
                # stealing, their claims, and those of the partitions a multi-host leader
                # chose ahead, stay with this attempt until the other replicas see that it
                # ended and take them over, or `actx rerun` does.)
                session.committer.drain()
            with self.progress.lock:
                self.progress.idle_reason = "" if self.progress.tokens_done else \
                    self.choice.why_nothing_done(set(self._candidates()) - set(candidates))
            self.progress.update(state="done", partition=None)
            log.info("host per step: %s", self.host_timings(session.pool).summary())
        except Preempted as e:
            self.progress.update(state="preempted", message=str(e))
            log.error("preempted (SIGTERM): %s; nothing of that partition was committed, "
                      "`%s` will redo it", e, advice.rerun(self.location))
            code = 143
        except BaseException as e:
            self.progress.update(**ended_by(e))
            raise
        finally:
            session.close()
        return code

    def host_timings(self, pool: writer.WriterPool) -> outputs.HostTimings:
        """This worker's host timings so far, with the writer pool's."""
        self.timings.writing_s, self.timings.writer_wait_s = pool.busy_s, pool.wait_s
        return self.timings

    def on_commit(self, pid: int) -> None:
        """Counts partition `pid` committed (the committer calls it)."""
        with self.progress.lock:
            self.progress.partitions_done += 1
            self.progress.held = tuple(p for p in self.progress.held if p != pid)
        self._committed.add(pid)
