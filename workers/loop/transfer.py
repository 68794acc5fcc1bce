"""Moving a step's arrays between this host and its replica's devices.

Inputs: each host holds its own rows of the replica's batch and builds the global array
from them. Outputs: on a GPU the step leaves them in device memory and a `device_put`
dispatched after it copies them into pinned host memory (`copy_memory_kind`); on a TPU the
step's executable writes them to pinned host memory itself (`output_memory_kind`); on the
CPU device memory is host memory already.
Either way they are then taken apart into this host's rows without a copy. The shardings
come from the step (`ExtractFn`), which takes them from `workers.model.sharding`.

The copies a step's outputs go through: device to (pinned) host memory, once, inside the
executable or asynchronously after it (none on the CPU, where device memory is host
memory); then into the writer's blocks, one bulk copy per run of consecutive rows, and none
where one device shard holds a whole block (`writer.PartitionWriter.add_slots`); the write
to storage reads the block in place.
"""

from __future__ import annotations

import numpy as np


def host_local_pieces(x) -> list[tuple[int, np.ndarray]]:
    """This process's rows of a batch-sharded global array as (row offset, array) pieces,
    one per distinct device shard (replicas over `model` appear once), not copied."""
    shards = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        if start not in shards:
            shards[start] = shard.data
    first = min(shards)
    return [(start - first, np.asarray(data)) for start, data in sorted(shards.items())]


# Where outputs land, a module setting for measurement (bench/extract.py --output-memory):
# "auto" (the rule of `output_memory_kind` and `copy_memory_kind`), "device" (device memory, then an asynchronous copy to host),
# "pinned_host" (the executable writes them to pinned host memory, wherever the backend has
# that kind) or "pinned_copy" (device memory, then an asynchronous device_put into pinned
# host memory: the copy leaves the step's executable but stays a pinned DMA). The bytes
# are the same in every mode.
OUTPUT_MEMORY = "auto"
OUTPUT_MEMORY_MODES = ("auto", "device", "pinned_host", "pinned_copy")


def _has_pinned_host(jax) -> bool:
    try:
        kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
    except Exception:  # backends without memory kinds
        return False
    return "pinned_host" in kinds


def _mode(jax) -> str:
    """OUTPUT_MEMORY, with "auto" resolved for this backend.

    Pinned host memory, not pageable: device-to-host copies from pageable memory ran at
    1.6 GB/s against 51 GB/s into pinned memory on an H200, and end to end ran at 0.43-0.45
    of forward only with "device" against 0.86-0.99 with the pinned modes (H200, issue 49).
    On a GPU, "pinned_copy": its step ran at forward only's speed and its copy overlapped
    the next step, where a step writing its outputs to pinned host itself ran longer
    (end to end 0.878 / 0.985 of forward only with continue / truncate, against 0.859 /
    0.937; H100 and H200 alike). On a TPU, "pinned_host" (not yet measured there against
    the copy). On the CPU jax lists a pinned_host kind too, but it is the same memory as
    the device's: asking for it would add a copy, so neither is used there.
    """
    if OUTPUT_MEMORY not in OUTPUT_MEMORY_MODES:
        raise ValueError(f"transfer.OUTPUT_MEMORY {OUTPUT_MEMORY!r}: one of "
                         f"{', '.join(OUTPUT_MEMORY_MODES)}")
    if OUTPUT_MEMORY != "auto":
        return OUTPUT_MEMORY if _has_pinned_host(jax) or OUTPUT_MEMORY == "device" else "device"
    if not _has_pinned_host(jax):
        return "device"
    platform = jax.local_devices()[0].platform
    return {"cpu": "device", "gpu": "pinned_copy", "cuda": "pinned_copy",
            "rocm": "pinned_copy"}.get(platform, "pinned_host")


def output_memory_kind(jax) -> str | None:
    """Where the step's executable writes its outputs: "pinned_host" in that mode (`_mode`
    says which mode "auto" is here), else None (device memory). `OUTPUT_MEMORY` overrides
    the rule."""
    return "pinned_host" if _mode(jax) == "pinned_host" else None


def copy_memory_kind(jax) -> str | None:
    """Where `HostTransfer.start_to_host` copies outputs the step left in device memory:
    "pinned_host" in the "pinned_copy" mode, else None (an asynchronous copy to host
    memory that jax allocates)."""
    return "pinned_host" if _mode(jax) == "pinned_copy" else None


class HostTransfer:
    """The device↔host moves of one step function, for a replica batch of `batch_size`."""

    def __init__(self, jax, fn, batch_size: int):
        self.jax = jax
        self.fn = fn
        self.batch_size = batch_size
        self.copy_kind = (copy_memory_kind(jax)
                          if getattr(fn, "output_memory_kind", None) is None else None)

    def tokens(self, local_bt: np.ndarray):
        """A [batch, seq] global array from this host's rows."""
        return self.jax.make_array_from_process_local_data(
            self.fn.token_sharding, local_bt, (self.batch_size,) + local_bt.shape[1:])

    def slots(self, local_b: np.ndarray):
        """A [batch] global array (one value per slot) from this host's slots."""
        return self.jax.make_array_from_process_local_data(
            self.fn.slot_sharding, local_b, (self.batch_size,))

    def start_to_host(self, outs: dict) -> dict:
        """Starts the copy of every output to host memory, unless the step writes them
        there itself; the copy overlaps the next steps. Returns the arrays to read: the
        outputs themselves, or their copies in pinned host memory ("pinned_copy")."""
        if getattr(self.fn, "output_memory_kind", None) is not None:
            return outs
        if self.copy_kind is not None:
            # Dispatched after the step; the device arrays are freed once copied.
            return {name: self.jax.device_put(x, x.sharding.with_memory_kind(self.copy_kind))
                    for name, x in outs.items()}
        for x in outs.values():
            x.copy_to_host_async()
        return outs
