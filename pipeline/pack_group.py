"""Plans one pack group's rows, independently of every other group.

A pack group is the documents of one input file whose line (or row, or ARC task index)
falls in one fixed block of GROUP_LINES lines: (source_index, file, line // GROUP_LINES).
Groups are the unit of packing so that no step ever holds the documents of the whole run:
a group is packed on its own, into rows numbered from 0, from the token counts of its
work units (`plan_group`: one int32 per document, never tokens), and only its small
summary (`GroupSummary`: row, document and token counts, its ARC task ids) takes part in
the global plan (`pipeline.partition`), which shifts the group's rows and document numbers
to their run-wide place. Each unit's `UnitLayout` says where its documents resume, so the
partition writers can lay them out without the rest of the group.

Cost of that independence: every group starts a fresh row, so the last row of a group may
carry some padding (at most one partly filled row per group), and in `concat` mode the
stream restarts per group (no separator after the group's last document).

Pure Python and numpy; no Beam.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from actx.pipeline import pack
from actx.schemas import layout
from actx.schemas import runspec as runspec_lib

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
class UnitLayout:
    """Where one unit's documents go inside its group: its first document's group-local
    index, the packing state its documents resume from, whether they end the group
    (concat: no separator after the last), and the group-local rows [row_start,
    row_stop) its pieces occupy."""

    unit_id: str
    group: tuple
    source_index: int
    first_doc: int
    docs: int
    start: pack.PackState
    last: bool
    row_start: int
    row_stop: int


def token_array_names(spec: runspec_lib.RunSpec) -> tuple[str, ...]:
    """The token arrays of this run: the ARC arrays only when a source is ARC."""
    return layout.token_array_names(any(s.kind == "arc" for s in spec.sources))


def empty_block(rows: int, seq_len: int, pad_id: int,
                names: tuple[str, ...] = layout.ALL_TOKEN_ARRAYS) -> dict[str, np.ndarray]:
    """Token arrays [rows, seq_len] holding padding only (layout.TOKEN_FILL, else -1)."""
    block = {name: np.full((rows, seq_len), layout.TOKEN_FILL.get(name, -1), dtype=np.int32)
             for name in names}
    block["input_ids"][:] = pad_id
    return block


def separator_len(spec: runspec_lib.RunSpec) -> int:
    return 1 if spec.packing.mode == "concat" and spec.packing.separator != "none" else 0


def plan_group(spec: runspec_lib.RunSpec, key: tuple, summaries: Iterable
               ) -> tuple[GroupSummary, list[UnitLayout]]:
    """Packs the lengths of a group's units (`unit_tokens.UnitSummary`) in unit order, as
    one `pack.plan_pack` of the whole group would: the group's summary, and a layout for
    each unit that holds documents."""
    summaries = sorted(summaries, key=lambda u: u.unit.key)
    if any(a.unit.key == b.unit.key for a, b in zip(summaries, summaries[1:])):
        raise ValueError(f"duplicate work units in {key}: an input file was read twice")
    with_docs = [u for u in summaries if u.docs]
    state, doc, stored, truncated, layouts = pack.PackState(), 0, 0, 0, []
    for i, u in enumerate(with_docs):
        last = i + 1 == len(with_docs)
        plan = pack.plan_pack(u.lengths.tolist(), spec.packing, separator_len(spec), state, last)
        layouts.append(UnitLayout(u.unit.unit_id, key, u.unit.source_index, doc, u.docs, state,
                                  last, plan.pieces[0][0].row, plan.end.rows))
        state, doc = plan.end, doc + u.docs
        stored += sum(plan.stored_tokens)
        truncated += sum(plan.truncated_tokens)
    summary = GroupSummary(key, sum(u.records for u in summaries), doc, state.rows, stored,
                           truncated, tuple(sorted({t for u in summaries for t in u.task_ids})))
    return summary, layouts
