"""The local target: prepare on Beam's in-process runner, then N worker processes on this
machine as N simulated hosts, with live progress and collected logs.

Hosts of one replica join jax.distributed on a loopback coordinator; replicas never talk.
Each process sees `devices_per_host` simulated XLA CPU devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from actx.deploy import commands
from actx.deploy import config as config_lib
from actx.deploy.status import host_logs
from actx.deploy.status import job_progress
from actx.deploy.status import partition_states
from actx.deploy.status import progress_line
from actx.deploy.status import runstate
from actx.schemas import advice
from actx.schemas import config as schemas_config
from actx.schemas import extraction as extraction_lib
from actx.schemas import extraction_store
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import layout as layout_lib
from actx.schemas import run_dir
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import store_errors
from actx.schemas import worker_options

LOG_TAIL_LINES = 25


def prepare_local(spec: runspec_lib.RunSpec, run: "str | run_dir.RunDir",
                  max_reject_fraction: float, out=sys.stdout,
                  retry_argv: list[str] | None = None) -> bool:
    """Runs prepare in-process unless the run is already prepared for this spec.

    Returns False when it was already prepared (prepare is deterministic, so the existing
    token store is the one this spec would write).
    """
    run = run_dir.RunDir.at(run)
    if run.is_prepared_for(spec):
        print(f"prepare: {run.uri} is already prepared for fingerprint {spec.fingerprint}; "
              f"skipping", file=out, flush=True)
        from actx.pipeline import preflight as pipeline_preflight  # lists them; no Beam

        changed = pipeline_preflight.inputs_changed(run.store, spec)
        if changed:  # the spec names paths: the same config over other files
            print(f"prepare: note: the inputs changed since {run.uri} was prepared "
                  f"({changed}); the run keeps the tokens of the inputs as they were then. "
                  f"To extract the new ones, give the config another `run:` directory",
                  file=out, flush=True)
        return False
    from actx.pipeline import main as pipeline_main  # Beam: only when prepare runs here
    from actx.schemas import stop_signals

    print(f"prepare: {run.uri} (in-process Beam runner)", file=out, flush=True)
    # Beam wraps the interrupt of a Ctrl-C or SIGTERM into its own errors:
    # run_prepare_stoppable gives it back as stop_signals.Stopped.
    try:
        with _prepare_lines_to(out):  # its progress lines (every few seconds), summary
            pipeline_main.run_prepare_stoppable(
                spec, run, ["--runner=FnApiRunner"], max_reject_fraction=max_reject_fraction,
                retry_argv=retry_argv, progress_interval_s=PREPARE_PROGRESS_S)
    except KeyboardInterrupt as e:
        again = " ".join(retry_argv or ["actx", "submit"])
        raise stop_signals.Stopped(
            stop_signals.signum_of(e),
            hint=f"{run.uri} is not prepared (no manifest.json), nothing of it is kept; "
                 f"`{again}` again clears what this attempt left and prepares it") from None
    return True


PREPARE_PROGRESS_S = 5.0  # seconds between prepare's progress lines in submit's output


@contextlib.contextmanager
def _prepare_lines_to(out):
    """Prepare's log lines ("actx.prepare": progress, files, partitions written) to `out`
    as plain lines, whatever the root logger is (nothing configures it in `actx submit`)."""
    import logging

    logger = logging.getLogger("actx.prepare")
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # once, not again through a configured root logger
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@dataclasses.dataclass
class _Proc:
    name: str
    replica: int
    popen: subprocess.Popen
    log_path: str
    log_file: object
    returncode: int | None = None
    stopped: bool = False  # terminated by us because a peer of its replica failed
    host_index: int = 0  # its process index within the replica


def host_name(replica: int, process_id: int, prefix: str = "local") -> str:
    """A local worker's host name (its heartbeat workers/<host>.json, its log <host>.log).
    A job that joins another's run names its hosts after itself, so they never share a
    heartbeat with the first job's."""
    return f"{prefix}-r{replica}h{process_id}"


