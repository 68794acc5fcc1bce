"""`submit --wait` / `rerun --wait` on the tpu-vm target: deploy/detached/follow.py, with
the slice's words (how its partitions are redone, where a host's own output is)."""

from __future__ import annotations

import sys

from actx.deploy.detached import follow as detached_follow
from actx.deploy.status import runstate
from actx.schemas import advice
from actx.schemas import job_lease
from actx.schemas import run_dir


def follow(run: "str | run_dir.RunDir", host_prefix: str, started_at: float,
           wanted: list[int] | None = None,
           config: str = "CONFIG", out=sys.stdout, every_s: float = 5.0,
           stale_after_s: float = runstate.DEFAULT_STALE_AFTER_S,
           start_timeout_s: float = job_lease.DETACHED_START_GRACE_S,
           extraction: str | None = None, job: str = "") -> int:
    """Follows the slice's job (hosts `<host_prefix><i>`) until it ends: 0 when the
    `wanted` partitions are committed, 1 when its hosts are gone."""
    run = run_dir.RunDir.at(run)
    return detached_follow.follow(
        run, host_prefix, started_at, wanted, out=out, every_s=every_s,
        stale_after_s=stale_after_s, start_timeout_s=start_timeout_s, extraction=extraction,
        job=job, where="the slice", look="~/actx-*.out on the hosts",
        rerun=f"`{advice.rerun_on(run.uri, 'tpu-vm', config)}` redoes them "
              f"(`{advice.rerun_recreate(run.uri, config)}` after a preemption)")
