"""The run plan: the global steps of prepare, over per-file and per-group summaries only.

Nothing here sees a document. Small global computations fix the run-wide layout:
  file_limits  per-unit record counts -> per-unit read limits that apply each source's
               `max_docs` in file order (one record per work unit);
  build_plan   pack-group summaries (`pack_group.GroupSummary`, one per group) -> each
               group's first run-wide row and doc_index (prefix sums in group order), the
               total rows, the sorted ARC task table and per-source counts;
  place_units  unit layouts (one per unit) -> each unit's run-wide rows, so a partition
               writer knows which units' stored tokens to read.
Partitions are then pure arithmetic on row numbers (fixed `partition_rows`, the last may
be short). Every result is a pure function of the summaries and the run spec, so whatever
the runner's parallelism, or the size of the work units, a document gets the same index,
rows and partition.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Iterable

from actx.pipeline import pack
from actx.pipeline import pack_group
from actx.schemas import manifest as manifest_lib
from actx.schemas import runspec as runspec_lib


def file_limits(spec: runspec_lib.RunSpec, unit_records: Iterable[tuple[tuple, int]]
                ) -> dict[tuple, int]:
    """(source_index, path, first line) -> records to read, for the work units of sources
    with max_docs.

    unit_records: (unit key, records the unit holds). The first max_docs records of a
    source in (path, line) order are kept: units are taken in that order, each up to what
    the units before it left over.
    """
    left = {s: src.max_docs for s, src in enumerate(spec.sources) if src.max_docs is not None}
    limits = {}
    for key, n in sorted(unit_records):
        s = key[0]
        if s not in left:
            raise ValueError(f"source {s} has no max_docs: its units need no count")
        limits[key] = min(n, left[s])
        left[s] -= limits[key]
    return limits


@dataclasses.dataclass(frozen=True)
class GroupPlacement:
    """Where a group's rows and documents go: add first_row / first_doc to its local
    numbers; task_map[i] is the run-wide index of the group's i-th task id."""

    first_row: int
    first_doc: int
    task_map: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The global layout. One entry per pack group; nothing per document or partition.

    accepted / truncated_tokens: per source index; source_names: per source index.
    """

    groups: dict
    total_rows: int
    total_docs: int
    total_tokens: int
    partition_rows: int
    arc_tasks: tuple[str, ...]
    accepted: tuple[int, ...]
    truncated_tokens: tuple[int, ...]
    source_names: tuple[str, ...]

    @property
    def n_partitions(self) -> int:
        return -(-self.total_rows // self.partition_rows)

    def partition_of_row(self, row: int) -> int:
        return row // self.partition_rows

    def partition_range(self, partition_id: int) -> tuple[int, int]:
        """(row_start, row_count) of a partition."""
        start = partition_id * self.partition_rows
        return start, min(self.partition_rows, self.total_rows - start)


def build_plan(spec: runspec_lib.RunSpec, summaries: Iterable[pack_group.GroupSummary]
               ) -> RunPlan:
    """Prefix sums over the group summaries in group-key order (= document order)."""
    summaries = sorted(summaries, key=lambda g: g.key)
    if any(a.key == b.key for a, b in zip(summaries, summaries[1:])):
        raise ValueError("duplicate pack group: an input file was read twice")
    arc_tasks = tuple(sorted({t for g in summaries for t in g.task_ids}))
    task_index = {t: i for i, t in enumerate(arc_tasks)}
    n_sources = len(spec.sources)
    accepted, truncated = [0] * n_sources, [0] * n_sources
    groups, row, doc, tokens = {}, 0, 0, 0
    for g in summaries:
        groups[g.key] = GroupPlacement(row, doc, tuple(task_index[t] for t in g.task_ids))
        row, doc, tokens = row + g.rows, doc + g.docs, tokens + g.tokens
        accepted[g.source_index] += g.records
        truncated[g.source_index] += g.truncated_tokens
    return RunPlan(groups, row, doc, tokens, spec.layout.partition_rows, arc_tasks,
                   tuple(accepted), tuple(truncated),
                   tuple(spec.source_name(s) for s in range(n_sources)))


@dataclasses.dataclass(frozen=True)
class UnitPlacement:
    """A unit's documents, run-wide: its pieces are `pack.plan_pack(lengths, start=start,
    last=last)` in group-local rows, shifted by group_first_row; first_doc is the run-wide
    doc_index of its first document; [row_start, row_stop) the run-wide rows it fills."""

    unit_id: str
    source_index: int
    group_first_row: int
    first_doc: int
    docs: int
    start: pack.PackState
    last: bool
    row_start: int
    row_stop: int


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """What the partition writers need: the run plan and every unit with documents, in
    row order (one small entry per unit, never per document)."""

    run: RunPlan
    units: tuple[UnitPlacement, ...]

    def units_in_rows(self, start: int, stop: int) -> list[UnitPlacement]:
        """The units with a piece in rows [start, stop), in order."""
        lo = bisect.bisect_right(self._row_stops, start)
        hi = bisect.bisect_left(self._row_starts, stop)
        return list(self.units[lo:hi])

    @functools.cached_property
    def _row_starts(self) -> list[int]:
        return [u.row_start for u in self.units]

    @functools.cached_property
    def _row_stops(self) -> list[int]:
        return [u.row_stop for u in self.units]

    def write_tasks(self) -> list[tuple[str, tuple[int, ...]]]:
        """(unit id, partitions): each partition goes to the first unit holding its first
        row, so a writer mostly reads the unit it is named after."""
        tasks: dict[str, list[int]] = {}
        for pid in range(self.run.n_partitions):
            row, _ = self.run.partition_range(pid)
            owner = self.units[bisect.bisect_right(self._row_stops, row)]
            tasks.setdefault(owner.unit_id, []).append(pid)
        return [(unit_id, tuple(pids)) for unit_id, pids in tasks.items()]


def place_units(plan: RunPlan, layouts: Iterable[pack_group.UnitLayout]) -> WritePlan:
    """Run-wide rows and doc numbers of every unit layout (`pack_group.plan_group`)."""
    units = []
    for u in layouts:
        at = plan.groups[u.group]
        units.append(UnitPlacement(u.unit_id, u.source_index, at.first_row,
                                   at.first_doc + u.first_doc, u.docs, u.start, u.last,
                                   at.first_row + u.row_start, at.first_row + u.row_stop))
    units.sort(key=lambda u: u.first_doc)
    if sum(u.docs for u in units) != plan.total_docs:
        raise RuntimeError(f"unit layouts hold {sum(u.docs for u in units)} documents, the "
                           f"plan {plan.total_docs}")
    return WritePlan(plan, tuple(units))


def source_counts(plan: RunPlan, reject_stats: Iterable[dict]
                  ) -> dict[str, manifest_lib.SourceCounts]:
    """Input accounting per source: read = accepted + rejected (rejects within max_docs)."""
    reject_stats = list(reject_stats)
    rejected = {s["source"]: s["rejected"] for s in reject_stats}
    reasons = {s["source"]: dict(s.get("reasons") or {}) for s in reject_stats}
    return {name: manifest_lib.SourceCounts(
        read=plan.accepted[s] + rejected.get(name, 0), accepted=plan.accepted[s],
        rejected=rejected.get(name, 0), truncated_tokens=plan.truncated_tokens[s],
        reasons=reasons.get(name, {}))
        for s, name in enumerate(plan.source_names)}


def partitions(plan: RunPlan, written: Iterable[dict]) -> tuple[manifest_lib.Partition, ...]:
    """The manifest's partitions from the writers' stats, checked against the plan.

    Token and doc counts per partition are measured by the writer that filled it (the plan
    knows only per-group totals); they must add up to the plan's totals, and every
    partition must have been written exactly once with its full row range.
    """
    by_id: dict[int, dict] = {}
    for w in written:
        if w["partition"] in by_id:
            raise RuntimeError(f"partition {w['partition']} written twice")
        by_id[w["partition"]] = w
    if set(by_id) != set(range(plan.n_partitions)):
        missing = sorted(set(range(plan.n_partitions)) - set(by_id))
        raise RuntimeError(f"partitions not written: {missing[:10]} (of {plan.n_partitions}); "
                           f"unexpected: {sorted(set(by_id) - set(range(plan.n_partitions)))}")
    out = []
    for pid in range(plan.n_partitions):
        start, count = plan.partition_range(pid)
        w = by_id[pid]
        if w["rows"] != count:
            raise RuntimeError(f"partition {pid}: {w['rows']} rows written, plan has {count}")
        out.append(manifest_lib.Partition(pid, start, count, w["tokens"], w["docs"],
                                          w["full_context_tokens"],
                                          w.get("longest_doc_rows", 0),
                                          w.get("continued_doc_rows", 0),
                                          w.get("continued_from_rows", 0)))
    tokens, docs = sum(p.tokens for p in out), sum(p.docs for p in out)
    if (tokens, docs) != (plan.total_tokens, plan.total_docs):
        raise RuntimeError(f"written {tokens} tokens / {docs} docs, the plan has "
                           f"{plan.total_tokens} / {plan.total_docs}")
    return tuple(out)
