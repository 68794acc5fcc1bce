"""What runs on each host of a detached job (a TPU VM host, a Slurm job step's task): the
worker, with its log copied into the run directory while it runs, and its death recorded.

The tpu-vm target starts this detached (nohup setsid), so the job outlives the submitter's
ssh session; the Slurm target runs it in each task of the job step (deploy/targets/slurm/step.py). The worker's output goes to a file on the host; every `log_every_s` seconds (at
least 1: GCS takes about one write per second per object) the file's last `max_log_mb` MB
replace <run>/logs/<job>/<host>.log, so a log is readable while the worker runs and what
was written before a preemption stays. A worker that dies with a non-zero code is recorded
in its heartbeat at once (status shows its partition stale), as the local target does: in
every extraction the worker was to extract, with its job and place, so that its replica's
other hosts waiting on it for an extraction's metadata learn it at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time

from actx.schemas import extraction as extraction_lib
from actx.schemas import run_dir
from actx.schemas.layout import log_key


class LogShipper:
    """Copies a growing local file to one object, at most once per `every_s` seconds."""

    def __init__(self, store, key: str, path: str, every_s: float, max_bytes: int):
        self.store, self.key, self.path = store, key, path
        self.every_s = max(1.0, every_s)
        self.max_bytes = max_bytes
        self._last_t = -1e9
        self._last_size = -1

    def maybe_ship(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force:  # the last copy still keeps to one write per second
            time.sleep(max(0.0, self._last_t + 1.0 - now))
        elif now - self._last_t < self.every_s:
            return False
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return False
        if size == self._last_size:
            return False
        with open(self.path, "rb") as f:
            if size > self.max_bytes:
                f.seek(size - self.max_bytes)
            data = f.read()
        if size > self.max_bytes:
            data = (f"[actx: the first {size - len(data)} bytes of this log are only on the "
                    f"host, in {self.path}]\n").encode() + data
        try:
            self.store.write(self.key, data)
        except Exception as e:  # the worker matters more than its log: try again later
            print(f"host_run: could not copy the log to {self.key}: {e}", file=sys.stderr,
                  flush=True)
            return False
        # Timed from the write's end: the next write starts at least a second after this
        # one did, however long reading the file and writing took.
        self._last_t, self._last_size = time.monotonic(), size
        return True


@dataclasses.dataclass(frozen=True)
class WorkerPlace:
    """Where a supervised worker stands in its job, as its own flags say (the launcher's
    record of its death carries it): its extractions ("" the default one), its replica and
    its index in the replica."""

    extractions: tuple[str, ...] = ("",)
    replica: int = 0
    process_index: int = 0


def worker_place(worker: list[str], env=None) -> WorkerPlace:
    """The place of the worker that command line `worker` starts, from the worker's flags
    (schemas.worker_options; a later flag wins, as in the worker) and, for the process
    index, ACTX_PROCESS_ID in `env` (None: this process's), which the worker falls back to
    too (a TPU host learns its index from the metadata server)."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--extraction")
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--process-id", type=int)
    try:
        flags, _ = p.parse_known_args(worker)
    except SystemExit:  # flags the worker would refuse itself: its default place
        return WorkerPlace()
    index = flags.process_id
    if index is None:
        try:
            index = int(env.get("ACTX_PROCESS_ID") or 0)
        except ValueError:
            index = 0
    return WorkerPlace(tuple(extraction_lib.parse(flags.extraction)), flags.replica, index)


def record_death(run: run_dir.RunDir, job: str, host: str, rc: int, log_path: str,
                 place: WorkerPlace) -> None:
    """Records in `host`'s heartbeat of each extraction of `place` that its worker died
    with exit code `rc` (deploy.local.mark_dead)."""
    from actx.deploy import local

    extractions = place.extractions
    if extractions == ("all",):
        extractions = tuple(extraction_lib.names(run.store))
    failed = []
    for name in extractions:  # each on its own: one that cannot be written stops no other
        try:
            local.mark_dead(run, host, rc, log_path, extraction=name, job=job,
                            replica=place.replica, process_index=place.process_index)
        except Exception as e:  # noqa: BLE001 - said below, with the others'
            failed.append(f"{name or 'default'}: {e}")
    if failed:
        raise RuntimeError("; ".join(failed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actx.deploy.host_run", description=__doc__)
    p.add_argument("--run", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--host", required=True, help="this host's name (its heartbeat's too)")
    p.add_argument("--log-every-s", type=float, default=10.0)
    p.add_argument("--max-log-mb", type=float, default=8.0)
    p.add_argument("worker", nargs=argparse.REMAINDER, help="-- the worker command")
    args = p.parse_args(argv)
    worker = args.worker[1:] if args.worker[:1] == ["--"] else args.worker
    if not worker:
        p.error("give the worker command after --")
    return supervise(args.run, args.job, args.host, worker, args.log_every_s, args.max_log_mb)


def supervise(run: "str | run_dir.RunDir", job: str, host: str, worker: list[str],
              log_every_s: float = 10.0, max_log_mb: float = 8.0,
              env: dict | None = None, forward_stop: bool = True) -> int:
    """Runs `worker` (with `env`, None: this process's) to its end, its output in a file
    under ~/actx-logs copied into the run's log of `host`; records a death (non-zero
    exit) in the host's heartbeat. Returns the exit status to exit with. `run`: the run's
    location, as the host's command line gives it. `forward_stop`: pass a SIGTERM this
    process gets on to the worker; False where whoever sends it signals every process
    (Slurm), so that the worker gets one notice, not two."""
    run = run_dir.RunDir.at(run)
    log_dir = os.path.join(os.path.expanduser("~"), "actx-logs")
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{job}-{host}.log")
    shipper = LogShipper(run.store, log_key(job, host), log_path, log_every_s,
                         int(max_log_mb * 2 ** 20))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(worker, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
    # A shutdown notice (SIGTERM) goes to the worker, which stops at a partition boundary;
    # this process stays to copy the log to its end and record the worker's exit.
    signal.signal(signal.SIGTERM, (lambda *_: proc.send_signal(signal.SIGTERM))
                  if forward_stop else signal.SIG_IGN)
    while proc.poll() is None:
        shipper.maybe_ship()
        time.sleep(0.5)
    rc = proc.returncode
    with open(log_path, "a") as log:
        log.write(f"[actx: worker exited with code {rc}]\n")
    shipper.maybe_ship(force=True)
    if rc != 0:
        try:
            record_death(run, job, host, rc, log_path,
                         worker_place(worker, os.environ if env is None else env))
        except Exception as e:  # status then learns it when the heartbeat goes stale
            print(f"host_run: could not record that the worker died: {e}", file=sys.stderr)
    from actx.deploy import commands

    return commands.exit_status(rc)


if __name__ == "__main__":
    sys.exit(main())
