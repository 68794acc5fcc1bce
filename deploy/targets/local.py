"""The local target: prepare on Beam's in-process runner, then extraction on this machine
while this command waits: worker processes as simulated hosts (deploy/local.py), or the
Beam extraction transform on Beam's local runners (`target.extract: beam`,
deploy/targets/beam.py). One job at a time holds the run (schemas.job_lease)."""

from __future__ import annotations

import contextlib
import os
import socket
import time

from actx.deploy import launch_record
from actx.deploy import local
from actx.deploy import targets
from actx.deploy.status import partition_states
from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.schemas import activations_info as info_lib
from actx.schemas import advice
from actx.schemas import layout
from actx.schemas import parallelism


class _WorkerProcesses:
    """`extract: workers`: hosts × worker processes (deploy.local.run_workers)."""

    def __init__(self, config):
        self.config = config

    def replica_hosts(self) -> int:
        return self.config.hosts_per_replica

    def host_names(self, prefix: str) -> list[str]:
        return local.host_names(self.config, prefix)

    def run(self, job: targets.Job, out, prefix: str) -> int:
        return local.run_workers(job.run, self.config, job.fingerprint, job.name,
                                 only=job.only, out=out, extraction=job.extraction,
                                 prefix=prefix)


class _BeamPipeline:
    """`extract: beam`: the ExtractPartitions transform on Beam's local runners; each Beam
    worker process is a replica of one host; named extractions run one pipeline after
    another."""

    def __init__(self, config):
        self.config = config

    def replica_hosts(self) -> int:
        return 1

    def host_names(self, prefix: str) -> list[str]:
        return ["beam workers (named beam-<machine>-<pid>)"]

    def run(self, job: targets.Job, out, prefix: str) -> int:
        from actx.deploy.targets import beam as beam_target

        return beam_target.run_local(job.run, self.config, job.fingerprint, job.name,
                                     only=job.only, out=out, extraction=job.extraction)


def beam_worker_processes(beam_args) -> int:
    """Worker processes Beam's local runners start for `beam_args`, as Beam reads its
    flags: --direct_num_workers (0: one per core) in multi_processing mode, else one (the
    in-process runner's workers are threads of its process)."""
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions

    direct = PipelineOptions(list(beam_args or ())).view_as(DirectOptions)
    if direct.direct_running_mode != "multi_processing":
        return 1
    return direct.direct_num_workers or os.cpu_count() or 1


