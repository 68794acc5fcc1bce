"""The tpu-vm target: a Cloud TPU VM slice driven through `gcloud compute tpus`.

A plan is a list of commands (deploy.commands), executed exactly as `--dry-run` prints
them: request the slice (a queued resource, waited for until ACTIVE and no longer once it
is FAILED or SUSPENDED, or a plain TPU VM), prepare, build actx's wheel from this install in
a directory of the job's own, copy and install it on every host, and start one worker per
host detached (nohup setsid: the job outlives the submitter). The whole slice is one
replica (docs/ARCHITECTURE.md): every host gets the process count, its process id (the metadata
server's agent-worker-number) and worker 0's address as coordinator. Each host runs
`deploy.host_run`, which copies its log into <run>/logs/<job>/<host>.log as it grows.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import tempfile

from actx.deploy import config as config_lib
from actx.deploy import targets
from actx.deploy.commands import Command
from actx.deploy.targets import TargetError
from actx.deploy.targets.tpu_vm import accelerators as tpu_types
from actx.deploy.targets.tpu_vm import package as tpu_package
from actx.schemas import advice
from actx.schemas import layout
from actx.schemas import parallelism
from actx.schemas import request_budget
from actx.schemas import worker_options

# A real host asks its metadata server; ACTX_TPU_METADATA_URL replaces it (tests' hosts).
METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes"
_BASE = '"${ACTX_TPU_METADATA_URL:-' + METADATA + '}'
_CURL = "curl -sf -H Metadata-Flavor:Google "
PROCESS_ID_EXPR = f'"$({_CURL}{_BASE}/agent-worker-number")"'
WORKER0_IP_EXPR = f'$({_CURL}{_BASE}/worker-network-endpoints" | cut -d, -f1 | cut -d: -f3)'
FAILED_QR_STATES = ("FAILED", "SUSPENDED")


def slice_shape(tpu: config_lib.TpuConfig) -> tpu_types.SliceShape:
    try:
        return tpu_types.parse(tpu.accelerator_type)
    except ValueError as e:
        raise TargetError(f"target.tpu.accelerator_type: {e}") from None


def slice_hosts(tpu: config_lib.TpuConfig) -> int:
    return slice_shape(tpu).hosts


def problems(run: str, target: config_lib.TargetConfig) -> list[str]:
    """Everything wrong with running `target` (kind tpu-vm) on `run`, found without Cloud."""
    tpu = target.tpu
    found = []
    missing = [k for k in ("name", "zone", "project") if not getattr(tpu, k)]
    if missing:
        found.append(f"target.tpu: {', '.join(missing)} required for the tpu-vm target")
    if not run.startswith("gs://"):
        found.append(f"run {run!r}: TPU VM hosts need a gs:// run directory")
    try:
        shape = tpu_types.parse(tpu.accelerator_type)
    except ValueError as e:
        return found + [f"target.tpu.accelerator_type: {e}"]
    if tpu.hosts and tpu.hosts != shape.hosts:
        found.append(f"target.tpu.hosts: {tpu.hosts}, but a {shape.accelerator_type} slice has "
                     f"{shape.hosts} host(s); drop target.tpu.hosts")
    model = parallelism.model_parallel_problem(target.model_parallel, shape.devices_per_host)
    if model:
        found.append(f"target.model_parallel: {model} ({shape.accelerator_type})")
    else:
        split = parallelism.devices_problem(
            target.batch_size, parallelism.data_parallel(shape.devices, target.model_parallel),
            group="slice", detail=f"{shape.accelerator_type}: {shape.hosts} host(s) x "
            f"{shape.devices_per_host} device(s), model_parallel {target.model_parallel}")
        if split:
            found.append(f"target.batch_size: {split}")
    if tpu.log_every_s < 1:
        found.append(f"target.tpu.log_every_s: {tpu.log_every_s:g}; GCS takes one write per "
                     f"second per object: use 1 or more")
    return found


def check(run: str, target: config_lib.TargetConfig) -> None:
    """Raises TargetError naming every problem at once."""
    targets.refuse("tpu-vm", problems(run, target))


def _where(tpu: config_lib.TpuConfig) -> list[str]:
    return ["--zone", tpu.zone, "--project", tpu.project]


def _gcloud(*words: str) -> tuple[str, ...]:
    return ("gcloud", "compute", "tpus", *words)


def create_commands(tpu: config_lib.TpuConfig, config: str = "CONFIG") -> list[Command]:
    spot = ["--spot"] if tpu.spot else []
    exists = (f"if {tpu.name} exists from an earlier submit: `{advice.down(config)}` "
              f"deletes it, or set target.tpu.create: false to use it")
    if tpu.queued_resource:
        return [
            Command(_gcloud("queued-resources", "create", tpu.name, "--node-id", tpu.name,
                            *_where(tpu), "--accelerator-type", tpu.accelerator_type,
                            "--runtime-version", tpu.runtime_version, *spot),
                    f"request the TPU slice {tpu.name} as a queued resource", on_fail=exists),
            Command(_gcloud("queued-resources", "describe", tpu.name, *_where(tpu),
                            "--format=value(state.state)"),
                    "wait until the queued resource is provisioned", poll_until="ACTIVE",
                    poll_fail=FAILED_QR_STATES, poll_timeout_s=tpu.wait_timeout_s,
                    on_fail=f"the queued resource {tpu.name} did not become ACTIVE; nothing "
                            f"was prepared or started. It stays until deleted: "
                            f"`{advice.down(config)}`, then submit again (another zone, or "
                            f"target.tpu.spot false, may have capacity)"),
        ]
    return [Command(_gcloud("tpu-vm", "create", tpu.name, *_where(tpu), "--accelerator-type",
                            tpu.accelerator_type, "--version", tpu.runtime_version, *spot),
                    f"create the TPU VM slice {tpu.name}", on_fail=exists)]


def delete_commands(tpu: config_lib.TpuConfig, may_fail: bool = False) -> list[Command]:
    """Deletes what `create_commands` made (a queued resource with its node, or the VM)."""
    if tpu.queued_resource:
        return [Command(_gcloud("queued-resources", "delete", tpu.name, *_where(tpu),
                                "--force", "--quiet"),
                        f"delete the queued resource {tpu.name} and its TPU slice",
                        may_fail=may_fail)]
    return [Command(_gcloud("tpu-vm", "delete", tpu.name, *_where(tpu), "--quiet"),
                    f"delete the TPU VM slice {tpu.name}", may_fail=may_fail)]


def ssh(tpu: config_lib.TpuConfig, command: str, what: str) -> Command:
    return Command(_gcloud("tpu-vm", "ssh", tpu.name, *_where(tpu), "--worker=all",
                           f"--command={command}"), what)


def job_dir(job: str) -> str:
    """This machine's directory for a job's files (the wheel, the prepare spec)."""
    return os.path.join(tempfile.gettempdir(), f"actx-{job}")


def install_commands(tpu: config_lib.TpuConfig, job: str) -> list[Command]:
    pip = f"{tpu.python} -m pip install -q"
    jax = f" {shlex.quote(tpu.jax_requirement)}" if tpu.jax_requirement else ""
    if tpu.install:
        return [ssh(tpu, f"{pip} {shlex.quote(tpu.install)}{jax}",
                    "install actx and JAX on every host")]
    out = job_dir(job)
    name = tpu_package.wheel_name(tpu_package.package_version())
    where = "this checkout" if tpu_package.is_checkout() else "the installed actx"
    return [
        Command((sys.executable, "-m", "actx.deploy.targets.tpu_vm.package", "--out", out),
                f"build a wheel of {where} in {out}"),
        Command(_gcloud("tpu-vm", "scp", os.path.join(out, name), f"{tpu.name}:{name}",
                        *_where(tpu), "--worker=all"), "copy it to every host"),
        ssh(tpu, f"{pip} \"actx-lm[workers] @ file://$HOME/{name}\"{jax}",
            "install actx and JAX on every host"),
    ]


def worker_env(tpu: config_lib.TpuConfig) -> dict[str, str]:
    """The environment of each host's worker (values are shell words, evaluated on the host)."""
    hosts = slice_hosts(tpu)
    env = {"ACTX_NUM_PROCESSES": str(hosts), "ACTX_PROCESS_ID": PROCESS_ID_EXPR}
    if hosts > 1:
        env["ACTX_COORDINATOR"] = f'"{WORKER0_IP_EXPR}:{tpu.coordinator_port}"'
    env.update({k: shlex.quote(v) for k, v in sorted(tpu.env.items())})
    return env


