"""What the Slurm target runs: one batch script, submitted as an array, and the commands
around it, as data (deploy.commands) so that `--dry-run` prints every byte.

The array has one task per replica (`--array=0-<replicas-1>`), each allocated `nodes`
nodes; the script's one job step (`srun`, one task per node) starts deploy/targets/slurm/step.py on
every node, which reads its place from Slurm's environment (SLURM_ARRAY_TASK_ID: the
replica; SLURM_PROCID / SLURM_NTASKS: the process within it; the step's first node: the
coordinator) and runs the worker under deploy/detached/host_run.py.
"""

from __future__ import annotations

import getpass
import os
import re
import shlex

from actx.deploy import config as config_lib
from actx.deploy import targets
from actx.deploy.commands import Command
from actx.schemas import parallelism
from actx.schemas import request_budget
from actx.schemas import worker_options

KIND = "slurm"


def devices_per_node(slurm) -> int:
    """JAX devices of one node: devices_per_node, else the count of a "gpu[:type]:N" gres."""
    if slurm.devices_per_node:
        return slurm.devices_per_node
    m = re.match(r"gpu(?::[^:,]+)?:(\d+)$", slurm.gres.split(",")[0]) if slurm.gres else None
    return int(m.group(1)) if m else 1


def host_name(name: str, replica: int, task: int) -> str:
    """A host's name (its heartbeat's and its log's): the job's name, replica and task."""
    return f"{name}-r{replica}h{task}"


def host_names(slurm) -> list[str]:
    return [host_name(slurm.name, r, t) for r in range(slurm.replicas)
            for t in range(slurm.nodes)]


def problems(run: str, target: config_lib.TargetConfig) -> list[str]:
    """Everything wrong with running `target` (kind slurm) on `run`, found here."""
    slurm, found = target.slurm, []
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", slurm.name):
        found.append(f"target.slurm.name: {slurm.name!r}; use letters, digits, '_', '.', '-'")
    if slurm.replicas < 1 or slurm.nodes < 1:
        found.append(f"target.slurm: replicas ({slurm.replicas}) and nodes ({slurm.nodes}) "
                     f"must be >= 1")
        return found
    if run.startswith("memory://") or ("://" not in run and not os.path.isabs(run)):
        found.append(f"run {run!r}: the nodes need a run directory they can reach: a "
                     f"gs:// URI or an absolute path on a filesystem they share")
    if slurm.log_every_s < 1:
        found.append(f"target.slurm.log_every_s: {slurm.log_every_s:g}; use 1 or more")
    per_node = devices_per_node(slurm)
    model = parallelism.model_parallel_problem(target.model_parallel, per_node)
    split = parallelism.hosts_problem(target.batch_size, slurm.nodes)
    if model:
        found.append(f"target.model_parallel: {model} ({per_node} device(s) per node)")
    elif split:
        found.append(f"target.batch_size: {split}")
    else:
        devices = parallelism.data_parallel(slurm.nodes * per_node, target.model_parallel)
        split = parallelism.devices_problem(
            target.batch_size, devices, detail=f"{slurm.nodes} node(s) x {per_node} "
            f"device(s), model_parallel {target.model_parallel}")
        if split:
            found.append(f"target.batch_size: {split}")
    return found


def check(run: str, target: config_lib.TargetConfig) -> None:
    """Raises TargetError naming every problem at once."""
    targets.refuse("slurm", problems(run, target))


def output_dir(slurm, job: str) -> str:
    return slurm.output_dir or os.path.join(os.path.expanduser("~"), "actx-slurm", job)


def sbatch_flags(slurm, job: str) -> list[str]:
    """The array, its allocation and its output files, as sbatch's own flags.
    --no-requeue: a task whose node fails ends (NODE_FAIL) rather than wait in the queue
    to start over (Slurm requeues by default, after a delay): its job would go on holding
    the run's lease while pending, refusing the `actx rerun` that status advises.
    `sbatch_args: ["--requeue"]` gives Slurm's way back."""
    flags = [f"--job-name={slurm.name}", f"--array=0-{slurm.replicas - 1}",
             f"--nodes={slurm.nodes}", "--ntasks-per-node=1", "--no-requeue",
             f"--output={os.path.join(output_dir(slurm, job), '%x-%A_%a.out')}"]
    for key in ("partition", "account", "qos", "time", "gres", "constraint", "mem"):
        if getattr(slurm, key):
            flags.append(f"--{key}={getattr(slurm, key)}")
    if slurm.cpus_per_task:
        flags.append(f"--cpus-per-task={slurm.cpus_per_task}")
    return flags + list(slurm.sbatch_args)


def worker_argv(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
                only: list[int] | None = None, extraction: str | None = None) -> list[str]:
    """The worker command of every task; step.py adds its place (replica, host name,
    process group) from Slurm's environment."""
    replicas = target.slurm.replicas
    opts = worker_options.WorkerOptions.for_job(
        target, run=run, job=job, only=only, expect_fingerprint=fingerprint,
        replicas=replicas, steal=target.steal and replicas > 1, extraction=extraction)
    return [target.slurm.python, "-m", "actx.workers.main", *opts.to_argv()]


def script(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
           only: list[int] | None = None, extraction: str | None = None) -> str:
    """The batch script: the job-wide environment, the setup lines, one job step."""
    slurm = target.slurm
    # Longer than configured where the job's hosts would pass the bucket's budget for log
    # copies (schemas.request_budget).
    log_every_s = request_budget.log_interval_s(slurm.log_every_s, slurm.replicas * slurm.nodes)
    step = [slurm.python, "-m", "actx.deploy.targets.slurm.step", "--run", run, "--job", job,
            "--name", slurm.name, "--port", str(slurm.coordinator_port),
            "--log-every-s", f"{log_every_s:g}",
            *(["--coordinator", slurm.coordinator] if slurm.coordinator != "node_name" else []),
            "--",
            *worker_argv(run, target, fingerprint, job, only, extraction)]
    lines = ["#!/bin/bash", f"# actx job {job}: one replica per array task, one task per node",
             "set -e"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(slurm.env.items())]
    lines += list(slurm.setup)
    lines.append(f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {shlex.join(step)}")
    return "\n".join(lines) + "\n"


def script_path(job: str) -> str:
    from actx.deploy.targets.dataflow import plan as dataflow

    return os.path.join(dataflow.job_dir(job), "sbatch.sh")


def submit_command(slurm, job: str, config: str = "CONFIG") -> Command:
    return Command(("sbatch", "--parsable", *sbatch_flags(slurm, job), script_path(job)),
                   f"submit the job: {slurm.replicas} replica(s) x {slurm.nodes} node(s), "
                   f"one job step each",
                   on_fail=f"sbatch refused the job; nothing started. Check "
                           f"target.slurm in {config} against `sinfo` and `sacctmgr show assoc`")


def cancel_command(slurm) -> Command:
    return Command(("scancel", f"--name={slurm.name}", f"--user={getpass.getuser()}"),
                   f"cancel your Slurm jobs named {slurm.name}")


def running(slurm) -> str:
    """`squeue`'s array tasks of your jobs of this name that are pending or running
    ("" when none; None when squeue could not say)."""
    import subprocess

    argv = ["squeue", "--noheader", f"--name={slurm.name}", f"--user={getpass.getuser()}",
            "--format=%i %T"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
