"""`submit --wait` / `rerun --wait` on a detached target (tpu-vm, slurm): follow a job from
its run directory (markers and heartbeats, as `status --watch` does) until it ends.

The workers run on their own hosts, not under this process, so their end is read from the run:
every partition committed (exit 0), or none of the job's hosts live any more while some
partition is still without a commit (exit 1: failed, preempted or stopped).
"""

from __future__ import annotations

import sys
import time

from actx.deploy.status import partition_states
from actx.deploy.status import progress_line
from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.schemas import advice
from actx.schemas import job_lease
from actx.schemas import layout
from actx.schemas import run_dir


def job_hosts(status: runstate.RunStatus, prefix: str, since: float, job: str = "") -> list:
    """The hosts of this job: named `<prefix>...` (a slice's `<slice>-w<i>`), beating since the job started, and of
    this job where the heartbeat names one (a preempted job's last heartbeats on the same
    hosts are not this job's, however recent)."""
    return [h for h in status.hosts
            if h.host.startswith(prefix) and status.at - h.age_s >= since
            and not (job and h.job and h.job != job)]


def follow(run: "str | run_dir.RunDir", host_prefix: str, started_at: float,
           wanted: list[int] | None = None, out=sys.stdout, every_s: float = 5.0,
           stale_after_s: float = runstate.DEFAULT_STALE_AFTER_S,
           start_timeout_s: float = job_lease.DETACHED_START_GRACE_S,
           extraction: str | None = None, job: str = "", *, rerun: str,
           look: str, where: str) -> int:
    """Prints progress lines until the `wanted` partitions (None: all) are committed (0) or
    the job's hosts are gone (1); of every extraction `extraction` names (comma-separated;
    None: the default one), each with its own markers and heartbeats. `run`: the run
    directory (opened here unless it is an OpenedRun already). The target's words:
    `rerun`, how the partitions left are redone; `look`, where else a job that never
    started left its output; `where`, where the job goes on ("the slice")."""
    run = run_dir.RunDir.at(run)
    try:
        return _follow(run, host_prefix, started_at, wanted, out, every_s, stale_after_s,
                       start_timeout_s, extraction, job, (rerun, look))
    except KeyboardInterrupt:
        # Not "interrupted": the command's own "actx ...: interrupted" line says that.
        print(f"stopped following; the job goes on on {where} (committed partitions are "
              f"kept): `{advice.watch(run.uri)}` follows it again", file=out, flush=True)
        raise


def _follow(run, host_prefix, started_at, wanted, out, every_s, stale_after_s,
            start_timeout_s, extraction, job, words) -> int:
    from actx.schemas import extraction as extraction_lib

    opened = run.opened()
    names = extraction_lib.parse(extraction)
    handles = [extraction_lib.scoped(opened, name) for name in names]
    shown = progress_line.ProgressLine(out)
    try:
        return _follow_lines(run, host_prefix, started_at, wanted, out, every_s,
                             stale_after_s, start_timeout_s, names, handles, shown, job, words)
    finally:
        shown.end()


def _follow_lines(run, host_prefix, started_at, wanted, out, every_s, stale_after_s,
                  start_timeout_s, names, handles, shown, job, words) -> int:
    rerun, look = words
    while True:
        statuses = [runstate.compute_status(handle, stale_after_s) for handle in handles]
        ids = statuses[0].partitions if wanted is None else wanted
        behind = [i for i, s in enumerate(statuses)
                  if any(s.partitions[p] != partition_states.COMMITTED for p in ids)]
        # The last line (every partition committed) always shows, in a pipe too.
        shown.show(lambda width: status_text.lines_per_extraction(dict(zip(names, statuses)),
                                                                  width), force=not behind)
        if not behind:
            return 0
        # The workers run the extractions in order: the first one behind is the one at
        # work, and it has no heartbeat yet while the one before it has just finished.
        status = statuses[behind[0]]
        missing = [p for p in ids if status.partitions[p] != partition_states.COMMITTED]
        hosts = job_hosts(status, host_prefix, started_at, job)
        earlier = [h for s in statuses[:behind[0]] for h in job_hosts(s, host_prefix,
                                                                         started_at, job)]
        quiet_s = min((h.age_s for h in earlier), default=time.time() - started_at)
        if hosts and not any(h.live for h in hosts):
            shown.end()
            print(status_text.render(status), file=out)
            print(f"the job's {len(hosts)} host(s) stopped with {len(missing)} partition(s) "
                  f"without a commit; {rerun}", file=out, flush=True)
            return 1
        if not hosts and quiet_s > start_timeout_s:
            print(f"no worker of this job reported in {start_timeout_s:g} s; see "
                  f"{run.uri_of(layout.LOGS_PREFIX)} and {look}", file=out)
            return 1
        time.sleep(every_s)
