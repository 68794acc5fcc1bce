"""Builds one partition's token arrays and doc table from the tokenized units whose pieces
fall in its rows (`unit_tokens`), following the run-wide plan (`partition.WritePlan`).

A writer keeps the last few units it read (`UnitReader`), so consecutive partitions read
each unit once: its memory is a partition block plus a few units, whatever the data set.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from pipeline import arc_render
from pipeline import pack
from pipeline import pack_group
from pipeline import partition as partition_lib
from pipeline import unit_tokens
from schemas import runspec as runspec_lib
from schemas import store as store_lib

UNITS_KEPT = 3


@dataclasses.dataclass
class PackedUnit:
    """A unit's tokens with its pieces laid out run-wide. first_rows / last_rows: int64
    [docs], the run-wide rows of each document's first and last piece."""

    place: partition_lib.UnitPlacement
    tokens: unit_tokens.UnitTokens
    plan: pack.PackPlan
    offsets: np.ndarray
    first_rows: np.ndarray
    last_rows: np.ndarray


class UnitReader:
    """Reads tokenized units from the run directory, keeping the last UNITS_KEPT."""

    def __init__(self, run_uri: str, spec: runspec_lib.RunSpec):
        self.store, self.spec = store_lib.open_store(run_uri), spec
        self.kept: collections.OrderedDict[str, PackedUnit] = collections.OrderedDict()
        self.reads = 0

    def get(self, place: partition_lib.UnitPlacement) -> PackedUnit:
        if place.unit_id in self.kept:
            self.kept.move_to_end(place.unit_id)
            return self.kept[place.unit_id]
        key = unit_tokens.cache_key(place.unit_id)
        data = self.store.read(key)
        if data is None:
            raise RuntimeError(f"{self.store.location.join(key)}: the tokens of a work unit are "
                               f"missing (deleted while prepare ran?); run prepare again")
        tokens = unit_tokens.UnitTokens.from_bytes(data)
        if len(tokens.lengths) != place.docs:
            raise RuntimeError(f"{key}: {len(tokens.lengths)} documents, the plan has "
                               f"{place.docs}")
        plan = pack.plan_pack(tokens.lengths.tolist(), self.spec.packing,
                              pack_group.separator_len(self.spec), place.start, place.last)
        first = np.array([p[0].row for p in plan.pieces], np.int64) + place.group_first_row
        last = np.array([p[-1].row for p in plan.pieces], np.int64) + place.group_first_row
        unit = PackedUnit(place, tokens, plan, tokens.offsets, first, last)
        self.kept[place.unit_id] = unit
        self.reads += 1
        while len(self.kept) > UNITS_KEPT:
            self.kept.popitem(last=False)
        return unit


def _arc_extra(attrs: np.ndarray, n: int, variant: int, task_index: int
               ) -> dict[str, np.ndarray]:
    """ARC arrays of one document's n packed tokens (a concat separator gets -1)."""
    extra = {name: np.full(n, -1, np.int32) for name in arc_render.CHAR_ATTRS}
    m = min(n, attrs.shape[1])
    for i, name in enumerate(arc_render.CHAR_ATTRS):
        extra[name][:m] = attrs[i, :m]
    extra["arc_task"] = np.full(n, -1, np.int32)
    extra["arc_variant"] = np.full(n, -1, np.int32)
    extra["arc_task"][:m] = task_index
    extra["arc_variant"][:m] = variant
    return extra


def fill_partition(spec: runspec_lib.RunSpec, plan: partition_lib.WritePlan, reader: UnitReader,
                   partition_id: int, separator_id: int | None
                   ) -> tuple[dict[str, np.ndarray], list[dict]]:
    """The partition's arrays [rows, seq_len] and its doc-table rows (the documents that
    start in it, in doc_index order)."""
    start, count = plan.run.partition_range(partition_id)
    stop = start + count
    block = pack_group.empty_block(count, spec.packing.seq_len, spec.packing.pad_id)
    task_index = {t: i for i, t in enumerate(plan.run.arc_tasks)}
    doc_rows = []
    for place in plan.units_in_rows(start, stop):
        unit = reader.get(place)
        tokens, packed = unit.tokens, unit.plan
        lo = int(np.searchsorted(unit.last_rows, start, side="left"))
        hi = int(np.searchsorted(unit.first_rows, stop, side="left"))
        row_offset = start - place.group_first_row
        for d in range(lo, hi):
            ids = pack_group._packed_ids(tokens.token_ids[unit.offsets[d]:unit.offsets[d + 1]],
                                         packed.stored_tokens[d], separator_id)
            extra = None
            if tokens.arc_attrs is not None:
                attrs = tokens.arc_attrs[:, unit.offsets[d]:unit.offsets[d + 1]]
                extra = _arc_extra(attrs, len(ids), int(tokens.variants[d]),
                                   task_index[tokens.task_ids[d]])
            pieces = [p for p in packed.pieces[d]
                      if start <= p.row + place.group_first_row < stop]
            pack.fill_rows(block, row_offset, pieces, ids, place.first_doc + d, extra,
                           packing=spec.packing)
            first = packed.pieces[d][0]
            if start <= unit.first_rows[d] < stop:
                doc_rows.append({
                    **tokens.metas[d], "doc_index": place.first_doc + d,
                    "source": spec.source_name(place.source_index),
                    "n_tokens": packed.stored_tokens[d],
                    "truncated_tokens": packed.truncated_tokens[d],
                    "first_row": int(unit.first_rows[d]), "first_col": first.col})
    doc_rows.sort(key=lambda d: d["doc_index"])
    return block, doc_rows
