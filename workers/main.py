"""`actx extract` / `python -m workers.main`: one extraction worker process per host.

Only wires flags to `workers.runner`; the process joins its replica's `jax.distributed`
group first (flags, or ACTX_* variables set by the launcher; none on a one-host replica).
"""

from __future__ import annotations

import argparse
import logging
import sys

from schemas import errors, flags, worker_options
from workers import distributed
from workers.preflight import check_job  # noqa: F401  (deploy's pre-flight, through here)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actx extract", description=__doc__)
    flags.add_arguments(p, worker_options.WorkerOptions)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    opts = flags.from_namespace(worker_options.WorkerOptions, args)
    distributed.ProcessGroup.from_env(opts.coordinator, opts.num_processes,
                                      opts.process_id).initialize()
    from workers import flax_worker

    try:
        worker = flax_worker.worker_for_run(opts)  # runner.Worker, or one for a Flax model
    except (errors.UserError, FileNotFoundError, ValueError) as e:
        print(f"actx extract: error: {e}", file=sys.stderr)
        return 2
    worker.install_signal_handlers()
    try:
        return worker.run()
    except errors.UserError as e:
        # The store gave up, or the run changed under the worker: one line says what to do.
        # Nothing partial was committed.
        if worker.topo.hosts_per_replica > 1:
            _leave_replica_now()
        print(f"actx extract: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        if worker.topo.hosts_per_replica > 1:
            _leave_replica_now()
        raise


def _leave_replica_now() -> None:
    """Exits a failed host of a multi-host replica at once.

    A normal exit runs jax.distributed's shutdown barrier, which waits (minutes) for peers
    that are themselves blocked in a collective with this host; both would hang. Exiting
    without it lets the coordination service report this host as gone, so the peers fail
    fast too, and `actx rerun` redoes the partition.
    """
    import os
    import traceback

    traceback.print_exc()
    print("actx extract: this host failed; leaving its replica without the shutdown "
          "barrier so the other hosts stop too. Nothing partial was committed; "
          "`actx rerun` redoes the partition.", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
