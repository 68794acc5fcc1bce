"""A detached target's launch: its plan run under the run's job lease, then where the
workers are, and `--wait` following them. The target gives what only it knows: how the
lease is taken, where its workers run, how they stop, how they are followed."""

from __future__ import annotations

import time
from typing import Callable

from actx.deploy import commands
from actx.deploy import targets
from actx.deploy.detached import lease
from actx.schemas import advice


def launch(plan, job: targets.Job, opts: targets.LaunchOptions, out, *, config,
           take: Callable[[], object], running: str, stop: str,
           follow: Callable[[float], int], poll_s: float = 30.0,
           retry_argv: list[str] | None = None, records=None, before=None) -> int:
    """Runs `plan` under the run's detached job lease, taken by `take()` (not when joining:
    the lease is then the joined job's); `records` (the job's own records) and `before`
    (what the plan needs written first) run once the lease is held. A failed plan gives the
    lease back. Then prints `running` (where the workers run) and `stop` (how they stop),
    and with --wait returns `follow(started_at)`."""
    started_at = time.time()
    taken = None if opts.join else take()
    with lease.holding(taken) as failed:
        if records is not None:
            records()
        if before is not None:
            before()
        code = commands.execute(plan, out=out, poll_s=poll_s,
                                in_process=targets.prepare_in_process(retry_argv))
        failed(code)
    if code != 0:  # the failed step said what to do
        return code
    if not opts.join:  # how `actx rerun RUN` launches next (deploy.launch_record)
        from actx.deploy import launch_record
        from actx.schemas import extraction as extraction_lib

        launch_record.record(job.run.store, config, job.name, opts.config_file, opts.sets,
                             extraction_lib.parse(job.extraction))
    print(f"workers are running {running}, detached from this command.\n"
          f"  progress: {advice.watch(job.run.uri)}\n"
          f"  logs:     {job.run.log_uri(job.name)} "
          f"(copied as they grow)\n"
          f"  {stop}", file=out, flush=True)
    return follow(started_at) if opts.wait else 0