def host_names(target: config_lib.TargetConfig, prefix: str = "local") -> list[str]:
    return [host_name(r, i, prefix) for r in range(target.replicas)
            for i in range(target.hosts_per_replica)]


def worker_args(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
                replica: int, process_id: int, coordinator: str | None,
                only: list[int] | None, extraction: str | None = None,
                prefix: str = "local") -> list[str]:
    """Command-line flags of one local worker process (`extraction`: the run's
    extractions it extracts one after another, workers' --extraction)."""
    group = ({"coordinator": coordinator, "num_processes": target.hosts_per_replica,
              "process_id": process_id} if target.hosts_per_replica > 1 else {})
    return worker_options.WorkerOptions.for_job(
        target, run=run, replicas=target.replicas, replica=replica, job=job, only=only,
        expect_fingerprint=fingerprint, host_name=host_name(replica, process_id, prefix),
        steal=target.steal and target.replicas > 1, extraction=extraction,
        **group).to_argv()


def worker_env(target: config_lib.TargetConfig) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""),
                                         target.devices_per_host)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = config_lib.code_path() + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("ACTX_COORDINATOR", "ACTX_NUM_PROCESSES", "ACTX_PROCESS_ID"):
        env.pop(key, None)  # flags decide; a stale variable must not join another group
    return env


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def with_host_devices(xla_flags: str, devices: int) -> str:
    """`xla_flags` with the simulated host's device count set to `devices`: the other XLA
    flags a user set (a dump directory, a CPU compiler option) reach the workers as set."""
    kept = [f for f in xla_flags.split() if f.split("=")[0] != HOST_DEVICES_FLAG]
    return " ".join([*kept, f"{HOST_DEVICES_FLAG}={devices}"])


