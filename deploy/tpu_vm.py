"""The tpu-vm target: a Cloud TPU VM slice driven through `gcloud compute tpus tpu-vm`.

Creates the slice when asked (directly or as a queued resource), installs actx on every
host, and starts one worker per host with `ssh --worker=all`. The whole slice is one
replica (DESIGN.md): every host gets the process count, its own process id (the TPU
metadata's agent-worker-number) and worker 0's internal address as coordinator, read from
the metadata server on the host itself. Each host's log is copied into <run>/logs/<job>/.
"""

from __future__ import annotations

import re

from deploy import config as config_lib
from deploy.commands import Command
from schemas import worker_options

METADATA = ("http://metadata.google.internal/computeMetadata/v1/instance/attributes/")
_CURL = "curl -s -H Metadata-Flavor:Google "
PROCESS_ID_EXPR = f'"$({_CURL}{METADATA}agent-worker-number)"'
WORKER0_IP_EXPR = f"$({_CURL}{METADATA}worker-network-endpoints | cut -d, -f1 | cut -d: -f3)"


class TargetError(ValueError):
    """The target config lacks something the target needs."""


def slice_hosts(tpu: config_lib.TpuConfig) -> int:
    """Hosts of the slice: `tpu.hosts`, else derived from the accelerator type."""
    if tpu.hosts:
        return tpu.hosts
    m = re.fullmatch(r"(v2|v3|v4|v5p|v5litepod|v5e|v6e)-(\d+)", tpu.accelerator_type)
    if not m:
        raise TargetError(f"target.tpu.accelerator_type {tpu.accelerator_type!r}: cannot tell "
                          f"the number of hosts; set target.tpu.hosts")
    gen, n = m.group(1), int(m.group(2))
    if gen in ("v2", "v3", "v4", "v5p"):  # n counts TensorCores: 8 per host
        return max(1, n // 8)
    return 1 if n <= 8 else n // 4  # n counts chips: 4 per host beyond single-host slices


def check(run: str, tpu: config_lib.TpuConfig) -> None:
    missing = [k for k in ("name", "zone", "project") if not getattr(tpu, k)]
    if missing:
        raise TargetError(f"target.tpu: {', '.join(missing)} required for the tpu-vm target")
    if not run.startswith("gs://"):
        raise TargetError(f"run {run!r}: TPU VM hosts need a gs:// run directory")


def _where(tpu: config_lib.TpuConfig) -> list[str]:
    return ["--zone", tpu.zone, "--project", tpu.project]


def create_commands(tpu: config_lib.TpuConfig) -> list[Command]:
    spot = ["--spot"] if tpu.spot else []
    if tpu.queued_resource:
        return [
            Command(("gcloud", "compute", "tpus", "queued-resources", "create", tpu.name,
                     "--node-id", tpu.name, *_where(tpu), "--accelerator-type",
                     tpu.accelerator_type, "--runtime-version", tpu.runtime_version, *spot),
                    f"request the TPU slice {tpu.name} as a queued resource"),
            Command(("gcloud", "compute", "tpus", "queued-resources", "describe", tpu.name,
                     *_where(tpu), "--format=value(state.state)"),
                    "wait until the queued resource is provisioned", poll_until="ACTIVE"),
        ]
    return [Command(("gcloud", "compute", "tpus", "tpu-vm", "create", tpu.name, *_where(tpu),
                     "--accelerator-type", tpu.accelerator_type, "--version",
                     tpu.runtime_version, *spot), f"create the TPU VM slice {tpu.name}")]


def ssh(tpu: config_lib.TpuConfig, command: str, what: str) -> Command:
    return Command(("gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu.name, *_where(tpu),
                    "--worker=all", f"--command={command}"), what)


def sdist_name(version: str) -> str:
    return f"actx-{version}.tar.gz"


def install_commands(tpu: config_lib.TpuConfig, version: str) -> list[Command]:
    pip = f"{tpu.python} -m pip install -q"
    if tpu.install:
        return [ssh(tpu, f"{pip} {_q(tpu.install)} 'jax[tpu]'",
                    "install actx and JAX for TPU on every host")]
    name = sdist_name(version)
    return [
        Command(("python3", "setup.py", "-q", "sdist", "--dist-dir", "dist"),
                "build an sdist of this checkout", cwd=config_lib.REPO_ROOT),
        Command(("gcloud", "compute", "tpus", "tpu-vm", "scp", f"dist/{name}",
                 f"{tpu.name}:{name}", *_where(tpu), "--worker=all"),
                "copy it to every host", cwd=config_lib.REPO_ROOT),
        ssh(tpu, f"{pip} \"actx[workers] @ file://$HOME/{name}\" 'jax[tpu]'",
            "install actx and JAX for TPU on every host"),
    ]


def _q(text: str) -> str:
    import shlex

    return shlex.quote(text)


def worker_env(tpu: config_lib.TpuConfig) -> dict[str, str]:
    """The environment of each host's worker (values are shell words, evaluated on the host)."""
    hosts = slice_hosts(tpu)
    env = {"ACTX_NUM_PROCESSES": str(hosts), "ACTX_PROCESS_ID": PROCESS_ID_EXPR}
    if hosts > 1:
        env["ACTX_COORDINATOR"] = f'"{WORKER0_IP_EXPR}:{tpu.coordinator_port}"'
    env.update({k: _q(v) for k, v in sorted(tpu.env.items())})
    return env


def worker_argv(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
                only: list[int] | None = None) -> list[str]:
    """The worker command of every host: the whole slice is one replica, and each host
    learns its place in it from the environment (`worker_env`)."""
    opts = worker_options.WorkerOptions.for_job(
        target, run=run, job=job, only=only, expect_fingerprint=fingerprint, steal=False)
    return [target.tpu.python, "-m", "workers.main", *opts.to_argv()]


def worker_script(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
                  only: list[int] | None = None) -> str:
    """The shell line each host runs: env, the worker (log to a file), log upload, status."""
    import shlex

    exports = "; ".join(f"export {k}={v}" for k, v in worker_env(target.tpu).items())
    log = f"$HOME/actx-{job}.log"
    dest = f"{run.rstrip('/')}/logs/{job}/worker-$ACTX_PROCESS_ID.log"
    worker = shlex.join(worker_argv(run, target, fingerprint, job, only))
    return (f"{exports}; {worker} > {log} 2>&1; rc=$?; "
            f"gcloud storage cp {log} {dest}; exit $rc")


def plan(run: str, target: config_lib.TargetConfig, fingerprint: str, job: str,
         version: str, only: list[int] | None = None, create: bool | None = None,
         install: bool = True) -> list[Command]:
    """Create (optional), install, then one worker per host on the whole slice."""
    tpu = target.tpu
    check(run, tpu)
    cmds = create_commands(tpu) if (tpu.create if create is None else create) else []
    if install:
        cmds += install_commands(tpu, version)
    cmds.append(ssh(tpu, worker_script(run, target, fingerprint, job, only),
                    f"start one worker per host ({slice_hosts(tpu)} host(s), one replica); "
                    f"logs go to {run.rstrip('/')}/logs/{job}/"))
    return cmds
