"""One run, one job at a time: the lease a launcher takes on a run directory before its
workers start (`job_lease.json`, layout.JOB_LEASE_KEY), on local disk and on gs:// alike.

Taken create-only, so of two launchers starting at once exactly one wins. It holds until
`expires_at`, which its launcher renews while it waits for its workers; past that, it
still holds while any host of its job beats (live state, a fresh heartbeat, a process not
gone). A detached lease (tpu-vm: the launcher exits once the slice's workers start) does
not depend on its launcher at all: once a host of its job has reported, it holds exactly
while one of them beats; before that, for a start grace (install and model load on the
hosts) until `expires_at`. Once nothing holds it, a
new launcher takes it over: the create-only takeover object `leases/<job>-<renewed_at>`
decides who, then the expired lease is replaced. A second job that means to run beside
the first says so (`--join`) and takes no lease; its hosts get their own names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import time

from actx.schemas import config as config_lib
from actx.schemas import errors
from actx.schemas import extraction_store
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import layout
from actx.schemas import object_store
from actx.schemas import store as store_lib

LIVE_STATES = ("starting", "working", "idle")  # heartbeat states that claim a live host
DEFAULT_TTL_S = 120.0  # how long a lease holds without renewal (and a heartbeat, silent)
# How long a detached lease holds before any host of its job has reported: the hosts
# install actx and load the model first (the same wait as the start timeout of
# deploy/targets/tpu_vm/follow.py).
DETACHED_START_GRACE_S = 900.0


@dataclasses.dataclass(frozen=True)
class JobLease:
    """job: the job id. hosts: its worker hosts' names (heartbeats workers/<host>.json).
    launcher: machine (heartbeat_lib.this_machine()) and pid of the process that took it.
    target: local, tpu-vm, ... stop: how to stop the job, in words a user types.
    started_at / renewed_at / expires_at: seconds since the epoch. detached: its workers
    run without their launcher (tpu-vm), so only their heartbeats (or, before the first,
    the start grace until expires_at) hold it; lease files written before it read False."""

    job: str
    hosts: tuple[str, ...]
    machine: str
    pid: int
    target: str
    stop: str
    started_at: float
    renewed_at: float
    expires_at: float
    hostname: str = ""
    detached: bool = False

    def live(self, beats: list[heartbeat_lib.Heartbeat], now: float,
             ttl_s: float = DEFAULT_TTL_S) -> bool:
        """Unexpired, or a host of its job still beats. Detached: while a host of its job
        beats, or, none having reported yet, until its start grace ends."""
        mine = [hb for hb in beats if hb.job == self.job]
        if self.detached and not mine:
            return now < self.expires_at
        if not self.detached and now < self.expires_at and not self._launcher_gone():
            return True
        return bool(self.working_hosts(beats, now, ttl_s))

    def working_hosts(self, beats: list[heartbeat_lib.Heartbeat], now: float,
                      ttl_s: float = DEFAULT_TTL_S) -> list[heartbeat_lib.Heartbeat]:
        """The heartbeats of its job's hosts that still work (fresh, their process not
        gone)."""
        return [hb for hb in beats if hb.job == self.job and hb.state in LIVE_STATES
                and not heartbeat_lib.is_stale(hb, now, ttl_s)
                and not heartbeat_lib.process_gone(hb)]

    def launched_by(self, other: "JobLease") -> bool:
        """Whether `other` was made by the process that made this lease."""
        return (self.machine, self.pid) == (other.machine, other.pid)

    def _launcher_gone(self) -> bool:
        """Its launcher ran on this machine and is gone (killed): no need to wait for the
        expiry then, unless its hosts beat."""
        return heartbeat_lib.process_gone(heartbeat_lib.Heartbeat(
            host="", replica=0, process_index=0, state="working", attempt="",
            updated_at=0.0, machine=self.machine, pid=self.pid))

    def describe(self, now: float, beats: list[heartbeat_lib.Heartbeat] = ()) -> str:
        """Who holds the run and how to stop it. A launcher that is gone (killed) while
        its workers, on this machine, still work cannot be stopped as its lease says: the
        workers' own processes are named instead (a worker stops at its next step on
        SIGTERM, committing what is complete)."""
        hosts = ", ".join(self.hosts[:8]) + (" ..." if len(self.hosts) > 8 else "")
        where = self.hostname or self.machine
        said = (f"job {self.job} ({self.target}; hosts {hosts or '-'}; started "
                f"{now - self.started_at:.0f} s ago by pid {self.pid} on {where}")
        orphans = sorted({hb.pid for hb in self.working_hosts(beats, now)
                          if hb.machine == heartbeat_lib.this_machine() and hb.pid})
        if not self.detached and orphans and self._launcher_gone():
            pids = " ".join(map(str, orphans))
            return (f"{said}, which is gone, but its workers still run as pid(s) {pids}); "
                    f"stop them with `kill -TERM {pids}` on {where}")
        return f"{said}, renewed {now - self.renewed_at:.0f} s ago); stop it with {self.stop}"


class LeaseHeld(Exception):
    """Another live job holds the run; `lease` is its lease, `beats` the run's heartbeats
    as they were read when it was judged live."""

    def __init__(self, lease: JobLease, beats: list[heartbeat_lib.Heartbeat] = ()):
        super().__init__(lease.job)
        self.lease = lease
        self.beats = list(beats)


def new(job: str, hosts, target: str, stop: str, now: float | None = None,
        ttl_s: float = DEFAULT_TTL_S, detached: bool = False) -> JobLease:
    """A lease to acquire; a detached one holds `DETACHED_START_GRACE_S` before its hosts
    first report."""
    now = time.time() if now is None else now
    hold_s = DETACHED_START_GRACE_S if detached else ttl_s
    return JobLease(job=job, hosts=tuple(hosts), machine=heartbeat_lib.this_machine(),
                    pid=os.getpid(), target=target, stop=stop, started_at=now,
                    renewed_at=now, expires_at=now + hold_s, hostname=socket.gethostname(),
                    detached=detached)


def refusal(location, lease: JobLease, now: float,
            beats: list[heartbeat_lib.Heartbeat] = ()) -> str:
    """The one line a refused launcher prints: who holds the run, and what to do."""
    return (f"{location}: another job is extracting this run: "
            f"{lease.describe(now, beats)}. Wait for it to end, stop it, or add --join to run "
            f"this job beside it (its hosts get their own names and logs)")


def read(store) -> JobLease | None:
    data = store.read_json(layout.JOB_LEASE_KEY)
    if data is None:
        return None
    return config_lib.from_dict(JobLease, data, f"{store.location.join(layout.JOB_LEASE_KEY)}: ")


def _dumps(lease: JobLease) -> bytes:
    return store_lib.dumps(config_lib.to_dict(lease))


def acquire(store, lease: JobLease, now: float | None = None,
            ttl_s: float = DEFAULT_TTL_S) -> JobLease:
    """Takes the run for `lease`'s job, or raises LeaseHeld naming the live job that has
    it. A lease of the same job is renewed, not refused, where it is this launcher's
    (the same process), a detached job's (its hosts hold it: `--wait` after a launch), or
    its launcher is gone; another live launcher of a job of the same name (two `actx
    submit`s started in one second name their jobs alike) is refused as any other job."""
    for _ in range(3):  # a holder that released between our reads: try again
        if store.create(layout.JOB_LEASE_KEY, _dumps(lease)):
            return lease
        now_ = time.time() if now is None else now
        try:
            held = read(store)
        except object_store.DamagedObjectError as e:  # not JSON: who holds it is unknown
            return _over_a_damaged_lease(store, lease, e, now_, ttl_s)
        if held is None:
            continue
        if held.job == lease.job and (held.detached or held.launched_by(lease)
                                      or held._launcher_gone()):
            # a detached lease keeps its start grace
            hold_s = lease.expires_at - lease.renewed_at if lease.detached else ttl_s
            return renew(store, dataclasses.replace(lease, started_at=held.started_at),
                         now_, hold_s)
        beats = run_heartbeats(store)
        if held.live(beats, now_, ttl_s):
            raise LeaseHeld(held, beats)
        # Expired: exactly one taker wins the takeover object named after this lease.
        takeover = (f"{layout.JOB_LEASE_TAKEOVERS_PREFIX}{held.job}-"
                    f"{held.renewed_at:.3f}.json")
        if not store.create(takeover, _dumps(lease)):
            winner = read(store)
            raise LeaseHeld(winner if winner is not None else held)
        store.write(layout.JOB_LEASE_KEY, _dumps(lease))
        return lease
    raise LeaseHeld(read(store) or lease)


class DamagedLeaseHeld(errors.UserError, RuntimeError):
    """The run's lease is damaged and hosts of the run still work: which job holds the run
    cannot be read, so none is started beside them."""


def _over_a_damaged_lease(store, lease: JobLease, damage, now: float,
                          ttl_s: float) -> JobLease:
    """Takes a run whose lease is not JSON (damaged by hand or by a disk) for `lease`
    where no host of the run works (every heartbeat done, stale or its process gone), as
    an expired lease is taken: by one of two takers, through a create-only takeover
    object named after the damaged bytes. Where hosts work, raises DamagedLeaseHeld
    naming them."""
    working = [hb for hb in run_heartbeats(store) if hb.state in LIVE_STATES
               and not heartbeat_lib.is_stale(hb, now, ttl_s)
               and not heartbeat_lib.process_gone(hb)]
    if working:
        hosts = ", ".join(sorted({f"{hb.host} (job {hb.job or '?'})" for hb in working}))
        raise DamagedLeaseHeld(
            f"{store.location.join(layout.JOB_LEASE_KEY)}: {damage.what}: the run's job "
            f"lease is damaged, and hosts of the run still work: {hosts}. Wait for them to "
            f"end or stop them (a worker stops at its next step on SIGTERM), then run this "
            f"again: the damaged lease is then taken over")
    stamp = hashlib.sha256(store.read(layout.JOB_LEASE_KEY) or b"").hexdigest()[:16]
    if not store.create(f"{layout.JOB_LEASE_TAKEOVERS_PREFIX}damaged-{stamp}.json",
                        _dumps(lease)):
        try:  # another taker won, and writes its lease
            winner = read(store)
        except object_store.DamagedObjectError:
            winner = None
        raise LeaseHeld(winner or lease)
    store.write(layout.JOB_LEASE_KEY, _dumps(lease))
    return lease


def run_heartbeats(store) -> list[heartbeat_lib.Heartbeat]:
    """Every host's heartbeat in the run: the default extraction's and each named one's (a
    worker of a named extraction beats under its prefix, schemas.extraction), so a job
    extracting named models holds its lease by their beats too."""

    beats = heartbeat_lib.read_heartbeats(store, history=False)
    for name in extraction_store.named(store):
        beats += heartbeat_lib.read_heartbeats(extraction_store.view(store, name), history=False)
    return beats


def renew(store, lease: JobLease, now: float | None = None,
          ttl_s: float = DEFAULT_TTL_S) -> JobLease:
    """Moves the expiry on; writes only while the stored lease is this job's."""
    now = time.time() if now is None else now
    renewed = dataclasses.replace(lease, renewed_at=now, expires_at=now + ttl_s)
    held = read(store)
    if held is None or held.job == lease.job:
        store.write(layout.JOB_LEASE_KEY, _dumps(renewed))
    return renewed


