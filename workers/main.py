"""`actx extract` / `python -m actx.workers.main`: one extraction worker process per host.

Only wires flags to `workers.loop.runner`; the process joins its replica's `jax.distributed`
group first (flags, or ACTX_* variables set by the launcher; none on a one-host replica).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Protocol

from actx.schemas import advice
from actx.schemas import errors, flags, stop_signals, worker_options
from actx.workers.replicas import distributed
from actx.workers.loop import model_groups

if TYPE_CHECKING:
    from actx.workers.loop import schedule


class Loop(Protocol):
    """What this process does with a loaded worker (`runner.Worker` is one): runs its loop,
    stops it on a signal, and says which run and replica it belongs to."""

    opts: worker_options.WorkerOptions  # its run, for the line a stop signal prints
    topo: "schedule.Topology"  # a multi-host replica's failed host leaves it at once
    stop_requested: threading.Event  # set by a stop signal: the loop stops at its next step

    def run(self) -> int:
        """Extracts every partition left: 0, or the process's exit code."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actx extract", description=__doc__)
    flags.add_arguments(p, worker_options.WorkerOptions)
    return p


# Seconds within which the stop signal already being acted on, arriving again, is the same
# notice delivered twice rather than a second signal (which stops the host at once).
ECHO_S = 1.0
# SIGINT or SIGTERM: nothing partial is committed (a partition counts only with its marker).
INTERRUPTED = ("actx extract: interrupted by {signal}; partitions without a commit marker "
               "stay uncommitted: `{rerun}` finishes them")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # A worker ended in native code (JAX's coordination service aborting a host it stopped
    # hearing from, a fault in a C extension) leaves every thread's Python stack in its
    # log: where each host was, which tells a stalled host from a collective one skipped.
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (ValueError, OSError):  # a stderr with no file (run in a caller's process)
            pass
    try:
        opts = flags.from_namespace(worker_options.WorkerOptions, args)
    except ValueError as e:  # settings out of range, all of them in one line
        print(f"actx extract: error: {e}", file=sys.stderr)
        return 2
    sigint = _StopSignals()
    # Restored on the way out: a caller in the same process (a test, a notebook) gets its
    # own Ctrl-C back, not this worker's handler, which would only stop finished loops.
    with stop_signals.handled(sigint.on_signal):
        return _main(opts, sigint)


def _main(opts: worker_options.WorkerOptions, sigint: "_StopSignals") -> int:
    from actx.schemas import run_dir

    opened = None
    try:
        distributed.ProcessGroup.from_env(opts.coordinator, opts.num_processes,
                                          opts.process_id).initialize()
        from actx.schemas import ts_context

        # The store's retry bound is the one set (--gcs-request-retries) from the first read.
        ts_context.configure(opts.gcs_request_concurrency, opts.gcs_request_retries)
        # The process's one opening of the run (its argv's string turned back at once):
        # every extraction's worker takes it.
        opened = run_dir.open_run(opts.run)
        names = extraction_names(opts, opened)
    except (errors.UserError, FileNotFoundError, ValueError) as e:
        if not sigint.received.is_set():
            print(f"actx extract: error: {e}", file=sys.stderr)
            return 2
        names = []
    except KeyboardInterrupt:
        names = []
    except Exception:
        # A stop signal inside a C extension's initialisation (the first `import
        # tensorstore`) surfaces as that module's ImportError: the record says whether one
        # came (as in `_load`).
        if not sigint.received.is_set():
            raise
        names = []
    if opts.models_at_once > 1 and len(names) > 1 and not _generates(opened, names):
        code = model_groups.extract_at_once(
            opts, names, sigint, lambda o, s: _load(o, s, opened), _run)
    else:
        code = _one_after_another(opts, names, sigint, opened)
    if sigint.received.is_set():
        sigint.say_interrupted(opts.run)
        return sigint.received.exit_code
    return code


def _one_after_another(opts: worker_options.WorkerOptions, names: list[str],
                       sigint: "_StopSignals", opened) -> int:
    """The extractions in order, one model in memory at a time."""
    code = 0
    for name in names:
        if len(names) > 1:
            logging.getLogger("actx.worker").info("extraction %r", name)
        code = _extract(dataclasses.replace(opts, extraction=name), sigint, opened)
        # The model goes before the next one loads: nothing may hold its worker (the stop
        # signals' handler does, until it lets go).
        sigint.workers = []
        gc.collect()
        if code != 0 or sigint.received.is_set():
            break
    return code


def _generates(opened, names: list[str]) -> bool:
    """Whether an extraction of `names` (of the run `opened`) generates: generating
    models run one after another (each writes its own text), whatever models_at_once
    says."""
    from actx.schemas import extraction as extraction_lib

    return any(extraction_lib.read_spec(opened, name).generate is not None for name in names)


def extraction_names(opts: worker_options.WorkerOptions, run) -> list[str]:
    """The extractions `opts.extraction` names, in order ("all": every one of `run`, a
    schemas.run_dir.RunDir)."""
    from actx.schemas import extraction as extraction_lib
    from actx.schemas import layout

    if opts.extraction == "all":
        return run.extraction_names()
    names = extraction_lib.parse(opts.extraction)
    for name in names:
        if name:
            layout.check_extraction_name(name)
    return names


