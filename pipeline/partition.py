"""The run plan: global document order, input accounting, packing and partitions.

Built once from small per-document metadata (sort key, token count, task id) and the keys
of rejected inputs, so it is a pure function of the inputs and the run spec: whatever the
runner's parallelism, document d gets the same index, rows and partition.
"""

from __future__ import annotations

import dataclasses

from pipeline import pack
from schemas import manifest as manifest_lib
from schemas import runspec as runspec_lib


@dataclasses.dataclass(frozen=True)
class DocMeta:
    """key: (source_index, file, line, variant); n_tokens before truncation."""

    key: tuple
    n_tokens: int
    task_id: str | None = None


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """doc_index: key -> run-wide document number (the packing order).

    record_cutoff: per source index, the last record key kept under `max_docs` (records
    after it are not read, neither packed nor rejected); absent when the source has no cap.
    """

    doc_index: dict
    doc_keys: tuple
    packed: pack.PackPlan
    partitions: tuple[manifest_lib.Partition, ...]
    counts: dict[str, manifest_lib.SourceCounts]
    arc_tasks: tuple[str, ...]
    record_cutoff: dict
    separator_id: int | None
    partition_rows: int

    def keeps_record(self, record_key: tuple) -> bool:
        cutoff = self.record_cutoff.get(record_key[0])
        return cutoff is None or _order(record_key) <= _order(cutoff)

    def partition_of_row(self, row: int) -> int:
        return row // self.partition_rows

    def partitions_of_doc(self, doc_index: int) -> list[int]:
        return sorted({self.partition_of_row(p.row) for p in self.packed.pieces[doc_index]})

    def packed_ids(self, doc_index: int, token_ids):
        """The document's tokens as packed: truncated, or followed by the separator."""
        import numpy as np

        n = self.packed.stored_tokens[doc_index]
        if n <= len(token_ids):
            return token_ids[:n]
        return np.concatenate([token_ids, np.full(n - len(token_ids), self.separator_id,
                                                  dtype=token_ids.dtype)])


def _order(record_key: tuple) -> tuple:
    return (record_key[0], record_key[1], record_key[2])


def build_plan(spec: runspec_lib.RunSpec, docs: list[DocMeta], reject_keys: list[tuple],
               separator_id: int | None) -> RunPlan:
    """reject_keys: (source_index, file, line) of every rejected input (line -1: whole file)."""
    cutoff = {}
    for s, source in enumerate(spec.sources):
        if source.max_docs is None:
            continue
        records = sorted({d.key[:3] for d in docs if d.key[0] == s}
                         | {k for k in reject_keys if k[0] == s}, key=_order)
        if len(records) > source.max_docs:
            cutoff[s] = records[source.max_docs - 1] if source.max_docs else (s, "", -2)

    def kept(record_key):
        c = cutoff.get(record_key[0])
        return c is None or _order(record_key) <= _order(c)

    docs = sorted((d for d in docs if kept(d.key[:3])), key=lambda d: d.key)
    if len({d.key for d in docs}) != len(docs):
        raise ValueError("duplicate document keys: an input file was read twice")
    sep_len = 0
    if spec.packing.mode == "concat" and spec.packing.separator != "none":
        sep_len = 1
    packed = pack.plan_pack([d.n_tokens for d in docs], spec.packing, sep_len)

    rows = spec.layout.partition_rows
    n_parts = -(-packed.total_rows // rows)
    tokens = [0] * n_parts
    starts = [0] * n_parts
    for pieces in packed.pieces:
        for p in pieces:
            tokens[p.row // rows] += p.length
        if pieces:
            starts[pieces[0].row // rows] += 1
    partitions = tuple(manifest_lib.Partition(
        i, i * rows, min(rows, packed.total_rows - i * rows), tokens[i], starts[i])
        for i in range(n_parts))

    counts = {}
    for s in range(len(spec.sources)):
        accepted = {d.key[:3] for d in docs if d.key[0] == s}
        rejected = {k for k in reject_keys if k[0] == s and kept(k)}
        trunc = sum(packed.truncated_tokens[i] for i, d in enumerate(docs) if d.key[0] == s)
        counts[spec.source_name(s)] = manifest_lib.SourceCounts(
            read=len(accepted) + len(rejected), accepted=len(accepted), rejected=len(rejected),
            truncated_tokens=trunc)
    arc_tasks = tuple(sorted({d.task_id for d in docs if d.task_id is not None}))
    return RunPlan({d.key: i for i, d in enumerate(docs)}, tuple(d.key for d in docs), packed,
                   partitions, counts, arc_tasks, cutoff, separator_id, rows)
