"""How a replica's batch and model spread over its hosts and devices: the rules, once.

The submit config (deploy.config), the targets' checks (deploy.targets.tpu_vm.plan,
deploy.preflight), the workers' pre-flight (workers.preflight, workers.flax.preflight) and
the worker itself (workers.loop.runner) all ask these functions, so a job is refused for the
same reason, in the same words, wherever it is first seen.

- The model axis (model_parallel, tensor parallelism) stays within one host and divides
  its devices: the hosts of a replica split the batch between them, not the model.
- The model axis splits the attention heads: model_parallel divides the model's heads
  (a model axis that does not leaves every device all of them: no tensor parallelism).
- A replica's batch (batch_size rows per step) splits evenly over its hosts, and over its
  data-parallel devices (its devices over the model axis): a batch that did not would
  have some device redo rows, or a host step on a ragged share.
"""

from __future__ import annotations


def data_parallel(devices: int, model_parallel: int) -> int | None:
    """Devices a replica of `devices` splits its batch over (None: the model axis does
    not divide them)."""
    return devices // model_parallel if model_parallel >= 1 and devices % model_parallel == 0 \
        else None


def model_parallel_problem(model_parallel: int, devices_per_host: int) -> str:
    """"" when the model axis fits one host, else why, beginning with model_parallel's
    value (callers put the field's name before it)."""
    if model_parallel > devices_per_host:
        return (f"{model_parallel} is more than the {devices_per_host} device(s) of a host; "
                f"the hosts of a replica split the batch, so the model axis stays within "
                f"one host")
    if devices_per_host % model_parallel:
        return f"{model_parallel} does not divide the {devices_per_host} devices of a host"
    return ""


def heads_problem(num_heads: int, model_parallel: int) -> str:
    """"" when the model axis splits the model's attention heads evenly, else why (begins
    with model_parallel's value)."""
    if model_parallel > 1 and num_heads % model_parallel:
        return (f"{model_parallel} does not divide the model's {num_heads} attention heads; "
                f"choose a divisor of {num_heads}")
    return ""


def heads_per_device(num_heads: int, model_parallel: int) -> int:
    """Attention heads one device computes (all of them where the model axis does not
    divide them)."""
    return num_heads // model_parallel if not heads_problem(num_heads, model_parallel) \
        else num_heads


def hosts_problem(batch_size: int, hosts_per_replica: int) -> str:
    """"" when a replica's batch splits evenly over its hosts, else why (begins with the
    batch size)."""
    if batch_size % hosts_per_replica:
        return (f"{batch_size} rows per step do not split evenly over the "
                f"{hosts_per_replica} hosts of a replica; use a multiple of "
                f"{hosts_per_replica}")
    return ""


def devices_problem(batch_size: int, data_parallel_devices: int | None, *,
                    lead: str | None = None, group: str = "replica",
                    detail: str = "") -> str:
    """"" when a replica's batch splits over its data-parallel devices (or their number
    is not known), else why: "<lead> split over the <group>'s N data-parallel devices
    (<detail>); use a multiple of N". lead: the words before "split" (default
    "<batch_size> rows per step do not")."""
    n = data_parallel_devices
    if not n or batch_size % n == 0:
        return ""
    lead = f"{batch_size} rows per step do not" if lead is None else lead
    detail = f" ({detail})" if detail else ""
    return (f"{lead} split over the {group}'s {n} data-parallel devices{detail}; "
            f"use a multiple of {n}")