def _extract(opts: worker_options.WorkerOptions, sigint: "_StopSignals", opened) -> int:
    """Extracts one extraction of the run: 0 when done, else the process's exit code."""
    worker = _load(opts, sigint, opened)
    if isinstance(worker, int):
        return worker
    sigint.workers = [worker]  # from now on a stop signal ends the loop at the next step
    return _run(worker, sigint)


def _load(opts: worker_options.WorkerOptions, sigint: "_StopSignals",
          opened=None) -> "Loop | int":
    """The worker of `opts.extraction` of the run `opened` (a run_dir.OpenedRun; None:
    opened here), its model loaded; or the process's exit code."""
    try:
        from actx.workers.flax import worker as flax_worker

        # runner.Worker, or one for a Flax model
        worker = flax_worker.worker_for_run(opts, opened)
    except (errors.UserError, FileNotFoundError, ValueError) as e:
        if not sigint.received.is_set():
            print(f"actx extract: error: {e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        pass
    except Exception:
        # A stop signal can come out as another error: raised inside a C extension's
        # initialisation (the first `import tensorstore`), it surfaces as that module's
        # "ImportError: initialization failed". The record says whether one came.
        if not sigint.received.is_set():
            raise
    if sigint.received.is_set():
        sigint.say_interrupted(opts.run)
        return sigint.received.exit_code
    return worker


def _run(worker: Loop, sigint: "_StopSignals") -> int:
    """Runs a loaded worker's loop: 0 when done, else the process's exit code."""
    try:
        code = worker.run()
    except errors.UserError as e:
        # The store gave up, or the run changed under the worker: one line says what to do.
        # Nothing partial was committed.
        if worker.topo.hosts_per_replica > 1:
            _leave_replica_now()
        print(f"actx extract: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second stop signal: stop now
        code = None
    except BaseException:
        if worker.topo.hosts_per_replica > 1:
            _leave_replica_now()
        raise
    if not sigint.received.is_set():
        return code
    sigint.say_interrupted(worker.opts.run)
    if code is None and worker.topo.hosts_per_replica > 1:
        _leave_replica_now(sigint.received.exit_code)
    return sigint.received.exit_code


class _StopSignals:
    """The handler of SIGINT and SIGTERM while `main` runs (`stop_signals.handled`).

    SIGINT or SIGTERM (a preemption notice, a launcher stopping its workers) while
    starting raises KeyboardInterrupt (nothing to finish); once the loop runs it stops it
    at the next step, committing what is complete; a second signal raises at once. The
    record says whether one came, and which: a KeyboardInterrupt raised inside a
    garbage-collector callback is ignored by Python, so the exception alone cannot tell."""

    def __init__(self):
        self.received = stop_signals.Received()
        self.workers: list[Loop] = []  # the workers whose loops a signal stops
        self._stopping_since: float | None = None  # when a signal asked the loops to stop
        self._said = threading.Lock()

    def say_interrupted(self, run: str) -> None:
        """The one line that says what a stop signal left and what finishes it: once per
        process, whichever loop or phase noticed the signal first."""
        if self._said.acquire(blocking=False):
            print(INTERRUPTED.format(rerun=advice.rerun(run), signal=self.received.name),
                  file=sys.stderr, flush=True)

    def on_signal(self, signum, frame):
        if (self._stopping_since is not None and signum == self.received.signum
                and time.monotonic() - self._stopping_since < ECHO_S):
            # The same notice again at once: a supervisor (host_run, a launcher) forwarding
            # the signal the scheduler also sent every process of the job step (Slurm's
            # scancel, a terminal's Ctrl-C to the foreground group). Taken as a second
            # signal it would end this host at once, without the replica's shutdown
            # barrier, and take its peers down mid-stop.
            return
        again = self.received.is_set()
        self.received.set(signum)
        if not self.workers or again:
            if not stop_signals.safe_to_raise(frame):  # comes back as a second signal
                stop_signals.redeliver(signum)
                return
            raise stop_signals.Stopped(signum)
        self._stopping_since = time.monotonic()
        logging.getLogger("actx.worker").warning(
            "%s received: finishing the current step, committing nothing partial",
            stop_signals.signal_name(signum))
        for worker in self.workers:
            worker.stop_requested.set()


def _leave_replica_now(code: int = 1) -> None:
    """Exits a failed host of a multi-host replica at once.

    A normal exit runs jax.distributed's shutdown barrier, which waits (minutes) for peers
    that are themselves blocked in a collective with this host; both would hang. Exiting
    without it lets the coordination service report this host as gone, so the peers fail
    fast too, and `actx rerun` redoes the partition.
    """
    import os
    import traceback

    if code not in (130, 143):  # an interrupt has said so in one line already
        traceback.print_exc()
        print("actx extract: this host failed; leaving its replica without the shutdown "
              "barrier so the other hosts stop too. Nothing partial was committed; "
              "`actx rerun` redoes the partition.", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
