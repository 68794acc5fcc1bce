"""From activations back to their tokens: documents and ARC provenance selections.

A document is found through the doc tables (docs/p-XXXXX.jsonl: where it starts, how many
tokens it has) and its tokens through tokens/doc_index, which follows it into the rows it
continues into. Selections filter the per-token ARC arrays (task, variant, part, example,
grid, cell) and what each token attended to (tokens/context_start) over committed
partitions.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Sequence

import numpy as np

from actx.reader import errors
from actx.reader import generation_records
from actx.reader import masks as masks_lib
from actx.reader import snapshot
from actx.schemas import advice
from actx.schemas import doc_tables
from actx.schemas import layout


@dataclasses.dataclass
class Selection:
    """Tokens picked from a run, in row-major order.

    rows / cols: coordinates (int64 [n]); input_ids: token ids (int32 [n]; in a generating
    run the id the model wrote where it wrote one);
    acts: per hook, activations [n, hidden]; meta: the doc-table row for `document`.
    """

    rows: np.ndarray
    cols: np.ndarray
    input_ids: np.ndarray
    acts: dict[str, np.ndarray]
    meta: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)


class DocTable:
    """Doc-table rows of committed partitions, loaded once on first use."""

    def __init__(self, run: snapshot.RunSnapshot):
        self.by_index: dict[int, dict] = {}
        # doc_id -> its documents: ids need not be unique (the data's own id column, or
        # the default "<file name>:<line>" of two files of one name in two folders).
        self.by_id: dict[str, list[dict]] = {}
        # Committed partitions where documents start whose doc table is gone, where others
        # are there (prepare writes one for each): a lookup that fails names them.
        self.lost: list[int] = []
        found_any = False
        for pid in run.committed:
            key = layout.docs_key(pid)
            data = run.store.read(key)
            if data is None:
                if run.manifest.partition(pid).docs:
                    self.lost.append(pid)
                continue
            found_any = True
            for doc in doc_tables.parse(data, str(run.location.join(key)), run.location):
                doc["partition"] = pid
                self.by_index[int(doc["doc_index"])] = doc
                self.by_id.setdefault(str(doc["doc_id"]), []).append(doc)
        if not found_any:  # no table at all: a run not made by prepare, not one that lost some
            self.lost = []

    def find(self, run: snapshot.RunSnapshot, doc: "int | str") -> dict:
        """The doc-table row of `doc` (a doc_index, or a doc_id that names one document)."""
        if isinstance(doc, (int, np.integer)):
            found = [self.by_index[int(doc)]] if int(doc) in self.by_index else []
        else:
            found = self.by_id.get(str(doc), [])
        if not found and self.lost:
            names = ", ".join(layout.partition_name(p) for p in self.lost[:10])
            raise errors.LostDataError(
                f"{run.location}: document {doc!r} is in no doc table read, and "
                f"{len(self.lost)} committed partition(s) lost theirs ({names}"
                f"{' ...' if len(self.lost) > 10 else ''}: "
                f"{run.location.join(layout.DOCS_PREFIX)}); "
                f"`{advice.reprepare(run.location)}` writes the same tokens and tables "
                f"again (what is committed stays)")
        if not found:
            raise KeyError(f"{run.location}: no document {doc!r} starts in a committed "
                           f"partition ({len(run.committed)} committed of "
                           f"{len(run.partitions)})")
        if len(found) > 1:
            found = sorted(found, key=lambda d: int(d["doc_index"]))
            where = "; ".join(
                f"doc_index {d['doc_index']} ({d.get('file', '?')} "
                f"{'row' if 'row' in d else 'line'} {d.get('row', d.get('line', '?'))})"
                for d in found[:5])
            more = f"; and {len(found) - 5} more" if len(found) > 5 else ""
            raise errors.AmbiguousDocumentError(
                f"{run.location}: doc_id {doc!r} names {len(found)} documents of the "
                f"committed partitions: {where}{more}; ask for one by its doc_index, e.g. "
                f"run.document({found[0]['doc_index']})")
        return found[0]


# Each run's doc table, read on its first document lookup and kept while the run is.
_DOC_TABLES: "weakref.WeakKeyDictionary[snapshot.RunSnapshot, DocTable]" = \
    weakref.WeakKeyDictionary()


def doc_table(run: snapshot.RunSnapshot) -> DocTable:
    """The run's DocTable, loaded once per run object."""
    table = _DOC_TABLES.get(run)
    if table is None:
        table = _DOC_TABLES[run] = DocTable(run)
    return table


