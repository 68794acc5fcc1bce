"""The job lease of a tpu-vm launch (schemas.job_lease, detached): `actx submit` and
`actx rerun --target tpu-vm` take it before the plan runs and exit once the slice's
workers start, so the workers' heartbeats hold it (before their first one, the start
grace); a failed plan gives it back, and so does `actx down` of that slice."""

from __future__ import annotations

import time

from actx.deploy import config as config_lib
from actx.deploy import targets
from actx.deploy import tpu_vm
from actx.schemas import job_lease
from actx.schemas import store as store_lib


def host_names(tpu: config_lib.TpuConfig) -> list[str]:
    """The slice's hosts as its workers name themselves (tpu_vm.host_name_expr)."""
    return [f"{tpu.name}-w{i}" for i in range(tpu_vm.slice_hosts(tpu))]


def take(run: "str | store_lib.ObjectStore", target: config_lib.TargetConfig, job: str,
         config: str, out=None, slice_state=None):
    """Takes the run for `job` on the slice, or raises a UsageError naming the live job
    that holds it (a launcher joining that job takes none). Returns what `give_back`
    takes.

    A detached lease of a job on this same slice whose slice is not running (PREEMPTED,
    deleted, being deleted or created again: `slice_state`, gcloud's answer) is taken
    over at once: its hosts' last heartbeats may look fresh for minutes, but no worker
    runs on a slice in that state, and the job it names is gone."""
    store = store_lib.open_store(run)
    lease = job_lease.new(job, host_names(target.tpu), "tpu-vm",
                          stop=f"`actx down --config {config}` (deletes slice "
                               f"{target.tpu.name})", detached=True)
    try:
        return store, job_lease.acquire(store, lease)
    except job_lease.LeaseHeld as e:
        held = e.lease
    state = _dead_slice_state(store, held, target.tpu, slice_state or describe_state)
    if state is not None and job_lease.drop(store, held.job):
        if out is not None:
            print(f"job {held.job} held the run, but its slice {target.tpu.name} is {state}: "
                  f"no worker of it runs; its lease is taken over", file=out, flush=True)
        try:
            return store, job_lease.acquire(store, lease)
        except job_lease.LeaseHeld as e:  # another launcher took it over first
            held = e.lease
    raise targets.UsageError(job_lease.refusal(store.location, held, time.time())) from None


# A slice in these states runs no worker (gcloud's TPU node states; "NOT_FOUND": deleted).
NOT_RUNNING = ("PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING", "CREATING",
               "REPAIRING", "NOT_FOUND")


def _dead_slice_state(store, held: job_lease.JobLease, tpu: config_lib.TpuConfig,
                      slice_state) -> str | None:
    """The state of the slice that `held` (another job's detached tpu-vm lease) runs on,
    when it is this config's slice, its hosts have reported (before that the lease is a
    launch still creating or installing the slice) and the slice runs no worker; else
    None."""
    if not (held.detached and held.target == "tpu-vm" and list(held.hosts) == host_names(tpu)):
        return None
    if not any(hb.job == held.job for hb in job_lease.run_heartbeats(store)):
        return None
    state = slice_state(tpu)
    return state if state in NOT_RUNNING else None


def describe_state(tpu: config_lib.TpuConfig) -> str:
    """The slice's state as gcloud says it ("READY", "PREEMPTED", ...; "NOT_FOUND" when it
    does not exist; "" when gcloud could not say, which takes nothing over)."""
    import subprocess

    argv = ["gcloud", "compute", "tpus", "tpu-vm", "describe", tpu.name, "--zone", tpu.zone,
            "--project", tpu.project, "--format=value(state)"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return ""
    if done.returncode != 0:
        return "NOT_FOUND" if "NOT_FOUND" in done.stderr + done.stdout else ""
    return done.stdout.strip().upper()


def give_back(taken) -> None:
    """The plan failed before the workers started: the run is free again."""
    if taken is not None:
        job_lease.release(*taken)


def release_for_down(run: str | None, tpu: config_lib.TpuConfig, out) -> None:
    """`actx down`: the run's lease goes with the slice when the slice's job holds it."""
    if not run:
        return
    try:
        store = store_lib.open_store(run)
        held = job_lease.read(store)
        if (held is not None and held.detached and held.target == "tpu-vm"
                and list(held.hosts) == host_names(tpu) and job_lease.drop(store, held.job)):
            print(f"released the run's job lease of job {held.job} ({run})", file=out)
    except Exception as e:  # noqa: BLE001 - the slice is gone; the lease then ends by itself
        print(f"note: could not release the job lease of {run}: {e}", file=out)