def worker_argv(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
                only: list[int] | None = None, extraction: str | None = None) -> list[str]:
    """The worker command of every host: the whole slice is one replica, and each host
    learns its place in it from the environment (`worker_env`)."""
    opts = worker_options.WorkerOptions.for_job(
        target, run=run, job=job, only=only, expect_fingerprint=fingerprint, steal=False,
        extraction=extraction)
    return [target.tpu.python, "-m", "actx.workers.main", *opts.to_argv()]


def log_every_s(tpu: config_lib.TpuConfig) -> float:
    """Seconds between a host's log copies: the configured `log_every_s`, longer on a slice
    whose hosts would pass the bucket's budget for logs (schemas.request_budget)."""
    return request_budget.log_interval_s(tpu.log_every_s, slice_hosts(tpu))


def host_name_expr(tpu: config_lib.TpuConfig) -> str:
    """Each host's name (its heartbeat and its log): the slice's name and worker number."""
    return f'"{tpu.name}-w$ACTX_PROCESS_ID"'


def worker_script(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
                  only: list[int] | None = None, extraction: str | None = None) -> str:
    """The shell line each host runs: its place in the slice, then the worker under
    deploy.host_run, detached from the ssh session."""
    tpu = target.tpu
    exports = "; ".join(f"export {k}={v}" for k, v in worker_env(tpu).items())
    host = host_name_expr(tpu)
    supervisor = shlex.join([tpu.python, "-m", "actx.deploy.host_run", "--run", run, "--job", job,
                             "--log-every-s", f"{log_every_s(tpu):g}"])
    worker = shlex.join(worker_argv(run, target, fingerprint, job, only, extraction))
    return (f"{exports}; test -n \"$ACTX_PROCESS_ID\" || {{ echo 'no TPU metadata server "
            f"answered (agent-worker-number)' >&2; exit 1; }}; "
            f"nohup setsid {supervisor} --host {host} -- {worker} --host-name {host} "
            f"> \"$HOME/actx-{job}.out\" 2>&1 < /dev/null & "
            f"echo \"worker $ACTX_PROCESS_ID of {slice_hosts(tpu)} started (pid $!)\"")


