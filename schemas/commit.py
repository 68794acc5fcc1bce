"""The commit rule: a partition is done exactly when its marker exists.

A marker is written last, after every byte of the partition is durable, and create-only:
the store refuses a second marker, so a retried or duplicated attempt can never commit a
partition twice. Readers, status and rerun trust markers, never the presence of data.
"""

from __future__ import annotations

import dataclasses

import crc32c as crc32c_lib
import numpy as np

from schemas import config as config_lib
from schemas import layout


def checksum(data: bytes | memoryview) -> str:
    """crc32c of raw little-endian array bytes, as 8 hex digits."""
    return f"{crc32c_lib.crc32c(data):08x}"


def array_checksum(values: np.ndarray) -> str:
    """`checksum` of an array's values in C order, without copying a contiguous array.

    A uint8 view, since bfloat16 arrays do not export the buffer protocol.
    """
    return checksum(np.ascontiguousarray(values).reshape(-1).view(np.uint8))


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    """What was committed for one partition.

    checksums: per array, the crc32c of each row block of `block_rows` rows in row order
      (the block that starts at row_start + k * block_rows is checksums[name][k]); the
      bytes are the array's values, C order, little-endian, in the stored dtype.
    attempt: unique id of the attempt that wrote the data (host, pid, time).
    hosts: hosts of the replica that wrote it.
    timings_s: wall-clock seconds by phase (e.g. "total", "forward", "write").
    """

    partition: int
    fingerprint: str
    row_start: int
    row_count: int
    tokens: int
    block_rows: int
    checksums: dict[str, list[str]]
    dtypes: dict[str, str]
    attempt: str
    hosts: tuple[str, ...]
    timings_s: dict[str, float]
    code_version: str
    created_at: float


def commit(store, marker: CommitMarker) -> bool:
    """Creates the partition's marker. False when a marker already exists (already done)."""
    return store.create_json(layout.commit_key(marker.partition), config_lib.to_dict(marker))


def read_marker(store, partition_id: int) -> CommitMarker | None:
    key = layout.commit_key(partition_id)
    data = store.read_json(key)
    if data is None:
        return None
    return config_lib.from_dict(CommitMarker, data, str(store.location.join(key)))


def committed_partitions(store) -> set[int]:
    """Ids of partitions with a marker (one listing, no reads)."""
    ids = set()
    for key in store.list(layout.COMMITS_PREFIX):
        name = key[len(layout.COMMITS_PREFIX):]
        if name.startswith("p-") and name.endswith(".json"):
            ids.add(int(name[2:-5]))
    return ids