class LocalTarget(targets.Target):
    kind = "local"

    def __init__(self, config):
        super().__init__(config)
        self.engine = (_BeamPipeline if config.extract == "beam" else _WorkerProcesses)(config)
        self._holding = False  # this launcher holds the run's lease (submit: from prepare)

    def problems(self, run: str) -> tuple[list[str], int | None]:
        cfg = self.config
        model = parallelism.model_parallel_problem(cfg.model_parallel, cfg.devices_per_host)
        found = [f"target.model_parallel: {model} (target.devices_per_host)"] if model else []
        return found, parallelism.data_parallel(
            self.engine.replica_hosts() * cfg.devices_per_host, cfg.model_parallel)

    def stop_hint(self) -> str:
        return "Local workers stop with their submit (Ctrl-C)"

    def hosts_and_replicas(self) -> tuple[int, int]:
        if self.config.extract == "beam":  # each Beam worker process: a one-host replica
            processes = beam_worker_processes(self.config.beam_args)
            return processes, processes
        return super().hosts_and_replicas()

    def submit(self, job: targets.Job, prepare: targets.Prepare, opts: targets.LaunchOptions,
               out) -> int:
        if opts.dry_run:
            return self._show_plan(job, prepare, opts, out)
        if opts.join:
            _check_joinable(job.run, prepare.spec)
        # The lease comes before prepare: a second submit started meanwhile is refused
        # before it writes anything (prepare would clear and rewrite the live token store).
        with self._job_lease(job, _host_prefix(job.name, opts.join), opts.join):
            prepare.write_records()
            local.prepare_local(prepare.spec, job.run, prepare.max_reject_fraction, out=out,
                                retry_argv=prepare.retry_argv)
            return self.rerun(job, opts, out)

    def _show_plan(self, job: targets.Job, prepare: targets.Prepare | None,
                   opts: targets.LaunchOptions, out) -> int:
        """--dry-run: what submit (or rerun) would do here, writing nothing (the job's cost
        follows, deploy.dry_run)."""
        print("# dry run: nothing is executed, nothing is written.", file=out)
        if prepare is not None:
            prepared = _prepared(job.run, prepare.spec)
            print(f"prepare: {job.run.uri} is already prepared for fingerprint "
                  f"{prepare.spec.fingerprint}; skipped" if prepared else
                  f"prepare: {job.run.uri} (in-process Beam runner; max reject fraction "
                  f"{prepare.max_reject_fraction:g})", file=out)
        cfg = self.config
        what = ("the Beam extraction transform on Beam's local runners"
                if cfg.extract == "beam" else
                f"{cfg.hosts} worker process(es) ({cfg.replicas} replica(s) x "
                f"{cfg.hosts_per_replica} host(s), {cfg.devices_per_host} CPU device(s) each)")
        only = "" if job.only is None else f", partitions {_names(job.only)}"
        print(f"extract: job {job.name}: {what}, batch {cfg.batch_size}{only}"
              + ("" if opts.join else "; under the run's job lease")
              + f"; logs in {job.run.log_uri(job.name)}",
              file=out, flush=True)
        return 0

    def rerun(self, job: targets.Job, opts: targets.LaunchOptions, out) -> int:
        if opts.dry_run:
            return self._show_plan(job, None, opts, out)
        job = job.opened()  # submit: the run exists now that prepare made it
        if job.extraction:
            return self._extract_named(job, opts, out)
        return self._extract_default(job, opts, out)

    # -- the default extraction -----------------------------------------------------------
    def _extract_default(self, job: targets.Job, opts: targets.LaunchOptions, out) -> int:
        handle = job.run
        status = runstate.compute_status(handle)
        if _removed_under(handle, status, out):
            return 1
        if status.complete:
            print(f"extract: all {len(status.partitions)} partitions of {handle.uri} are "
                  f"committed; nothing to do", file=out)
        else:
            code = self._run_engine(job, opts, out)
            status = runstate.compute_status(handle)
            if _removed_under(handle, status, out):
                return 1
            # The exit code says whether the data is complete: a worker that failed on the
            # way while the others committed every partition is history, not a failure.
            if code != 0 and _rerun_hint(handle, status, job.only, None):
                print(status_text.render(status), file=out)
                _rerun_hint(handle, status, job.only, out)
                return code
        print(file=out)
        print(status_text.render(status), file=out)
        info = info_lib.read_info(handle.store)
        scales = ("; float8, with <hook>.scale beside it"
                  if info and info.quantisation_version else "")
        print(f"\nactivations: {handle.location.join('activations')}/<hook> (zarr v3, "
              f"{info.dtype if info else handle.spec.capture.dtype}, [rows, seq_len, hidden]"
              f"{scales}); "
              f"hooks: {', '.join(sorted(info.hooks)) if info else '-'}", file=out)
        print(f"read them:   {advice.read(handle.location)}", file=out)
        print(f"check them:  {advice.verify(handle.location)}", file=out, flush=True)
        return 1 if _rerun_hint(handle, status, job.only, out) else 0

    # -- named extractions ----------------------------------------------------------------
    def _extract_named(self, job: targets.Job, opts: targets.LaunchOptions, out) -> int:
        """The named extractions that are behind, one after another in each process; then
        a status line per extraction and how to read them together."""
        from actx.schemas import extraction as extraction_lib

        handles = extraction_lib.scoped_all(job.run, job.extraction)
        behind = [name for name, handle in handles.items()
                  if not runstate.compute_status(handle).complete]
        if behind:  # its exit code aside: the commits below say whether the data is whole
            import dataclasses

            self._run_engine(dataclasses.replace(
                job, fingerprint=None,
                extraction=extraction_lib.joined(behind)), opts, out)
        statuses = {name: runstate.compute_status(handle) for name, handle in handles.items()}
        print(file=out)
        print(status_text.render_extractions(statuses), file=out)
        # Read together: every extraction of the run, not only those this job ran (a
        # rerun runs those behind); aligned batches need two or more, one reads alone.
        every = extraction_lib.names(job.run.store)
        read = (f"read them together: reader.aligned.aligned_stream({job.run.uri!r}, "
                f"{every!r}, HOOK, BATCH_SIZE)  (after `import actx.reader.aligned; from actx "
                f"import reader`; HOOK: one "
                f"every extraction captured, or {{extraction: hook}}; docs/several-models.md)"
                if len(every) > 1 else
                f"read it: python -c \"import actx; print(actx.open_run({job.run.uri!r}"
                + (f", extraction={every[0]!r}" if every and every[0] else "")
                + ").describe())\"")
        print(f"\n{read}\ncheck them:  {advice.verify(job.run.uri)}", file=out, flush=True)
        missing = {name or "default": [p for p, st in s.partitions.items()
                                       if st != partition_states.COMMITTED
                                       and (job.only is None or p in job.only)]
                   for name, s in statuses.items()}
        missing = {name: ids for name, ids in missing.items() if ids}
        if missing:
            print(f"extract: partitions still without a commit: "
                  f"{'; '.join(f'{n}: {len(ids)}' for n, ids in missing.items())}; "
                  f"`{advice.rerun(job.run.uri)}` finishes whichever extraction is behind",
                  file=out)
        # Complete whatever failed on the way (the status above shows that as history).
        return 1 if missing else 0

    def _run_engine(self, job: targets.Job, opts: targets.LaunchOptions, out) -> int:
        """Runs the engine's workers under the run's job lease, saying what stays if a stop
        signal ends them."""
        prefix = _host_prefix(job.name, opts.join)
        from actx.schemas import extraction as extraction_lib

        with _workers_stop_hint(), self._job_lease(job, prefix, opts.join):
            if opts.join:
                return self.engine.run(job, out, prefix)
            # How `actx rerun RUN` launches next (deploy.launch_record), unless the run
            # refuses this job's settings.
            launch_record.record(job.run.store, self.config, job.name, opts.config_file,
                                 opts.sets, extraction_lib.parse(job.extraction))
            return self.engine.run(job, out, prefix)

    @contextlib.contextmanager
    def _job_lease(self, job: targets.Job, prefix: str, join: bool):
        """Holds the run's job lease (schemas.job_lease) while this launcher's workers run,
        or raises a UsageError naming the live job that holds it; none when joining."""
        from actx.schemas import job_lease

        if join or self._holding:  # joining: the lease is the joined job's
            yield
            return
        keeper = job_lease.Keeper(job.run.store, job_lease.new(
            job.name, self.engine.host_names(prefix), self.kind,
            stop=f"Ctrl-C in its terminal, or `kill -TERM {os.getpid()}` on "
                 f"{socket.gethostname()}"))
        try:
            keeper.__enter__()
        except job_lease.LeaseHeld as e:
            raise targets.UsageError(
                job_lease.refusal(job.run.location, e.lease, time.time(), e.beats)) from None
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            keeper.__exit__(None, None, None)


