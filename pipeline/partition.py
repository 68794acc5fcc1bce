"""The run plan: the global steps of prepare, over per-file and per-group summaries only.

Nothing here sees a document. Two small global computations fix the run-wide layout:
  file_limits  per-file record counts -> per-file read limits that apply each source's
               `max_docs` in file order (one record per file);
  build_plan   pack-group summaries (`pack_group.GroupSummary`, one per group) -> each
               group's first run-wide row and doc_index (prefix sums in group order), the
               total rows, the sorted ARC task table and per-source counts.
Partitions are then pure arithmetic on row numbers (fixed `partition_rows`, the last may
be short), and `place_row` moves a group-local row to its run-wide place. Every result is
a pure function of the summaries and the run spec, so whatever the runner's parallelism a
document gets the same index, rows and partition.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from pipeline import pack_group
from schemas import manifest as manifest_lib
from schemas import runspec as runspec_lib


def file_limits(spec: runspec_lib.RunSpec, file_records: Iterable[tuple[tuple, int]]
                ) -> dict[tuple, int]:
    """(source_index, path) -> records to read, for the files of sources with max_docs.

    file_records: ((source_index, path), records the file holds, up to max_docs). The
    first max_docs records of a source in (path, line) order are kept: files are taken in
    path order, each up to what the files before it left over.
    """
    left = {s: src.max_docs for s, src in enumerate(spec.sources) if src.max_docs is not None}
    limits = {}
    for (s, path), n in sorted(file_records):
        if s not in left:
            raise ValueError(f"source {s} has no max_docs: its files need no count")
        limits[(s, path)] = min(n, left[s])
        left[s] -= limits[(s, path)]
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


def place_row(plan: RunPlan, row: pack_group.Row) -> tuple[int, pack_group.Row]:
    """(partition id, the row with run-wide row, doc_index and arc_task numbers)."""
    at = plan.groups[row.group]
    arrays = dict(row.arrays)
    doc_index = arrays["doc_index"]
    arrays["doc_index"] = np.where(doc_index >= 0, doc_index + at.first_doc, -1).astype(np.int32)
    if "arc_task" in arrays:
        local = arrays["arc_task"]
        task_map = np.asarray(at.task_map or (0,), dtype=np.int32)
        arrays["arc_task"] = np.where(local >= 0, task_map[np.maximum(local, 0)],
                                      -1).astype(np.int32)
    docs = tuple({**d, "doc_index": d["doc_index"] + at.first_doc,
                  "first_row": d["first_row"] + at.first_row} for d in row.docs)
    placed = pack_group.Row(None, at.first_row + row.row, arrays, docs)
    return plan.partition_of_row(placed.row), placed


def source_counts(plan: RunPlan, reject_stats: Iterable[dict]
                  ) -> dict[str, manifest_lib.SourceCounts]:
    """Input accounting per source: read = accepted + rejected (rejects within max_docs)."""
    rejected = {s["source"]: s["rejected"] for s in reject_stats}
    return {name: manifest_lib.SourceCounts(
        read=plan.accepted[s] + rejected.get(name, 0), accepted=plan.accepted[s],
        rejected=rejected.get(name, 0), truncated_tokens=plan.truncated_tokens[s])
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
                                          w["full_context_tokens"]))
    tokens, docs = sum(p.tokens for p in out), sum(p.docs for p in out)
    if (tokens, docs) != (plan.total_tokens, plan.total_docs):
        raise RuntimeError(f"written {tokens} tokens / {docs} docs, the plan has "
                           f"{plan.total_tokens} / {plan.total_docs}")
    return tuple(out)