def release(store, lease: JobLease) -> None:
    """Gives the run back, when the stored lease is still this job's."""
    held = read(store)
    if held is not None and held.job == lease.job and held.pid == lease.pid:
        store.delete(layout.JOB_LEASE_KEY)


def drop(store, job: str) -> bool:
    """Gives the run back for `job` whoever took it (`actx down` of a detached job's
    slice: its hosts are gone, though their last heartbeats may still look fresh)."""
    held = read(store)
    if held is None or held.job != job:
        return False
    store.delete(layout.JOB_LEASE_KEY)
    return True


class Keeper:
    """Holds a lease while a launcher waits for its workers: renews it every `every_s`
    from a daemon thread, releases it at the end (also when a stop signal ends the wait).
    A renewal that fails is logged; the hosts' heartbeats keep the lease meanwhile."""

    def __init__(self, store, lease: JobLease, every_s: float = DEFAULT_TTL_S / 4,
                 ttl_s: float = DEFAULT_TTL_S):
        import threading

        self._store, self.lease, self._every_s, self._ttl_s = store, lease, every_s, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="actx-lease")

    def __enter__(self) -> "Keeper":
        self.lease = acquire(self._store, self.lease, ttl_s=self._ttl_s)
        self._thread.start()
        return self

    def _loop(self) -> None:
        import logging

        while not self._stop.wait(self._every_s):
            try:
                self.lease = renew(self._store, self.lease, ttl_s=self._ttl_s)
            except Exception as e:  # noqa: BLE001 - the heartbeats hold it meanwhile
                logging.getLogger("actx.lease").warning("renewing the job lease failed: %s", e)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            release(self._store, self.lease)
        except Exception as e:  # noqa: BLE001 - it expires on its own
            import logging

            logging.getLogger("actx.lease").warning(
                "releasing the job lease failed (it expires on its own): %s", e)