def free_port() -> int:
    """A TCP port free on this machine now: a local multi-host group's coordinator."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def log_dir(run: run_dir.RunDir, job: str) -> tuple[str, bool]:
    """(local directory for worker logs, whether to upload it into <run>/logs/ after)."""
    loc = run.location
    if loc.is_local:
        path = os.path.join(loc.path, layout_lib.LOGS_PREFIX, job)
        os.makedirs(path, exist_ok=True)
        return path, False
    return tempfile.mkdtemp(prefix=f"actx-logs-{job}-"), True


def run_workers(run: "str | run_dir.RunDir", target: config_lib.TargetConfig,
                fingerprint: str, job: str, only: list[int] | None = None,
                progress_s: float = 3.0, out=sys.stdout, extraction: str | None = None,
                prefix: str = "local") -> int:
    """Launches hosts × worker processes, shows progress, returns 0 or 1 (a worker failed).
    `run`: the run directory (a run_dir.OpenedRun where the command opened it); the
    workers get its location in their argv."""
    run = run_dir.RunDir.at(run)
    logs, upload = log_dir(run, job)
    names = extraction_lib.parse(extraction)
    env = worker_env(target)
    code = config_lib.code_path()
    procs: list[_Proc] = []
    for r in range(target.replicas):
        coordinator = (f"127.0.0.1:{free_port()}" if target.hosts_per_replica > 1 else None)
        for i in range(target.hosts_per_replica):
            name = host_name(r, i, prefix)
            args = worker_args(run.uri, target, fingerprint, job, r, i, coordinator, only,
                               extraction, prefix)
            log_path = os.path.join(logs, f"{name}.log")
            log_file = open(log_path, "w")
            popen = subprocess.Popen([sys.executable, "-m", "actx.workers.main", *args], env=env,
                                     cwd=code, stdout=log_file,
                                     stderr=subprocess.STDOUT)
            procs.append(_Proc(name, r, popen, log_path, log_file, host_index=i))
    print(f"extract: job {job}: {len(procs)} worker process(es) ({target.replicas} replica(s) "
          f"x {target.hosts_per_replica} host(s), {target.devices_per_host} CPU device(s) "
          f"each); logs in {logs}", file=out, flush=True)
    failed: list[_Proc] = []
    progress = job_progress.JobProgress(run, names)
    interrupted = False
    next_hung_look = time.monotonic() + HUNG_LOOK_S
    shown = progress_line.ProgressLine(out)
    try:
        while any(p.returncode is None for p in procs):
            deadline = time.monotonic() + progress_s
            while time.monotonic() < deadline and any(p.returncode is None for p in procs):
                for p in procs:
                    if p.returncode is None and p.popen.poll() is not None:
                        p.returncode = p.popen.returncode
                        if p.returncode != 0:
                            try:
                                for name in names:
                                    mark_dead(run, p.name, p.returncode, p.log_path,
                                              extraction=name, job=job, replica=p.replica,
                                              process_index=p.host_index)
                            except Exception as e:  # status then learns it after stale_after
                                print(f"extract: could not record that {p.name} died: {e}",
                                      file=out, flush=True)
                        if p.returncode != 0 and not p.stopped:
                            failed.append(p)
                            _stop_replica(procs, p.replica)
                time.sleep(0.2)
            if time.monotonic() >= next_hung_look:
                next_hung_look = time.monotonic() + HUNG_LOOK_S
                for p in _stale_after_the_end(progress, procs, only, job):
                    print(f"extract: worker {p.name} (pid {p.popen.pid}) stopped beating "
                          f"after every partition was committed (a frozen or hung process): "
                          f"stopped, the data is complete", file=out, flush=True)
                    _end(p.popen)
            # The last line (the workers all ended) always shows, in a pipe too.
            line = progress.poll()
            for phase in progress.new_phases():  # loading, compiling: lines of their own
                shown.note(f"extract: {phase}")
            shown.show(line, force=all(p.returncode is not None for p in procs))
    except KeyboardInterrupt:
        for p in procs:
            if p.popen.poll() is None:
                p.popen.terminate()
        interrupted = True
        raise
    finally:
        shown.end()
        for p in procs:
            p.popen.wait()
            p.log_file.close()
        if interrupted:
            for p in procs:  # what a worker stopped while starting could not say itself
                try:
                    for name in names:
                        mark_dead(run, p.name, p.popen.returncode, stopped_by_user=True,
                                  extraction=name, job=job, replica=p.replica,
                                  process_index=p.host_index)
                except Exception:  # noqa: BLE001 - status then learns it when it goes stale
                    pass
            print(_kept_line(progress.run), file=out, flush=True)
    if upload:
        upload_logs(run, job, logs, out)
    if failed and _wanted_all_committed(progress, only):
        # The data is complete: the others committed what the failed ones left. History,
        # in one line each, not a failure with its log.
        for p in failed:
            print(f"extract: history: worker {p.name} (pid {p.popen.pid}) ended early "
                  f"({commands.describe_exit(p.returncode)}; its log: {p.log_path}); the "
                  f"other hosts committed every partition", file=out, flush=True)
        return 0
    for p in failed:
        print(f"extract: worker {p.name} (pid {p.popen.pid}) failed "
              f"({commands.describe_exit(p.returncode)}); last lines of "
              f"{p.log_path}:\n{tail(p.log_path)}", file=out, flush=True)
    return 1 if failed else 0


# How often the launcher looks for a worker that outlives the data without beating.
HUNG_LOOK_S = 10.0


def _stale_after_the_end(progress: job_progress.JobProgress, procs: list, only, job: str
                         ) -> list:
    """The workers still running once every partition they were to extract is committed
    whose heartbeat (this job's) went stale: frozen (SIGSTOP, a suspended machine) or hung
    with their heartbeat thread. A worker with nothing left ends by itself; these would
    keep the launcher waiting for ever."""
    running = [p for p in procs if p.returncode is None and p.popen.poll() is None]
    statuses = _statuses(progress) if running else None
    if not statuses or not _all_committed(statuses, only):
        return []
    beats = [h for status in statuses for h in status.hosts if h.job == job]
    return [p for p in running
            if any(h.host == p.name for h in beats)
            and not any(h.host == p.name and h.live for h in beats)
            and all(h.state != "done" for h in beats if h.host == p.name)]


def _end(popen: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM (and SIGCONT, for a stopped process), then SIGKILL after `grace_s`."""
    popen.terminate()
    try:
        popen.send_signal(signal.SIGCONT)
        popen.wait(grace_s)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        popen.kill()


def _wanted_all_committed(progress: job_progress.JobProgress,
                          only: list[int] | None) -> bool:
    """Whether every partition this job was to extract (`only`; None: all) is committed,
    in every extraction it ran (False where that cannot be read)."""
    statuses = _statuses(progress)
    return statuses is not None and _all_committed(statuses, only)


def _statuses(progress: job_progress.JobProgress) -> list | None:
    """The status of each extraction the job runs; None where one cannot be read."""
    try:
        return [runstate.compute_status(handle) for handle in progress.views().values()]
    except Exception:  # noqa: BLE001 - unknown: the caller assumes nothing
        return None


def _all_committed(statuses: list, only: list[int] | None) -> bool:
    for status in statuses:
        wanted = status.partitions if only is None else only
        if not status.partitions or any(
                status.partitions[p] != partition_states.COMMITTED for p in wanted):
            return False
    return True


def _kept_line(run: run_dir.RunDir) -> str:
    """What an interrupted extraction kept (committed partitions; nothing partial) and the
    command that finishes the rest."""
    try:
        status = runstate.compute_status(run.opened())
        committed = status.counts[partition_states.COMMITTED]
        kept = f"{committed} of {len(status.partitions)} partition(s) are committed and kept"
        # Stopped once the last partition had committed: nothing is left to extract (a
        # run of several extractions may have some behind: said as before).
        if status.complete and len(extraction_store.names(run.store)) <= 1:
            return (f"extract: stopped after every partition had committed ({kept} in "
                    f"{run.uri}): nothing is left to extract; `{advice.verify(run.uri)}` "
                    f"checks the data")
    except Exception as e:  # noqa: BLE001 - the hint matters more than the count
        kept = f"committed partitions are kept (the count is unavailable: {e})"
    return (f"extract: stopped; {kept} in {run.uri}, nothing partial was committed. "
            f"`{advice.rerun(run.uri)}` extracts the rest")


def mark_dead(run: "str | run_dir.RunDir", host: str, returncode: int | None,
              log_path: str | None = None,
              stopped_by_user: bool = False, extraction: str = "", how: str = "",
              job: str = "", replica: int = 0, process_index: int = 0) -> bool:
    """Records in `host`'s heartbeat that its process is gone, when the heartbeat still
    says it is alive (a SIGKILL or OOM leaves "working" behind, and status would trust it
    until it went stale) or when there is none (it died before its first beat). Status
    then shows the host failed at once, with the exit code and the log's last line, and
    its partition as stale; the message names `actx rerun RUN`, which finishes the run.
    `stopped_by_user`: the launcher stopped it (Ctrl-C), which status shows as stopped,
    not failed (also over an older worker's "failed ... Stopped: SIGTERM"). Returns
    whether it wrote. A named extraction's heartbeats are its own (schemas.extraction).
    job / replica / process_index: the process's, recorded where it wrote no heartbeat (it
    died before, or before reaching this extraction), so its replica's other processes
    waiting on it (workers.write.metadata.writer_gone) learn it at once; a record of
    another job there (whatever its state) is replaced, as none would be."""
    directory = run_dir.RunDir.at(run)
    run = directory.uri  # as the messages below name it, whichever was passed
    store = directory.extraction(extraction).store
    key = layout_lib.heartbeat_key(host)
    try:
        data = store.read_json(key)
        if data is not None and job and data.get("job") != job:
            # An earlier job's record (a rerun's worker died before it beat here): it says
            # nothing of this process, and this job's waiting hosts read only their job's.
            data = None
        if (data is not None and data.get("state") == "failed" and not stopped_by_user
                and returncode is not None):
            return _add_exit_code(store, key, data, returncode)
        if (data is not None and stopped_by_user and data.get("state") == "failed"
                and data.get("message", "").startswith(_INTERRUPT_MESSAGES)):
            data = dict(data, state="working")  # a stop read as a failure by an older worker
        elif data is not None and data.get("state") not in runstate.LIVE_STATES:
            return False  # done or preempted: the worker said how it ended
        beat = (heartbeat_lib.Heartbeat(host=host, replica=replica,
                                        process_index=process_index, state="starting",
                                        attempt="", updated_at=time.time(), job=job)
                if data is None else
                schemas_config.from_dict(heartbeat_lib.Heartbeat, data, f"{key}: "))
    except (ValueError, schemas_config.ConfigError):
        return False  # a damaged heartbeat: status reports it as it is
    how = how or (f"killed by {signal.Signals(-returncode).name}" if returncode < 0
                  and -returncode in signal.valid_signals()
                  else f"exited with code {returncode}")
    before = " before its first heartbeat" if data is None else ""
    last = last_line_of_log_file(log_path) if log_path else ""
    if stopped_by_user:
        beat = dataclasses.replace(
            beat, state="preempted", updated_at=time.time(), tokens_per_s=0.0, eta_s=None,
            message=f"stopped by Ctrl-C in the launcher; `{advice.rerun(run)}` finishes the "
                    f"run")
    else:
        beat = dataclasses.replace(
            beat, state="failed", updated_at=time.time(), tokens_per_s=0.0, eta_s=None,
            message=f"process {how}{before} (seen by actx on {socket.gethostname()})"
                    + (f"; its log ends: {last}" if last else "")
                    # Every uncommitted partition, not only the stale ones: what a dead
                    # worker had claimed ahead reads as pending, and must be redone too.
                    + (f"; fix that, then `{advice.rerun(run)}`" if data is None else
                       f"; `{advice.rerun(run)}` finishes the run"))
    store.write_with_summary(key, store_lib.dumps(schemas_config.to_dict(beat)),
                             heartbeat_lib.summary(beat))
    return True


# How a worker older than runner.ended_by described a stop signal that ended its loop.
_INTERRUPT_MESSAGES = ("Stopped:", "KeyboardInterrupt")


def _add_exit_code(store, key: str, data: dict, returncode: int) -> bool:
    """A worker that recorded its own failure (its message says why): the exit code too."""
    if "exited with code" in data.get("message", ""):
        return False
    beat = schemas_config.from_dict(heartbeat_lib.Heartbeat, data, f"{key}: ")
    beat = dataclasses.replace(beat, message=f"{beat.message} (process exited with code "
                                             f"{returncode})")
    store.write_with_summary(key, store_lib.dumps(schemas_config.to_dict(beat)),
                             heartbeat_lib.summary(beat))
    return True


def last_line_of_log_file(path: str, max_chars: int = 300) -> str:
    """The last line a worker wrote to its log file (host_logs.last_log_line)."""
    # Lines enough to reach past a fatal error's thread stacks (host_logs.last_log_line).
    return host_logs.last_log_line(tail(path, 400), max_chars)


def _stop_replica(procs: list[_Proc], replica: int) -> None:
    """A replica's hosts run in lockstep: when one dies, its peers would wait forever."""
    for p in procs:
        if p.replica == replica and p.popen.poll() is None:
            p.stopped = True
            p.popen.terminate()


def upload_logs(run: run_dir.RunDir, job: str, log_dir: str,
                out=sys.stdout) -> None:
    """Copies the job's local logs into <run>/logs/<job>/. A store that refuses them (a
    bucket that takes no writes) costs one line, not the workers' outcome: the logs stay
    where they are, and that line says where."""
    try:
        _upload_logs(run, job, log_dir)
    except store_errors.StoreError as e:
        print(f"extract: the logs stay in {log_dir}: {e}", file=out, flush=True)


def _upload_logs(run: run_dir.RunDir, job: str, log_dir: str) -> None:
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), "rb") as f:
            run.write_log(job, name.removesuffix(".log"), f.read())