def start_command(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
                  only: list[int] | None = None, config: str = "CONFIG",
                  extraction: str | None = None) -> Command:
    cmd = ssh(target.tpu, worker_script(run, target, fingerprint, job, only, extraction),
              f"start one worker per host, detached ({slice_hosts(target.tpu)} host(s), "
              f"one replica); logs go to {run.rstrip('/')}/{layout.LOGS_PREFIX}{job}/")
    return dataclasses.replace(cmd, on_fail=(
        f"if the slice was preempted or deleted: `{advice.rerun_recreate(run, config)}`"))


def plan(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
         only: list[int] | None = None, create: bool | None = None, install: bool = True,
         prepare: list[Command] = (), recreate: bool = False,
         config: str = "CONFIG", extraction: str | None = None) -> list[Command]:
    """Create (optional; `recreate`: delete first), prepare (optional), install, start
    (`extraction`: the run's extractions the workers extract, workers' --extraction).

    The slice comes first, so a queued resource that fails leaves nothing prepared.
    `config`: the submit config's path, as the printed hints name it.
    """
    check(run, target)
    tpu = target.tpu
    cmds = delete_commands(tpu, may_fail=True) if recreate else []
    if recreate or (tpu.create if create is None else create):
        cmds += create_commands(tpu, config)
    cmds += prepare
    if install or recreate:
        cmds += install_commands(tpu, job)
    cmds.append(start_command(run, target, fingerprint, job, only, config, extraction))
    return cmds


def down_plan(tpu: config_lib.TpuConfig) -> list[Command]:
    """Deletes the slice that `submit` created (refused for one it did not create)."""
    missing = [k for k in ("name", "zone", "project") if not getattr(tpu, k)]
    if missing:
        raise TargetError(f"target.tpu: {', '.join(missing)} required")
    if not tpu.create:
        raise TargetError(f"target.tpu.create is false: actx did not create {tpu.name!r}, so "
                          f"it does not delete it (gcloud compute tpus tpu-vm delete "
                          f"{tpu.name} --zone {tpu.zone} --project {tpu.project})")
    return delete_commands(tpu)
