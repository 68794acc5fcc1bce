"""Every partition's state in a run, as one byte per partition in id order.

Status at pod scale (150k partitions) computes states, counts, the map and the JSON of
`status --json` from this array, never from one Python object per partition. It reads as
the mapping {partition id: state} that callers have always used (`status.partitions`).
"""

from __future__ import annotations

import collections.abc
import itertools
import re

from actx.schemas import layout as layout_lib

COMMITTED, IN_PROGRESS, STALE, PENDING = "committed", "in_progress", "stale", "pending"
STATES = (COMMITTED, IN_PROGRESS, STALE, PENDING)  # a state's code is its index here
MAP_CHARS = {COMMITTED: "C", IN_PROGRESS: "W", STALE: "S", PENDING: "."}
FAILED_CHAR = "F"  # committed, but its data failed the latest `actx verify`
_CODE = {state: i for i, state in enumerate(STATES)}
# codes -> map characters in one bytes.translate (C speed; numpy's import alone would cost
# a fifth of status's budget).
_TO_MAP = bytes.maketrans(bytes(range(len(STATES))),
                          "".join(MAP_CHARS[s] for s in STATES).encode())


class PartitionStates(collections.abc.Mapping):
    """{partition id: state}, backed by the ids (in manifest order) and a code each."""

    __slots__ = ("ids", "codes", "_dense", "_index")

    def __init__(self, ids: list[int], codes: bytearray):
        self.ids = ids
        self.codes = codes
        # Partition ids are 0..n-1 in order in every manifest prepare writes; anything else
        # (a hand-edited manifest) goes through a dict.
        self._dense = ids == list(range(len(ids)))
        self._index: dict[int, int] | None = None

    @classmethod
    def build(cls, ids: list[int], assigned: list[tuple[set[int], str]]) -> "PartitionStates":
        """Every id pending, then each (ids, state) of `assigned` in turn (later ones win);
        ids that are not the run's partitions are ignored."""
        states = cls(ids, bytearray([_CODE[PENDING]]) * len(ids))
        codes = states.codes
        for pids, state in assigned:
            code = _CODE[state]
            for i in states.positions(pids):
                codes[i] = code
        return states

    def positions(self, pids) -> list[int]:
        """Where each of `pids` is, leaving out the ids not here."""
        if self._dense:
            n = len(self.ids)
            return [p for p in pids if 0 <= p < n]
        index = self._lookup()
        return [index[p] for p in pids if p in index]

    def _lookup(self) -> dict[int, int]:
        if self._index is None:
            self._index = {p: i for i, p in enumerate(self.ids)}
        return self._index

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.ids)

    def __contains__(self, pid) -> bool:
        if not isinstance(pid, int) or isinstance(pid, bool):
            return False
        return 0 <= pid < len(self.ids) if self._dense else pid in self._lookup()

    def __getitem__(self, pid) -> str:
        if pid not in self:
            raise KeyError(pid)
        return STATES[self.codes[pid if self._dense else self._lookup()[pid]]]

    def counts(self) -> dict[str, int]:
        return {state: self.codes.count(_CODE[state]) for state in STATES}

    def where(self, state: str) -> list[int]:
        """Positions (in manifest order) of the partitions in `state`."""
        return list(itertools.compress(range(len(self.codes)),
                                       map(_CODE[state].__eq__, self.codes)))

    def ids_in(self, state: str) -> list[int]:
        """The partitions in `state`, in id order."""
        return sorted(self.ids[i] for i in self.where(state))

    def chars(self, failed=()) -> str:
        """One character per partition, in id order: MAP_CHARS, and F for each of `failed`."""
        chars = bytearray(self.codes.translate(_TO_MAP))
        for i in self.positions(failed):
            chars[i] = ord(FAILED_CHAR)
        if not self._dense:
            chars = bytearray(chars[i] for i in self._order())
        return chars.decode("ascii")

    def _order(self) -> list[int]:
        return sorted(range(len(self.ids)), key=self.ids.__getitem__)

    def named(self) -> dict[str, str]:
        """{partition name: state}, in id order (what `status --json` prints)."""
        return dict(self.named_items())

    def named_items(self):
        name = layout_lib.partition_name
        order = range(len(self.ids)) if self._dense else self._order()
        return ((name(self.ids[i]), STATES[self.codes[i]]) for i in order)

    def json_text(self, indent: str) -> str:
        """`named()` as JSON text, one entry a line under `indent` (json.dumps(indent=1)'s
        form). Each run of equal states is formatted by one `%` over its ids: 150k entries
        in ~0.05 s, where the json module's pure-Python encoder took 0.8 s. Partition names
        and state words need no escaping."""
        if not self.ids:
            return "{}"
        if self._dense:
            chunks = []
            for run in _RUNS.finditer(self.codes):
                start, stop = run.span()
                line = f'{indent}"p-%05d": "{STATES[self.codes[start]]}",\n'
                chunks.append((line * (stop - start)) % tuple(range(start, stop)))
            text = "".join(chunks)
        else:
            text = "".join(f'{indent}"{n}": "{s}",\n' for n, s in self.named_items())
        return "{\n" + text[:-2] + "\n" + indent[:-1] + "}"


_RUNS = re.compile(rb"(.)\1*", re.DOTALL)  # runs of one code
