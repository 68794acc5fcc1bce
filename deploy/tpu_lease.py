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
         config: str):
    """Takes the run for `job` on the slice, or raises a UsageError naming the live job
    that holds it (a launcher joining that job takes none). Returns what `give_back`
    takes."""
    store = store_lib.open_store(run)
    lease = job_lease.new(job, host_names(target.tpu), "tpu-vm",
                          stop=f"`actx down --config {config}` (deletes slice "
                               f"{target.tpu.name})", detached=True)
    try:
        return store, job_lease.acquire(store, lease)
    except job_lease.LeaseHeld as e:
        raise targets.UsageError(job_lease.refusal(store.location, e.lease, time.time())) from None


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
