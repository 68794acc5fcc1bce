"""A committed partition's activation shards that are not stored: zeros the worker wrote,
or data that is gone.

The store keeps a block of zeros (an activation array's fill value) as no object at all,
so a shard object of a committed partition may be absent with nothing lost: a hook that
outputs zeros for those tokens, and in a generating run rows of padding and room its
samples did not reach (the worker writes zeros there). Any other absent object is data
that is gone, and every read returns zeros in its place: a plausible, wrong activation.
The commit marker's block checksums tell the two apart. `actx verify` (deploy/verify.py)
and the reader (reader/shard_presence.py) apply this one rule.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actx.schemas import commit as commit_lib
from actx.schemas import layout as layout_lib


def shard_indices(row_start: int, row_stop: int, rows_per_shard: int) -> range:
    """The shard objects (layout.activation_shard_key) that hold rows [row_start, row_stop)."""
    return range(row_start // rows_per_shard, -(-row_stop // rows_per_shard))


def stored_shards(store, array: str, n_shards: int) -> set[int]:
    """Shard indices of an activation array's stored objects (layout.activation_shard_key;
    `n_shards`: the array's count): one listing of its prefix, in key ranges at once where
    the store lists in pages of 1,000 names (GCS), as the commit markers are
    (commit.committed_partitions); on local disk, a look at each object
    (ObjectStore.existing)."""
    keys = [layout_lib.activation_shard_key(array, i) for i in range(n_shards)]
    ranges = min(commit_lib.MAX_RANGES, -(-n_shards // commit_lib.LIST_RANGE))
    boundaries = (commit_lib.range_boundaries(
        n_shards, ranges, key=lambda i: layout_lib.activation_shard_key(array, i))
        if store.PARALLEL_LISTING and ranges > 1 else [])
    found = store.existing(layout_lib.activation_shard_prefix(array), keys, boundaries)
    return {i for i, key in enumerate(keys) if key in found}


def row_nbytes(array) -> int:
    """Bytes of one row of a [rows, seq_len, hidden] tensorstore array."""
    return array.dtype.numpy_dtype.itemsize * int(np.prod(array.shape[1:]))


def zeros_checksum(rows: int, row_nbytes: int) -> str:
    """The checksum the writer computes for `rows` rows of zeros, `row_nbytes` bytes each
    (a block the store then keeps as no object)."""
    return commit_lib.checksum(bytes(rows * row_nbytes))


def unreached_rows(generated_ids: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per row of a generating run's rows (`generated_ids`: their generated.token_ids
    [rows, seq_len]; `valid`: segment_ids > 0): whether the row holds no token the model
    computed, only padding and room its samples did not reach."""
    return np.all(~valid | (generated_ids == layout_lib.GENERATED_UNUSED), axis=1)


@dataclasses.dataclass(frozen=True)
class LostBlock:
    """A block of a committed partition whose values are gone: `shards` are the absent
    objects among those holding its rows [row_start, row_stop)."""

    block: int
    row_start: int
    row_stop: int
    shards: tuple[int, ...]


def is_lost(array: str, checksum: str, rows: int, row_nbytes: int,
            unreached: np.ndarray | None = None) -> bool:
    """Whether a block of `array` with an absent object held data that is now gone: its
    marker `checksum` is not that of zeros and (in a generating run, `unreached`: the
    block's rows, unreached_rows) it holds a token the model computed. A generating run's
    ids are not exempt: unreached positions hold GENERATED_UNUSED there, not zeros."""
    if array != layout_lib.GENERATED_IDS and unreached is not None and unreached.all():
        return False
    return checksum != zeros_checksum(rows, row_nbytes)


def lost_blocks(marker: commit_lib.CommitMarker, array: str, present: set[int],
                rows_per_shard: int, row_nbytes: int,
                unreached: np.ndarray | None = None) -> list[LostBlock]:
    """The blocks of a committed partition's `array` whose values are gone: some object
    holding their rows is not among `present` (the array's stored shard indices) and
    `is_lost`. `unreached`: per row of the partition (unreached_rows), in a generating run."""
    lost = []
    sums = marker.checksums[array]
    for k, checksum in enumerate(sums):
        lo = marker.row_start + k * marker.block_rows
        hi = min(marker.row_start + marker.row_count, lo + marker.block_rows)
        absent = tuple(s for s in shard_indices(lo, hi, rows_per_shard) if s not in present)
        block_unreached = (None if unreached is None else
                           unreached[lo - marker.row_start:hi - marker.row_start])
        if absent and is_lost(array, checksum, hi - lo, row_nbytes, block_unreached):
            lost.append(LostBlock(k, lo, hi, absent))
    return lost
