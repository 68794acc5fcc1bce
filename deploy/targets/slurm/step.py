"""What each task of a Slurm job step runs (`srun ... python -m actx.deploy.targets.slurm.step`):
its place in the job from Slurm's environment, then the worker under
deploy/detached/host_run.py (its log copied into the run, its death recorded).

The array task (SLURM_ARRAY_TASK_ID) is the replica; within it the task's rank
(SLURM_PROCID) of SLURM_NTASKS is its jax.distributed process, and the step's first node
(SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST) is the coordinator, on port + the replica
(two replicas' coordinators may share a node).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from actx.deploy.targets.slurm import plan


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: "gpu[003-005,9],cpu1" -> "gpu003" (a range's
    first number keeps its zero padding; each bracket of "r[1-2]n[01-04]" takes its first)."""
    head = re.match(r"([^,\[]*(?:\[[^\]]*\][^,\[]*)*)", nodelist.strip()).group(1)
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", head)


def node_addr(node: str) -> str:
    """A node's NodeAddr, from `scontrol -o show node NODE` (Slurm gives its name where
    slurm.conf sets no NodeAddr)."""
    import subprocess

    try:
        done = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"slurm step: cannot ask scontrol for {node}'s NodeAddr "
                         f"(target.slurm.coordinator node_addr): {e}") from None
    found = re.search(r"(?:^|\s)NodeAddr=(\S+)", done.stdout)
    if done.returncode != 0 or not found:
        raise SystemExit(f"slurm step: `scontrol -o show node {node}` gave no NodeAddr "
                         f"(target.slurm.coordinator node_addr): {done.stderr.strip()}")
    return found.group(1)


def placement(env, name: str, port: int, coordinator: str = "node_name") -> dict:
    """This task's worker flags from Slurm's environment `env`; `coordinator`: how the
    first node is reached (target.slurm.coordinator: its name, or its NodeAddr)."""
    replica = int(env.get("SLURM_ARRAY_TASK_ID") or 0)
    rank, tasks = int(env.get("SLURM_PROCID", 0)), int(env.get("SLURM_NTASKS", 1))
    flags = {"replica": replica, "host_name": plan.host_name(name, replica, rank)}
    if tasks > 1:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        if not nodes:
            raise SystemExit("slurm step: no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST; "
                             "run under srun")
        host = first_host(nodes)
        if coordinator == "node_addr":
            host = node_addr(host)
        flags.update(coordinator=f"{host}:{port + replica}", num_processes=tasks,
                     process_id=rank)
    return flags


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actx.deploy.targets.slurm.step",
                                description=__doc__)
    p.add_argument("--run", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--name", required=True, help="target.slurm.name: the hosts' prefix")
    p.add_argument("--port", type=int, required=True, help="the coordinators' first port")
    p.add_argument("--log-every-s", type=float, default=10.0)
    p.add_argument("--coordinator", choices=("node_name", "node_addr"), default="node_name",
                   help="target.slurm.coordinator: the first node's name or its NodeAddr")
    p.add_argument("worker", nargs=argparse.REMAINDER, help="-- the worker command")
    args = p.parse_args(argv)
    worker = args.worker[1:] if args.worker[:1] == ["--"] else args.worker
    if not worker:
        p.error("give the worker command after --")
    place = placement(os.environ, args.name, args.port, args.coordinator)
    # The worker's flags name its place (later flags win over the job-wide ones); ACTX_*
    # variables left in the environment must not join another group.
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in place.items()]
    env = {k: v for k, v in os.environ.items()
           if k not in ("ACTX_COORDINATOR", "ACTX_NUM_PROCESSES", "ACTX_PROCESS_ID")}
    from actx.deploy.detached import host_run

    # Slurm signals every process of the step (scancel, a time limit: SIGTERM, then SIGKILL
    # after KillWait): the worker has its notice already. A forwarded copy arriving over
    # ECHO_S late (a loaded host) would be a second signal, ending the host without its
    # replica's shutdown barrier (workers/main.py).
    return host_run.supervise(args.run, args.job, place["host_name"], worker + extra,
                              args.log_every_s, env=env, forward_stop=False)


if __name__ == "__main__":
    sys.exit(main())
