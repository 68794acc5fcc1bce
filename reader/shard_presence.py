"""Whether a committed partition's activations are still stored: the reader refuses the
rows of one whose shard objects are gone, rather than return zeros for them.

Every read of an absent shard object returns the array's fill value (zeros), the same as
a block the worker wrote as zeros, which the store keeps as no object at all
(schemas.absent_shards tells the two apart by the commit marker's checksums). So each
array a reader reads has its objects looked at once, at the first read that names it (a
listing on GCS, a stat each on local disk: schemas.absent_shards.stored_shards; arrays
never read cost nothing), and every committed partition it reads is checked against that;
only a partition with an absent object costs a read of its marker. Where a partition was
seen committed after the listing was taken (a reader following a live run), its objects
absent from the listing are looked for again (one by one, or in a new listing where they
are more than its pages): a worker writes every object before its marker, so a look
after the marker was seen finds them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable, Sequence

import numpy as np

from actx.reader import errors
from actx.schemas import absent_shards
from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import errors as schemas_errors
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import uri as uri_lib


@dataclasses.dataclass(frozen=True)
class Loss:
    """Why the rows of a committed partition cannot be read from one of its arrays."""

    partition: int
    array: str
    reason: str


class ShardPresence:
    """Which committed partitions' arrays lack stored objects that held data (see the
    module's docstring). `observe` each snapshot of the committed partitions; `check`
    before reading rows."""

    def __init__(self, store, location: uri_lib.Location, rows_per_shard: int,
                 total_rows: int):
        self._store = store
        self._location = location
        self._rows_per_shard = rows_per_shard
        self._n_shards = -(-total_rows // rows_per_shard)
        self._snapshot = 0  # counts `observe` calls
        self._seen_in: dict[int, int] = {}  # partition -> the snapshot that first held it
        self._listed: dict[str, tuple[int, set[int]]] = {}  # array -> (snapshot, shards)
        self._intact: dict[str, set[int]] = {}  # array -> partitions checked and whole
        self._lost: dict[tuple[str, int], Loss] = {}

    def observe(self, committed: Sequence[int]) -> None:
        """A new snapshot of the committed partitions (the reader's listing)."""
        self._snapshot += 1
        for pid in committed:
            self._seen_in.setdefault(pid, self._snapshot)

    def check(self, arrays: Sequence[str], parts: Sequence[manifest_lib.Partition],
              row_nbytes: Callable[[str], int],
              unreached: Callable[[manifest_lib.Partition], np.ndarray | None]) -> None:
        """Raises LostDataError naming every partition of `parts` (committed) whose rows of
        an array of `arrays` would read as zeros where its worker wrote other values.
        `row_nbytes(array)`: bytes of one of its rows; `unreached(part)`: in a generating
        run, schemas.absent_shards.unreached_rows of the partition's rows (else None)."""
        losses = []
        unlisted = [a for a in arrays if a not in self._listed]
        if len(unlisted) > 1 and self._store.PARALLEL_LISTING:
            # Round trips (GCS): the arrays' listings at once, as their ranges are.
            with concurrent.futures.ThreadPoolExecutor(min(4, len(unlisted))) as pool:
                list(pool.map(self._list, unlisted))
        for array in arrays:
            intact = self._intact.setdefault(array, set())
            todo = [p for p in parts if p.id not in intact]
            if not todo:
                continue
            suspects = self._suspects(array, todo)
            for part in todo:
                if part.id not in suspects:
                    intact.add(part.id)
                    continue
                loss = self._lost.get((array, part.id))
                if loss is None:
                    loss = self._judge(array, part, suspects[part.id], row_nbytes(array),
                                       unreached)
                if loss is None:
                    intact.add(part.id)
                else:
                    self._lost[(array, part.id)] = loss
                    losses.append(loss)
        if losses:
            raise errors.LostDataError(self._message(losses))

    def _suspects(self, array: str, parts: Sequence[manifest_lib.Partition]
                  ) -> dict[int, tuple[int, ...]]:
        """Partition -> its shard indices absent from the array's listing. Where a
        partition was seen committed after the listing was taken, its absent objects are
        looked for again: one by one where they are fewer than the listing's pages (a
        follower's new partitions), else in a new listing."""
        listed = self._listed.get(array) or self._list(array)
        taken, present = listed
        suspects = self._absent(parts, present)
        late = sorted({s for pid, absent in suspects.items()
                       if self._seen_in.get(pid, 0) > taken for s in absent})
        if not late:
            return suspects
        if len(late) <= -(-self._n_shards // commit_lib.LIST_RANGE):  # pages
            # size: the object's metadata alone (exists may read a whole shard).
            present.update(s for s in late if self._store.size(
                layout.activation_shard_key(array, s)) is not None)
        else:
            _, present = self._list(array)
        return self._absent(parts, present)

    def _list(self, array: str) -> tuple[int, set[int]]:
        listed = (self._snapshot, absent_shards.stored_shards(self._store, array,
                                                              self._n_shards))
        self._listed[array] = listed
        return listed

    def _absent(self, parts: Sequence[manifest_lib.Partition], present: set[int]
                ) -> dict[int, tuple[int, ...]]:
        suspects = {}
        for part in parts:
            absent = tuple(s for s in absent_shards.shard_indices(
                part.row_start, part.row_stop, self._rows_per_shard) if s not in present)
            if absent:
                suspects[part.id] = absent
        return suspects

    def _judge(self, array: str, part: manifest_lib.Partition, absent: tuple[int, ...],
               row_nbytes: int, unreached) -> Loss | None:
        where = f"partition {part.name} (rows {part.row_start}-{part.row_stop - 1})"
        objects = ", ".join(layout.activation_shard_key(array, s) for s in absent[:3])
        objects += f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        try:
            marker = commit_lib.read_marker(self._store, part.id)
        except ValueError as e:  # damaged: whether the data was zeros cannot be told
            return Loss(part.id, array, f"{where}: {objects} not stored, and its commit "
                                        f"marker cannot be read ({schemas_errors.first_line(e)})")
        if marker is None:
            return Loss(part.id, array, f"{where}: {objects} not stored, and its commit "
                                        f"marker is gone since the run was opened")
        if array not in marker.checksums:
            return Loss(part.id, array, f"{where}: {objects} not stored, and its commit "
                                        f"marker has no checksums of {array}")
        present = set(absent_shards.shard_indices(part.row_start, part.row_stop,
                                                  self._rows_per_shard)) - set(absent)
        lost = absent_shards.lost_blocks(marker, array, present, self._rows_per_shard,
                                         row_nbytes, unreached(part))
        if not lost:
            return None
        rows = ", ".join(f"{b.row_start}-{b.row_stop - 1}" for b in lost[:3])
        rows += f" and {len(lost) - 3} more blocks" if len(lost) > 3 else ""
        return Loss(part.id, array, f"{where}: {objects} not stored, though its commit "
                                    f"marker's checksums of rows {rows} are not those of "
                                    f"zeros")

    def _message(self, losses: list[Loss]) -> str:
        parts = sorted({loss.partition for loss in losses})
        names = ", ".join(layout.partition_name(p) for p in parts[:10])
        names += f" and {len(parts) - 10} more" if len(parts) > 10 else ""
        first = losses[0]
        return (f"{self._location}: {len(parts)} committed partition(s) ({names}) have lost "
                f"activations that a read would return as zeros; array {first.array}, "
                f"{first.reason}. `{advice.repair(self._location)}` turns them back into "
                f"pending, then `{advice.rerun(self._location)}` extracts them again")
