"""The job lease of a detached launch (schemas.job_lease, detached): the launcher takes it
before its plan runs and exits once the workers start, so the hosts' heartbeats hold it
(before their first one, the start grace); a failed plan gives it back, and `actx down`
releases it with the hosts it stopped.

A target names its hosts (the names their heartbeats carry) and, optionally, says when
another job's hosts are gone for good (`gone`: a preempted TPU slice, a Slurm job that
ended): such a job's lease is taken over at once, though its last heartbeats may look
fresh for minutes.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

from actx.deploy import targets
from actx.schemas import job_lease
from actx.schemas import run_dir


def take(run: "str | run_dir.RunDir", kind: str, hosts: list[str], job: str,
         stop: str, out=None, gone: Callable[[job_lease.JobLease], str | None] | None = None):
    """Takes the run for `job` on `hosts` (a target of `kind`), or raises a UsageError
    naming the live job that holds it. `stop`: how this job is stopped, as the refusal
    tells another launcher. `gone(held)`: why `held`, a detached lease of this kind on
    these same hosts whose hosts have reported, runs no worker any more (None: it may).
    Returns what `give_back` takes."""
    store = run_dir.RunDir.at(run).store
    lease = job_lease.new(job, list(hosts), kind, stop=stop, detached=True)
    try:
        return store, job_lease.acquire(store, lease)
    except job_lease.LeaseHeld as e:
        held = e.lease
    why = _gone(store, held, kind, hosts, gone)
    if why is not None and job_lease.drop(store, held.job):
        if out is not None:
            print(f"job {held.job} held the run, but {why}: no worker of it runs; its lease "
                  f"is taken over", file=out, flush=True)
        try:
            return store, job_lease.acquire(store, lease)
        except job_lease.LeaseHeld as e:  # another launcher took it over first
            held = e.lease
    raise targets.UsageError(job_lease.refusal(store.location, held, time.time())) from None


def same_hosts(held: job_lease.JobLease | None, kind: str, hosts: list[str]) -> bool:
    """Whether `held` is a detached lease of a `kind` job on exactly `hosts`."""
    return (held is not None and held.detached and held.target == kind
            and list(held.hosts) == list(hosts))


def _gone(store, held, kind, hosts, gone) -> str | None:
    """Before the held job's hosts have reported, its lease is a launch still starting
    them: never taken over."""
    if gone is None or not same_hosts(held, kind, hosts):
        return None
    if not any(hb.job == held.job for hb in job_lease.run_heartbeats(store)):
        return None
    return gone(held)


def give_back(taken) -> None:
    """The plan failed before the workers started: the run is free again."""
    if taken is not None:
        job_lease.release(*taken)


@contextlib.contextmanager
def holding(taken):
    """Holds `taken` (from `take`; None: the lease is another's, a joined job's) while a
    launch runs: yields `failed(code)`, which gives it back on a nonzero code; an
    exception gives it back too, as the workers did not start."""
    try:
        yield lambda code: give_back(taken) if code != 0 else None
    except BaseException:
        give_back(taken)
        raise


def release(run: str | None, kind: str, hosts: list[str], out) -> None:
    """`actx down`: the run's lease goes with the hosts when their job holds it. `run`:
    the config's run location (None: it names none)."""
    if not run:
        return
    try:
        directory = run_dir.RunDir.at(run)
        held = directory.lease()
        if same_hosts(held, kind, hosts) and job_lease.drop(directory.store, held.job):
            print(f"released the run's job lease of job {held.job} ({run})", file=out)
    except Exception as e:  # noqa: BLE001 - the hosts are gone; the lease then ends by itself
        print(f"note: could not release the job lease of {run}: {e}", file=out)