def _prepared(run, spec) -> bool:
    """Whether the run (a run_dir.RunDir) is prepared for `spec` (False where it cannot
    be read here)."""
    try:
        return run.is_prepared_for(spec)
    except Exception:  # noqa: BLE001 - a dry run says what it would do, whatever the run
        return False


def _names(ids) -> str:
    return ", ".join(map(layout.partition_name, ids[:20])) + (" ..." if len(ids) > 20 else "")


def _check_joinable(run, spec) -> None:
    """`submit --join` runs beside a job, never beside its prepare: refused (exit 2, before
    anything is written) while a live job holds a run (a run_dir.RunDir) that is not
    prepared for this spec."""
    from actx.schemas import job_lease

    if run.is_prepared_for(spec):
        return
    held = run.lease()
    if held is not None and held.live(job_lease.run_heartbeats(run.store), time.time()):
        raise targets.UsageError(
            f"{run.location}: job {held.job} is preparing this run; --join runs beside "
            f"its workers once it is prepared (manifest.json written): submit again then")


def _host_prefix(job: str, join: bool) -> str:
    """Local workers' host names: a joining launcher's carry its job, so that they never
    take the names of the hosts it joins."""
    return f"local-{job}" if join else "local"


@contextlib.contextmanager
def _workers_stop_hint():
    """A stop signal while local workers run: they were stopped; say what stays."""
    from actx.schemas import stop_signals

    try:
        yield
    except KeyboardInterrupt as e:  # SIGINT or SIGTERM
        raise stop_signals.Stopped(
            stop_signals.signum_of(e),
            hint="the workers stopped; partitions without a commit marker stay "
                 "uncommitted") from None


