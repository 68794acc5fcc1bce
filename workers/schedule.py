"""Which partitions a replica extracts, and how a host walks its rows in fixed-shape steps.

Pure Python (no JAX): replicas never talk to each other, so the assignment is a function
of the manifest, the commit markers and the replica's index. Within a multi-host replica
every host must run the same number of steps, so short slices are padded with masked rows.
"""

from __future__ import annotations

import dataclasses
import time

from schemas import layout
from schemas import manifest as manifest_lib

CLAIMS_PREFIX = "claims/"


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits: replica `replica` of `replicas`, host `host_index` of the
    replica's `hosts_per_replica` hosts."""

    replicas: int = 1
    replica: int = 0
    hosts_per_replica: int = 1
    host_index: int = 0

    def __post_init__(self):
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"replica index {self.replica} is outside 0..{self.replicas - 1}")
        if not 0 <= self.host_index < self.hosts_per_replica:
            raise ValueError(
                f"host index {self.host_index} is outside 0..{self.hosts_per_replica - 1}")


def own_partitions(manifest: manifest_lib.Manifest, topo: Topology) -> list[int]:
    """Partition p belongs to replica p mod R."""
    return [p.id for p in manifest.partitions if p.id % topo.replicas == topo.replica]


def steal_order(manifest: manifest_lib.Manifest, topo: Topology) -> list[int]:
    """Other replicas' partitions, latest first (their owners start from the front)."""
    others = [p.id for p in manifest.partitions if p.id % topo.replicas != topo.replica]
    return sorted(others, key=lambda pid: (-(pid // topo.replicas), pid))


def claim_key(job: str, partition_id: int) -> str:
    return f"{CLAIMS_PREFIX}{job}/{layout.partition_name(partition_id)}.json"


def try_claim(store, job: str, partition_id: int, attempt: str) -> bool:
    """Create-only claim of a partition within one job; False if another attempt has it.

    Claims only steer work sharing inside a job (a rerun is a new job); correctness never
    depends on them, since the commit marker is create-only and the bytes deterministic.
    """
    key = claim_key(job, partition_id)
    if store.create_json(key, {"attempt": attempt, "at": time.time()}):
        return True
    existing = store.read_json(key) or {}
    return existing.get("attempt") == attempt


@dataclasses.dataclass(frozen=True)
class Step:
    """One fixed-shape step of one host: `rows` of the local batch, in order.

    rows: global row numbers fed to the batch (len == local batch); rows past the host's
      slice are padding rows that are computed but never written.
    valid: how many leading entries of `rows` are real rows of the slice.
    """

    rows: tuple[int, ...]
    valid: int


def plan_steps(partition: manifest_lib.Partition, topo: Topology, rows_per_shard: int,
               local_batch: int) -> list[Step]:
    """This host's steps for a partition; equal in count on every host of the replica."""
    slices = layout.host_row_slices(partition.row_start, partition.row_count,
                                    topo.hosts_per_replica, rows_per_shard)
    longest = max(hi - lo for lo, hi in slices)
    n_steps = -(-longest // local_batch)
    lo, hi = slices[topo.host_index]
    steps = []
    for s in range(n_steps):
        start = lo + s * local_batch
        real = list(range(start, min(hi, start + local_batch)))
        # Padding rows repeat a real row of the slice (or the partition's first row) so the
        # step reads valid tokens and never indexes past the array.
        filler = real[0] if real else partition.row_start
        rows = real + [filler] * (local_batch - len(real))
        steps.append(Step(tuple(rows), len(real)))
    return steps


def host_slice(partition: manifest_lib.Partition, topo: Topology,
               rows_per_shard: int) -> tuple[int, int]:
    return layout.host_row_slices(partition.row_start, partition.row_count,
                                  topo.hosts_per_replica, rows_per_shard)[topo.host_index]
