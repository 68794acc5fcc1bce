"""`actx extract` / `python -m workers.main`: one extraction worker process per host.

Only wires flags to `workers.runner`; the process joins its replica's `jax.distributed`
group first (flags, or ACTX_* variables set by the launcher; none on a one-host replica).
"""

from __future__ import annotations

import argparse
import logging
import sys

from schemas import config as config_lib
from workers import distributed


def _ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated partition ids, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actx extract", description=__doc__)
    p.add_argument("--run", required=True, help="run directory: path, gs://bucket/path")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step, whole replica")
    p.add_argument("--replicas", type=int, default=1, help="independent replicas in the job")
    p.add_argument("--replica", type=int, default=0, help="this process's replica index")
    p.add_argument("--model-parallel", type=int, default=1, help="size of the model mesh axis")
    p.add_argument("--coordinator", default=None,
                   help="host:port of process 0 of this replica (multi-host replicas)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="hosts in this replica (default ACTX_NUM_PROCESSES or 1)")
    p.add_argument("--process-id", type=int, default=None,
                   help="this host's index in the replica (default ACTX_PROCESS_ID or 0)")
    p.add_argument("--steal", action="store_true",
                   help="after own partitions, take uncommitted ones of other replicas")
    p.add_argument("--job", default="job", help="job id shared by all processes of a job")
    p.add_argument("--only", type=_ids, default=None, help="only these partition ids: 3,7,9")
    p.add_argument("--expect-fingerprint", default=None,
                   help="refuse a run whose run.json fingerprint differs")
    p.add_argument("--host-name", default=None, help="name used for the heartbeat file")
    p.add_argument("--prefetch-depth", type=int, default=4)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--max-pending-mb", type=int, default=2048,
                   help="MB of shard blocks waiting for storage before the loop waits")
    p.add_argument("--allow-numerics-change", action="store_true",
                   help="accept a device kind / jax version / rows per device / model "
                        "parallelism other than the run's first attempt used")
    p.add_argument("--stop-check-steps", type=int, default=16,
                   help="multi-host replicas agree on a SIGTERM every N steps")
    p.add_argument("--heartbeat-s", type=float, default=2.0)
    p.add_argument("--gcs-request-concurrency", type=int, default=32)
    p.add_argument("--gcs-request-retries", type=int, default=8)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    distributed.ProcessGroup.from_env(args.coordinator, args.num_processes,
                                      args.process_id).initialize()
    from workers import runner

    opts = runner.WorkerOptions(
        run=args.run, batch_size=args.batch_size, replicas=args.replicas, replica=args.replica,
        model_parallel=args.model_parallel, steal=args.steal, job=args.job, only=args.only,
        expect_fingerprint=args.expect_fingerprint, host_name=args.host_name,
        prefetch_depth=args.prefetch_depth, writer_threads=args.writer_threads,
        max_pending_mb=args.max_pending_mb, heartbeat_s=args.heartbeat_s,
        allow_numerics_change=args.allow_numerics_change,
        stop_check_steps=args.stop_check_steps,
        gcs_request_concurrency=args.gcs_request_concurrency,
        gcs_request_retries=args.gcs_request_retries)
    try:
        worker = runner.Worker(opts)
    except (FileNotFoundError, config_lib.ConfigError, ValueError) as e:
        print(f"actx extract: error: {e}", file=sys.stderr)
        return 2
    worker.install_signal_handlers()
    try:
        return worker.run()
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
