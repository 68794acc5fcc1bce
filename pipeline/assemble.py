"""Builds one partition's token arrays and doc table from the tokenized units whose pieces
fall in its rows (`unit_tokens`), following the run-wide plan (`partition.WritePlan`).

A writer keeps the last few units it read (`UnitReader`), so consecutive partitions read
each unit once: its memory is a partition block plus a few units, whatever the data set.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from actx.pipeline import arc_render
from actx.pipeline import pack
from actx.pipeline import pack_group
from actx.pipeline import partition as partition_lib
from actx.pipeline import unit_tokens
from actx.schemas import run_dir
from actx.schemas import runspec as runspec_lib

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

    def __init__(self, run: run_dir.RunDir, spec: runspec_lib.RunSpec):
        self.store, self.spec = run.store, spec
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


def _fill_unit(block: dict[str, np.ndarray], spec: runspec_lib.RunSpec, unit: PackedUnit,
               lo: int, hi: int, start: int, stop: int, separator_id: int | None,
               task_index: dict) -> None:
    """Writes the pieces in rows [start, stop) of the unit's documents lo..hi-1 into the
    partition block (rows from `start`), every token at once: the vectorised equal of
    `pack.fill_rows` per document (tests check one against the other)."""
    place, tokens, packed = unit.place, unit.tokens, unit.plan
    seq_len, packing = spec.packing.seq_len, spec.packing
    pieces = [(d, p) for d in range(lo, hi) for p in packed.pieces[d]
              if start <= p.row + place.group_first_row < stop]
    if not pieces:
        return
    doc = np.fromiter((d for d, _ in pieces), np.int64, len(pieces))
    fields = np.array([(p.row, p.col, p.doc_start, p.length, p.segment_id, p.position_start)
                       for _, p in pieces], np.int64).reshape(-1, 6)
    row, col, doc_start, length, segment, position = fields.T
    piece = np.repeat(np.arange(len(pieces)), length)
    within = np.arange(len(piece)) - np.repeat(np.cumsum(length) - length, length)
    dest = ((row[piece] + place.group_first_row - start) * seq_len + col[piece] + within)
    doc_pos = doc_start[piece] + within  # position in the document's packed tokens
    in_doc = doc_pos < tokens.lengths[doc[piece]]  # else the concat separator
    src = np.where(in_doc, unit.offsets[doc[piece]] + doc_pos, 0)
    flat = {name: values.reshape(-1) for name, values in block.items()}
    flat["input_ids"][dest] = np.where(in_doc, tokens.token_ids[src] if len(src) else 0,
                                       -1 if separator_id is None else separator_id)
    flat["segment_ids"][dest] = segment[piece]
    flat["positions"][dest] = position[piece] + within
    flat["doc_index"][dest] = place.first_doc + doc[piece]
    if packing.mode == "concat":
        context = doc_start[piece]
    elif packing.overflow == "truncate":
        context = np.zeros(len(piece), np.int64)
    else:
        context = np.maximum(0, doc_pos - (packing.max_context - 1))
    flat["context_start"][dest] = context
    if tokens.arc_attrs is not None and "arc_task" in flat:
        for i, name in enumerate(arc_render.CHAR_ATTRS):
            flat[name][dest] = np.where(in_doc, tokens.arc_attrs[i, src], -1)
        tasks = np.array([task_index[t] for t in tokens.task_ids], np.int64)
        flat["arc_task"][dest] = np.where(in_doc, tasks[doc[piece]], -1)
        flat["arc_variant"][dest] = np.where(in_doc, tokens.variants[doc[piece]], -1)


def fill_partition(spec: runspec_lib.RunSpec, plan: partition_lib.WritePlan, reader: UnitReader,
                   partition_id: int, separator_id: int | None
                   ) -> tuple[dict[str, np.ndarray], list[dict]]:
    """The partition's arrays [rows, seq_len] and its doc-table rows (the documents that
    start in it, in doc_index order)."""
    start, count = plan.run.partition_range(partition_id)
    stop = start + count
    block = pack_group.empty_block(count, spec.packing.seq_len, spec.packing.pad_id,
                                   pack_group.token_array_names(spec))
    task_index = {t: i for i, t in enumerate(plan.run.arc_tasks)}
    doc_rows = []
    for place in plan.units_in_rows(start, stop):
        unit = reader.get(place)
        tokens, packed = unit.tokens, unit.plan
        lo = int(np.searchsorted(unit.last_rows, start, side="left"))
        hi = int(np.searchsorted(unit.first_rows, stop, side="left"))
        _fill_unit(block, spec, unit, lo, hi, start, stop, separator_id, task_index)
        for d in range(lo, hi):
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