def _removed_under(handle, status, out) -> bool:
    """Says so, and True, when the run lost files that a finished run has (run.json and
    manifest.json; activations/actx.json once a partition is committed): removed while
    the workers ran, or since. Its markers then say nothing about data, and the line names
    what finishes it: submitting again (the run directory gone), or verify --repair and
    a rerun (its activations gone)."""
    from actx.schemas import runspec as runspec_lib

    store = handle.store
    keys = [runspec_lib.RUN_SPEC_KEY, layout.MANIFEST_KEY]
    if status.counts[partition_states.COMMITTED]:
        keys.append(layout.ACTIVATIONS_INFO_KEY)
    gone = [key for key in keys if not store.exists(key)]
    if not gone:
        return False
    where = handle.location
    if layout.ACTIVATIONS_INFO_KEY in gone and len(gone) == 1:
        committed = status.counts[partition_states.COMMITTED]
        next_step = (f"`{advice.repair(where)}` turns its {committed} committed "
                     f"partition(s) back into pending; then `{advice.rerun(where)}` extracts "
                     f"them again")
    else:
        next_step = ("submit the same config again: it prepares the run afresh (the markers "
                     "left there are cleared)")
    print(f"extract: {where} lost {', '.join(gone)} (removed while the workers ran, or "
          f"since): it is not finished, whatever its commit markers say; {next_step}",
          file=out)
    return True


def _rerun_hint(handle, status, only, out) -> list[int]:
    """Names the wanted partitions still without a commit and the command that redoes
    them (on `out`; None: says nothing); returns them."""
    wanted = status.partitions if only is None else only
    missing = [p for p in wanted if status.partitions[p] != partition_states.COMMITTED]
    stale = [p for p in missing if status.partitions[p] == partition_states.STALE]
    if missing and out is not None:
        print(f"extract: {len(missing)} partition(s) still without a commit: "
              f"{', '.join(layout.partition_name(p) for p in missing[:20])}"
              + (f" ({len(stale)} stale: held by a worker that died)" if stale else "")
              + f"; {_rerun_clause(handle, status)}", file=out)
    return missing


def _rerun_clause(handle, status) -> str:
    """What finishes the partitions left: the rerun (after what must come first), or,
    where a failed host found the run's capture dtype cannot hold the model's values, a
    capture that can (no rerun of this run gets past it)."""
    if any(host.state == "failed" and "not finite as float16" in host.message
           for host in status.hosts):
        return ("float16 cannot hold what the model computes (the failed host's line): "
                "extract with capture.dtype bfloat16 or float32 into a new run directory, "
                "or as a named extraction (`extractions:`); a rerun of this run fails the "
                "same way")
    return f"{_before_rerun(status)}`{advice.rerun(handle.location)}` redoes them"


def _before_rerun(status) -> str:
    """What must run before the rerun when a failed host's own message says so: the token
    store written again, after a worker found it damaged (a rerun alone would read the
    same damaged object and fail the same way)."""
    for host in status.hosts:
        if host.state == "failed":
            for kind, command in advice.find(host.message):
                if kind == "reprepare":
                    return (f"`{command}` first (a worker found the token store damaged), "
                            f"then ")
                if kind == "repair":
                    return (f"`{command}` first (a worker found an array's metadata "
                            f"damaged), then ")
    return ""
