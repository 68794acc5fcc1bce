"""Writes the token store: token arrays one partition (one stored shard) at a time, the
doc table of each partition, the rejects, and the staged summary the driver commits from.

Each partition is written by exactly one call (one bundle), into exactly the rows of its
shard, so no stored object has two writers.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from pipeline import arc_render
from pipeline import pack
from pipeline import partition as partition_lib
from pipeline import tokenize
from schemas import layout
from schemas import runspec as runspec_lib
from schemas import store as store_lib
from schemas import ts_context
from schemas import uri as uri_lib

# Staged by the pipeline, read by the driver before it writes run.json and manifest.json.
SUMMARY_KEY = layout.PREPARE_SUMMARY_KEY


def open_token_array(run_uri: str, name: str, total_rows: int, spec: runspec_lib.RunSpec):
    array = layout.token_array(name, total_rows, spec.packing.seq_len, spec.layout)
    return ts_context.open_array(array.spec(uri_lib.parse(run_uri), create=True))


def create_token_arrays(run_uri: str, plan: partition_lib.RunPlan, spec: runspec_lib.RunSpec
                        ) -> partition_lib.RunPlan:
    """Creates (or reopens, when identical) every token array; returns the plan unchanged."""
    for name in layout.ALL_TOKEN_ARRAYS:
        open_token_array(run_uri, name, plan.packed.total_rows, spec)
    return plan


def _empty_block(rows: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    block = {name: np.full((rows, seq_len), -1, dtype=np.int32)
             for name in layout.ALL_TOKEN_ARRAYS}
    block["input_ids"][:] = pad_id
    block["segment_ids"][:] = 0
    block["positions"][:] = 0
    return block


def doc_table_row(spec: runspec_lib.RunSpec, plan: partition_lib.RunPlan, doc_index: int,
                  doc: tokenize.TokenizedDoc) -> dict:
    first = plan.packed.pieces[doc_index][0]
    return {**doc.meta, "doc_index": doc_index, "source": spec.source_name(doc.key[0]),
            "n_tokens": plan.packed.stored_tokens[doc_index],
            "truncated_tokens": plan.packed.truncated_tokens[doc_index],
            "first_row": first.row, "first_col": first.col}


def write_partition(run_uri: str, spec: runspec_lib.RunSpec, plan: partition_lib.RunPlan,
                    partition_id: int, docs: list[tokenize.TokenizedDoc]) -> dict:
    """Fills one partition's rows from the documents that touch it and writes them.

    Returns {"partition", "tokens", "docs"} for cross-checking against the plan.
    """
    part = plan.partitions[partition_id]
    block = _empty_block(part.row_count, spec.packing.seq_len, spec.packing.pad_id)
    task_index = {t: i for i, t in enumerate(plan.arc_tasks)}
    doc_rows = []
    ordered = sorted(((plan.doc_index[d.key], d) for d in docs), key=lambda x: x[0])
    for doc_index, doc in ordered:
        pieces = [p for p in plan.packed.pieces[doc_index]
                  if part.row_start <= p.row < part.row_stop]
        ids = plan.packed_ids(doc_index, doc.token_ids)
        extra = None
        if doc.arc_attrs is not None:
            n = len(ids)
            attrs = np.full((len(arc_render.CHAR_ATTRS), n), -1, dtype=np.int32)
            m = min(n, doc.arc_attrs.shape[1])
            attrs[:, :m] = doc.arc_attrs[:, :m]
            extra = {name: attrs[i] for i, name in enumerate(arc_render.CHAR_ATTRS)}
            extra["arc_task"] = np.full(n, task_index[doc.task_id], dtype=np.int32)
            extra["arc_variant"] = np.full(n, doc.variant, dtype=np.int32)
            if n > doc.arc_attrs.shape[1]:  # the concat separator is no part of the prompt
                for name in extra:
                    extra[name][doc.arc_attrs.shape[1]:] = -1
        pack.fill_rows(block, part.row_start, pieces, ids, doc_index, extra)
        if plan.partition_of_row(plan.packed.pieces[doc_index][0].row) == partition_id:
            doc_rows.append(doc_table_row(spec, plan, doc_index, doc))
    for name in layout.ALL_TOKEN_ARRAYS:
        array = open_token_array(run_uri, name, plan.packed.total_rows, spec)
        array[part.row_start:part.row_stop].write(block[name]).result()
    store = store_lib.open_store(run_uri)
    store.write(layout.docs_key(partition_id),
                b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in doc_rows))
    tokens = int((block["segment_ids"] > 0).sum())
    return {"partition": partition_id, "tokens": tokens, "docs": len(doc_rows)}


def rejects_key(source_name: str) -> str:
    return f"{layout.REJECTS_PREFIX}{source_name}-00000.jsonl"


def write_rejects(run_uri: str, source_name: str, rejects: list) -> dict:
    """All rejects of one source, in input order, as one JSONL object."""
    ordered = sorted(rejects, key=lambda r: r.record_key)
    store = store_lib.open_store(run_uri)
    store.write(rejects_key(source_name), b"".join(
        json.dumps(r.to_json_obj(), sort_keys=True, ensure_ascii=False).encode() + b"\n"
        for r in ordered))
    reasons: dict[str, int] = {}
    for r in ordered:
        kind = r.reason.split(":")[0].split(" (")[0]
        reasons[kind] = reasons.get(kind, 0) + 1
    return {"source": source_name, "rejected": len(ordered), "reasons": reasons}


def write_summary(run_uri: str, plan: partition_lib.RunPlan, written: list[dict],
                  reject_stats: list[dict]) -> dict:
    """Checks the written partitions against the plan and stages the summary."""
    by_id = {w["partition"]: w for w in written}
    for part in plan.partitions:
        w = by_id.get(part.id)
        if w is None or (w["tokens"], w["docs"]) != (part.tokens, part.docs):
            raise RuntimeError(f"partition {part.id}: written {w} does not match the plan "
                               f"({part.tokens} tokens, {part.docs} docs)")
    summary = {
        "total_rows": plan.packed.total_rows,
        "partitions": [dataclasses.asdict(p) for p in plan.partitions],
        "sources": {name: dict(read=c.read, accepted=c.accepted, rejected=c.rejected,
                               truncated_tokens=c.truncated_tokens)
                    for name, c in plan.counts.items()},
        "arc_tasks": list(plan.arc_tasks),
        "docs": len(plan.doc_keys),
        "reject_reasons": {s["source"]: s["reasons"] for s in sorted(
            reject_stats, key=lambda s: s["source"])},
    }
    store_lib.open_store(run_uri).write_json(SUMMARY_KEY, summary)
    return summary
