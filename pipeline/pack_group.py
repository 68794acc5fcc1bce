"""Packs one pack group into rows, independently of every other group.

A pack group is the documents of one input file whose line (or row, or ARC task index)
falls in one fixed block of GROUP_LINES lines: (source_index, file, line // GROUP_LINES).
Groups are the unit of packing so that no step ever holds the documents of the whole run:
a group is packed on its own, into rows numbered from 0, and only its small summary
(`GroupSummary`: row, document and token counts, its ARC task ids) takes part in the
global plan (`pipeline.partition`), which later shifts the group's rows and document
numbers to their run-wide place.

Cost of that independence: every group starts a fresh row, so the last row of a group may
carry some padding (at most one partly filled row per group), and in `concat` mode the
stream restarts per group (no separator after the group's last document).

Pure Python and numpy; no Beam.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from pipeline import arc_render
from pipeline import pack
from schemas import layout
from schemas import runspec as runspec_lib

# Input lines per pack group. Part of the output format: changing it moves documents
# between rows, so it is a constant (fixed for every run), not an option. 32768 FineWeb
# documents (~25M tokens) fit one worker's memory comfortably.
GROUP_LINES = 1 << 15


def group_key(doc_key: tuple) -> tuple:
    """(source_index, file, block): sorts like the document keys it holds."""
    return (doc_key[0], doc_key[1], doc_key[2] // GROUP_LINES)


@dataclasses.dataclass(frozen=True)
class GroupSummary:
    """All the global plan learns of a group: counts, never per-document data.

    records: distinct input records (an ARC task with all its variants is one record);
    tokens: stored tokens (after truncation, with separators); task_ids: sorted.
    """

    key: tuple
    records: int
    docs: int
    rows: int
    tokens: int
    truncated_tokens: int
    task_ids: tuple[str, ...] = ()

    @property
    def source_index(self) -> int:
        return self.key[0]


@dataclasses.dataclass(frozen=True)
class Row:
    """One packed row.

    group: its pack group (None once placed run-wide); row: its row number, in the group
    or run-wide once placed; arrays: name -> int32 [seq_len], the ARC arrays only when the
    row holds an ARC token (otherwise all -1); docs: doc-table entries of the documents
    that start in this row, in document order.
    """

    group: tuple | None
    row: int
    arrays: dict
    docs: tuple[dict, ...]


def empty_block(rows: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Token arrays [rows, seq_len] holding padding only (layout.TOKEN_FILL, else -1)."""
    block = {name: np.full((rows, seq_len), layout.TOKEN_FILL.get(name, -1), dtype=np.int32)
             for name in layout.ALL_TOKEN_ARRAYS}
    block["input_ids"][:] = pad_id
    return block


def _packed_ids(token_ids: np.ndarray, stored: int, separator_id: int | None) -> np.ndarray:
    """The document's tokens as packed: truncated, or followed by the separator."""
    if stored <= len(token_ids):
        return token_ids[:stored]
    return np.concatenate([token_ids, np.full(stored - len(token_ids), separator_id,
                                              dtype=token_ids.dtype)])


def _arc_extra(doc, n: int, task_index: int) -> dict[str, np.ndarray]:
    attrs = np.full((len(arc_render.CHAR_ATTRS), n), -1, dtype=np.int32)
    m = min(n, doc.arc_attrs.shape[1])
    attrs[:, :m] = doc.arc_attrs[:, :m]
    extra = {name: attrs[i] for i, name in enumerate(arc_render.CHAR_ATTRS)}
    extra["arc_task"] = np.full(n, task_index, dtype=np.int32)
    extra["arc_variant"] = np.full(n, doc.variant, dtype=np.int32)
    if n > doc.arc_attrs.shape[1]:  # the concat separator is no part of the prompt
        for name in extra:
            extra[name][doc.arc_attrs.shape[1]:] = -1
    return extra


def pack_group(spec: runspec_lib.RunSpec, separator_id: int | None, key: tuple,
               docs: Iterable) -> tuple[GroupSummary, list[Row]]:
    """Packs the TokenizedDocs of group `key` in document-key order.

    Row numbers and doc_index values are group-local (from 0); `arc_task` holds indices
    into the summary's task_ids. `partition.place_row` makes them run-wide.
    """
    docs = sorted(docs, key=lambda d: d.key)
    if any(a.key == b.key for a, b in zip(docs, docs[1:])):
        raise ValueError(f"duplicate document keys in {key}: an input file was read twice")
    sep_len = 1 if spec.packing.mode == "concat" and spec.packing.separator != "none" else 0
    packed = pack.plan_pack([len(d.token_ids) for d in docs], spec.packing, sep_len)
    task_ids = tuple(sorted({d.task_id for d in docs if d.task_id is not None}))
    task_index = {t: i for i, t in enumerate(task_ids)}
    block = empty_block(packed.total_rows, spec.packing.seq_len, spec.packing.pad_id)
    starts: dict[int, list[dict]] = {}
    for i, doc in enumerate(docs):
        ids = _packed_ids(doc.token_ids, packed.stored_tokens[i], separator_id)
        extra = None if doc.arc_attrs is None else _arc_extra(doc, len(ids),
                                                              task_index[doc.task_id])
        pieces = packed.pieces[i]
        pack.fill_rows(block, 0, pieces, ids, i, extra, packing=spec.packing)
        if pieces:
            starts.setdefault(pieces[0].row, []).append({
                **doc.meta, "doc_index": i, "source": spec.source_name(doc.key[0]),
                "n_tokens": packed.stored_tokens[i],
                "truncated_tokens": packed.truncated_tokens[i],
                "first_row": pieces[0].row, "first_col": pieces[0].col})
    # Rows without ARC tokens leave the (all -1) ARC arrays out: less to shuffle.
    has_arc = (block["arc_task"] >= 0).any(axis=1)
    rows = []
    for r in range(packed.total_rows):
        names = layout.ALL_TOKEN_ARRAYS if has_arc[r] else layout.TOKEN_ARRAYS
        rows.append(Row(key, r, {n: block[n][r].copy() for n in names},
                        tuple(starts.get(r, ()))))
    summary = GroupSummary(key, len({d.key[:3] for d in docs}), len(docs), packed.total_rows,
                           sum(packed.stored_tokens), sum(packed.truncated_tokens), task_ids)
    return summary, rows