def _hooks(run: snapshot.RunSnapshot, hooks: "str | Sequence[str] | None") -> tuple[str, ...]:
    if hooks is None:
        return tuple(run.hooks)
    hooks = run.resolve_hooks((hooks,) if isinstance(hooks, str) else tuple(hooks))
    for h in hooks:
        run.hook(h)
    return hooks


def document(run: snapshot.RunSnapshot, doc: "int | str",
             hooks: "str | Sequence[str] | None" = None) -> Selection:
    """Every token of a document (doc_index or doc_id), following it across rows."""
    hooks = _hooks(run, hooks)
    meta = doc_table(run).find(run, doc)
    d, n_tokens = int(meta["doc_index"]), int(meta["n_tokens"])
    row, seq_len = int(meta["first_row"]), run.seq_len
    # A document continues into following rows; read only as many rows as it can span.
    last_row = min(run.total_rows, row + (int(meta["first_col"]) + n_tokens - 1) // seq_len + 1)
    run.check_rows(row, last_row, hooks)
    doc_index = run.token_array("doc_index")[row:last_row].read().result()
    r, c = np.nonzero(doc_index == d)
    found_rows, found_cols = r + row, c
    found = len(r)
    if found != n_tokens:
        raise ValueError(f"{run.location}: document {doc!r} has {n_tokens} tokens in the doc "
                         f"table but {found} in tokens/doc_index (rows {row}..{last_row - 1})")
    rows, cols = found_rows.astype(np.int64), found_cols.astype(np.int64)
    ids = run.token_ids(rows, cols)
    return Selection(rows, cols, ids, run.gather(hooks, rows, cols), dict(meta))


def _index_of(value: "int | str | None", names: Sequence[str], what: str) -> int | None:
    if value is None or isinstance(value, (int, np.integer)):
        return value
    if value not in names:
        raise KeyError(f"unknown {what} {value!r}; known: {', '.join(names)}")
    return list(names).index(value)


def select(run: snapshot.RunSnapshot, hooks: "str | Sequence[str] | None" = None, *,
           arc_task: "str | int | None" = None, arc_variant: int | None = None,
           arc_part: "str | int | None" = None, arc_example: int | None = None,
           arc_grid: "str | int | None" = None, cells_only: bool = False,
           whole_document: bool = False,
           partitions: Sequence[int] | None = None,
           exclude: Sequence[str] | None = None,
           outlier_factor: float = masks_lib.DEFAULT_OUTLIER_FACTOR,
           generated: bool | None = None, arc_verdict: str | None = None) -> Selection:
    """Tokens that match every given filter, over committed partitions.

    whole_document: only tokens that attended to their whole document up to themselves
    (tokens/context_start == 0): not the tokens of a document past packing.max_context,
    nor, in concat rows, those of a document that began in an earlier row.

    arc_task: task id (manifest.arc_tasks) or its index; arc_part: "system", "user",
    "assistant"; arc_grid: "train_input", "train_output", "test_input", "test_output";
    cells_only: only tokens that encode a grid cell (arc_row / arc_col set).
    E.g. every cell token of task X's test input: select(h, arc_task=X,
    arc_grid="test_input", cells_only=True).
    exclude / outlier_factor: token masks to leave out (reader.masks); also a filter of
    its own: select(h, exclude=["bos", "outlier"]) is every other valid token.
    generated: in a generating run, True for the tokens the model wrote only, False for
    its prompts' only (exclude=["prompt"] / ["generated"]).
    arc_verdict: in a generating run, the tokens (prompt and answer) of the samples whose
    ARC answer is "correct", "wrong", "unparseable" or "no_expected" (schemas.arc_answer).
    """
    hooks = _hooks(run, hooks)
    if generated is not None:
        exclude = (*(exclude or ()), "prompt" if generated else "generated")
    wanted = {
        "arc_task": _index_of(arc_task, run.manifest.arc_tasks, "ARC task"),
        "arc_variant": arc_variant,
        "arc_part": _index_of(arc_part, layout.ARC_PARTS, "ARC part"),
        "arc_example": arc_example,
        "arc_grid": _index_of(arc_grid, layout.ARC_GRIDS, "ARC grid"),
    }
    wanted = {k: v for k, v in wanted.items() if v is not None}
    if whole_document:
        wanted["context_start"] = 0
    ids = run.committed_ids(partitions, hooks)
    if arc_verdict is not None:
        wanted["doc_index"] = generation_records.documents_with_verdict(run, ids, arc_verdict)
    names = list(wanted) + (["arc_row"] if cells_only else [])
    if not names and not exclude:
        raise ValueError("select: give at least one provenance filter or exclude=")
    keep = masks_lib.token_filter(run, hooks, exclude, outlier_factor=outlier_factor,
                                  partitions=ids)
    keep_sources = keep.sources(run) if keep.exclude or keep.generates else []
    # A run without ARC sources has no ARC arrays: every token reads as -1 there.
    absent = {n for n in names if n in layout.ARC_ARRAYS
              and not run.store.exists(f"{layout.token_array_key(n)}/zarr.json")}
    all_rows, all_cols = [], []
    for pid in ids:
        part = run.partitions[pid]
        if not names:
            mask = keep.keep([a[part.row_start:part.row_stop].read().result()
                              for a in keep_sources])
            r, c = np.nonzero(mask)
            all_rows.append(r + part.row_start)
            all_cols.append(c)
            continue
        # Filter on the most selective array first, then read the others only for rows
        # that still match: most rows of a mixed run hold no ARC tokens at all.
        first = (np.full((part.row_stop - part.row_start, run.seq_len), -1, np.int32)
                 if names[0] in absent else
                 run.token_array(names[0])[part.row_start:part.row_stop].read().result())
        mask = _match(names[0], first, wanted)
        live = np.flatnonzero(mask.any(axis=1))
        for name in names[1:]:
            if not len(live):
                break
            # tensorstore indexes in absolute coordinates, hence + row_start.
            values = (np.full((len(live), run.seq_len), -1, np.int32) if name in absent else
                      run.token_array(name).oindex[live + part.row_start].read().result())
            mask[live] &= _match(name, values, wanted)
            live = live[mask[live].any(axis=1)]
        if keep_sources and len(live):
            mask[live] &= keep.keep([a.oindex[live + part.row_start].read().result()
                                     for a in keep_sources])
        r, c = np.nonzero(mask)
        all_rows.append(r + part.row_start)
        all_cols.append(c)
    rows = np.concatenate(all_rows).astype(np.int64) if all_rows else np.zeros(0, np.int64)
    cols = np.concatenate(all_cols).astype(np.int64) if all_cols else np.zeros(0, np.int64)
    ids = run.token_ids(rows, cols)
    acts = run.gather(hooks, rows, cols)
    filters = {k: v for k, v in wanted.items() if k != "doc_index"}
    if arc_verdict is not None:
        filters["arc_verdict"] = arc_verdict
    if generated is not None:
        filters["generated"] = generated
    return Selection(rows, cols, ids, acts, {"filters": {**filters, "cells_only": cells_only}})


def _match(name: str, values: np.ndarray, wanted: dict) -> np.ndarray:
    if name == "arc_row" and name not in wanted:
        return values >= 0
    if name == "doc_index":  # the documents of an arc_verdict
        return np.isin(values, wanted[name])
    return values == wanted[name]

