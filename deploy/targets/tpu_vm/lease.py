"""The job lease of a tpu-vm launch: deploy/detached/lease.py on the slice's hosts, taken
over from a job whose slice runs no worker (preempted, deleted, created again)."""

from __future__ import annotations

from actx.deploy import config as config_lib
from actx.deploy.detached import lease as detached_lease
from actx.deploy.targets.tpu_vm import plan as tpu_vm
from actx.schemas import advice
from actx.schemas import run_dir

KIND = "tpu-vm"


def host_names(tpu: config_lib.TpuConfig) -> list[str]:
    """The slice's hosts as its workers name themselves (tpu_vm.host_name_expr)."""
    return [f"{tpu.name}-w{i}" for i in range(tpu_vm.slice_hosts(tpu))]


def take(run: "str | run_dir.RunDir", target: config_lib.TargetConfig, job: str,
         config: str, out=None, slice_state=None):
    """Takes the run for `job` on the slice, or raises a UsageError naming the live job
    that holds it (a launcher joining that job takes none). Returns what `give_back`
    takes.

    A detached lease of a job on this same slice whose slice is not running (PREEMPTED,
    deleted, being deleted or created again: `slice_state`, gcloud's answer) is taken
    over at once: its hosts' last heartbeats may look fresh for minutes, but no worker
    runs on a slice in that state, and the job it names is gone."""
    tpu = target.tpu
    state_of = slice_state or describe_state

    def gone(held) -> str | None:
        state = state_of(tpu)
        return f"its slice {tpu.name} is {state}" if state in NOT_RUNNING else None

    return detached_lease.take(run, KIND, host_names(tpu), job,
                               stop=f"`{advice.down(config)}` (deletes slice "
                                    f"{tpu.name})", out=out, gone=gone)


# A slice in these states runs no worker (gcloud's TPU node states; "NOT_FOUND": deleted).
NOT_RUNNING = ("PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING", "CREATING",
               "REPAIRING", "NOT_FOUND")


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
    detached_lease.give_back(taken)


def release_for_down(run: str | None, tpu: config_lib.TpuConfig, out) -> None:
    """`actx down`: the run's lease goes with the slice when the slice's job holds it."""
    detached_lease.release(run, KIND, host_names(tpu), out)
