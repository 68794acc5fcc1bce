"""The commit rule: a partition is done exactly when its marker exists.

A marker is written last, after every byte of the partition is durable, and create-only:
the store refuses a second marker, so a retried or duplicated attempt can never commit a
partition twice. Readers, status and rerun trust markers, never the presence of data.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Callable

from actx.schemas import activations_info as info_lib
from actx.schemas import config as config_lib
from actx.schemas import layout

if TYPE_CHECKING:
    import numpy as np  # imported where used: status reads markers' names, never their data


# The token arrays the model reads (a step's inputs), whose rows a marker checksums
# (CommitMarker.token_checksums).
MODEL_INPUTS = ("input_ids", "positions", "segment_ids")


def checksum(data: bytes | memoryview) -> str:
    """crc32c of raw little-endian array bytes, as 8 hex digits."""
    import crc32c as crc32c_lib

    return f"{crc32c_lib.crc32c(data):08x}"


def array_checksum(values: np.ndarray) -> str:
    """`checksum` of an array's values in C order, without copying a contiguous array.

    A uint8 view, since bfloat16 arrays do not export the buffer protocol.
    """
    import numpy as np

    return checksum(np.ascontiguousarray(values).reshape(-1).view(np.uint8))


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    """What was committed for one partition.

    checksums: per array, the crc32c of each row block of `block_rows` rows in row order
      (the block that starts at row_start + k * block_rows is checksums[name][k]); the
      bytes are the array's values, C order, little-endian, in the stored dtype.
    token_checksums: per token array the model read (input_ids, positions, segment_ids),
      the crc32c of each block's rows as the worker read them, laid out as `checksums`
      (the token store's dtype, C order): what the activations were computed on, which
      verify compares with the token store and a prepare of the run again with its
      inputs. None in markers an earlier worker wrote (nothing to compare).
    attempt: unique id of the attempt that wrote the data (host, pid, time).
    hosts: hosts of the replica that wrote it.
    timings_s: wall-clock seconds by phase (e.g. "total", "forward", "write").
    model_digest / numerics: the checkpoint digest and the numerics of the attempt that
      computed the data, as activations/actx.json records them for the run's first attempt
      (schemas.activations_info): verify holds each partition to the record, and a record
      lost or damaged is rebuilt with them. None in markers an earlier worker wrote (before
      0.3.0).
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
    token_checksums: dict[str, list[str]] | None = None
    model_digest: str | None = None
    numerics: info_lib.Numerics | None = None


# Parallel listing: at most MAX_RANGES key ranges of at least LIST_RANGE markers (one
# GCS page; schemas.absent_shards lists shard objects alike). Real GCS answers a range in time of its size; an emulator that scans every
# object per request (fake-gcs-server) pays per request, so ranges stay few.
LIST_RANGE = 1000
MAX_RANGES = 16


def commit(store, marker: CommitMarker) -> bool:
    """Creates the partition's marker. False when a marker already exists (already done).
    Then, the marker standing either way, the temporary files an earlier attempt killed
    while writing it left beside it go (on local disk; never read, see store.list)."""
    key = layout.commit_key(marker.partition)
    created = store.create_json(key, config_lib.to_dict(marker))
    store.clear_temporaries(key)
    return created


def read_marker(store, partition_id: int) -> CommitMarker | None:
    key = layout.commit_key(partition_id)
    data = store.read_json(key)
    if data is None:
        return None
    return config_lib.from_dict(CommitMarker, data, str(store.location.join(key)))


def readable_markers(store, partitions):
    """The markers of `partitions`, in order, those that read (one damaged or gone since
    a listing is passed over: verify says so of its partition)."""
    for partition in partitions:
        try:
            marker = read_marker(store, partition)
        except ValueError:
            continue
        if marker is not None:
            yield marker


def committed_partitions(store, n_partitions: int = 0) -> set[int]:
    """Ids of partitions with a marker (a listing of names, no reads).

    Given the run's partition count, a store that lists in pages of 1,000 names (GCS)
    lists up to 16 key ranges in parallel instead of one page after another.
    """
    ranges = min(MAX_RANGES, -(-n_partitions // LIST_RANGE))
    if store.PARALLEL_LISTING and ranges > 1:
        listed = store.list_split(layout.COMMITS_PREFIX, range_boundaries(n_partitions, ranges))
        names = [key[len(layout.COMMITS_PREFIX):] for key in listed]
    else:
        names = store.list_names(layout.COMMITS_PREFIX)
    # One regex over all names, ints made by map: 90k markers in a few ms.
    return set(map(int, _MARKER_NAME.findall("\n".join(names))))


def committed_stamps(store) -> dict[int, int]:
    """Partition id -> its marker's version, from one listing: a GCS generation, which GCS
    sets from its own clock when the object is created, or a local file's modification
    time (ns); 0 where the store's versions are no times (memory://). What orders the
    partitions by when they committed, the same for every reader of the run whatever
    its own clock or when it listed (reader.streaming.follow)."""
    stamps = {}
    for key, (_, version) in store.list_stamps(layout.COMMITS_PREFIX).items():
        found = _MARKER_NAME.match(key[len(layout.COMMITS_PREFIX):])
        if found:
            stamps[int(found.group(1))] = int(version) if version.isdigit() else 0
    return stamps


def committed_in_order(store) -> list[int]:
    """Ids of partitions with a marker, in the order they committed (`committed_stamps`,
    partition id breaking ties), from one listing."""
    stamps = committed_stamps(store)
    return sorted(stamps, key=lambda p: (stamps[p], p))


def range_boundaries(n_partitions: int, ranges: int,
                     key: Callable[[int], str] = layout.commit_key) -> list[str]:
    """`ranges - 1` keys that cut the sorted keys of objects 0..n-1 (`key`: a partition's
    marker, or a hook's shard object, schemas.absent_shards) into `ranges` parts of about
    equal size. Keys sort as strings ("p-100000.json" between "p-10000.json" and
    "p-10001.json"), so the cuts are quantiles of a sorted sample of at most 4,096 keys:
    making and sorting all 150k keys cost status 0.1 s on GCS. Any sorted cuts list every
    object; the sample only keeps the ranges even."""
    every = max(1, n_partitions // 4096)
    sample = sorted(key(p) for p in range(0, n_partitions, every))
    return sorted({sample[len(sample) * j // ranges] for j in range(1, ranges)})


_MARKER_NAME = re.compile(r"^p-(\d+)\.json$", re.MULTILINE)  # layout.commit_key
