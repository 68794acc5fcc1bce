"""Writes the token store: token arrays one partition (one stored shard) at a time, the
doc table of each partition, the rejects, and the staged summary the driver commits from.

Each partition is written by exactly one call (one bundle) from its packed rows, into
exactly the rows of its shard, so no stored object has two writers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import numpy as np

from actx.pipeline import assemble
from actx.pipeline import pack_group
from actx.pipeline import partition as partition_lib
from actx.schemas import chunk_checksums
from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import run_dir
from actx.schemas import runspec as runspec_lib
from actx.schemas import store_errors
from actx.schemas import ts_context

# Staged by the pipeline, read by the driver before it writes run.json and manifest.json.
SUMMARY_KEY = layout.PREPARE_SUMMARY_KEY


class TokensChangedError(errors.UserError, RuntimeError):
    """Preparing a run again would put other tokens under committed activations: its
    inputs make other rows or tokens than those its partitions were extracted from."""


def _changed(run: run_dir.RunDir, what: str) -> TokensChangedError:
    return TokensChangedError(
        f"{run.uri}: {what}. An input changed since the run was prepared: committed "
        f"activations belong to the tokens they were computed on, so nothing was written "
        f"(every committed partition is checked before any write). Restore the inputs as "
        f"they were when the run was prepared and prepare it again, or prepare into a new "
        f"run directory")


def open_token_array(run: run_dir.RunDir, name: str, total_rows: int,
                     spec: runspec_lib.RunSpec):
    """Opens (creating) a token array for writing. Its context keeps no decoded chunks:
    each partition is written once, and cached copies would grow with the run (up to the
    process-wide cache's limit) for nothing; memory:// stores are the shared ones. On local
    disk the shards are not fsynced one by one (hundreds per run, each a wait on the
    disk): the driver makes them durable at once (`make_durable`) before it commits."""
    import tensorstore as ts

    array = layout.token_array(name, total_rows, spec.packing.seq_len, spec.layout)
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": False},
                         parent=ts_context.get())
    with store_errors.tensorstore_errors(run.uri_of(array.key)):
        # A run an earlier actx prepared (prepared again: the same tokens) keeps its codecs.
        return ts_context.open_array_as_stored(array.specs(run.location, create=True),
                                               context=context)


def clear_damaged_metadata(run: run_dir.RunDir, spec: runspec_lib.RunSpec) -> list[str]:
    """Removes the zarr.json of each token array of `spec` where it is damaged (not a JSON
    object), so this prepare writes it again as it writes a deleted one (tensorstore would
    refuse to open the array, and the prepare that mends the token store would fail on
    what it mends); the chunks stay, and a committed partition's are checked against its
    marker as always. Returns the keys removed."""
    import logging

    removed = []
    for name in pack_group.token_array_names(spec):
        key = f"{layout.token_array_key(name)}/zarr.json"
        try:
            if isinstance(run.store.read_json(key), (dict, type(None))):
                continue
        except ValueError:  # not JSON
            pass
        run.store.delete(key)
        removed.append(key)
        logging.getLogger("actx.prepare").warning(
            "prepare: %s is damaged (not the array's metadata): written again",
            run.uri_of(key))
    return removed


def make_durable(run: run_dir.RunDir) -> None:
    """Flushes a local run directory's file system (the token shards written without
    fsync) to disk; object stores need nothing (a finished upload is durable)."""
    import ctypes
    import os

    loc = run.location
    if not loc.is_local:
        return
    fd = os.open(loc.path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if not hasattr(libc, "syncfs") or libc.syncfs(fd) != 0:
            os.sync()  # no syncfs (not Linux) or it failed: flush every file system
    finally:
        os.close(fd)


def create_token_arrays(run: run_dir.RunDir, plan: partition_lib.RunPlan, spec: runspec_lib.RunSpec,
                        committed_rows: int | None = None) -> partition_lib.RunPlan:
    """Creates (or reopens, when identical) every token array of the run (the ARC arrays
    only when it has an ARC source); returns the plan unchanged. committed_rows: the rows
    of a run prepared again with committed partitions (its arrays' length), which the
    inputs must make again: refused before any write otherwise."""
    if committed_rows is not None and plan.total_rows != committed_rows:
        raise _changed(run, f"its inputs now make {plan.total_rows:,} rows of tokens where "
                            f"the run, whose partitions are committed, holds "
                            f"{committed_rows:,}")
    for name in pack_group.token_array_names(spec):
        open_token_array(run, name, plan.total_rows, spec)
    return plan


def write_partition(run: run_dir.RunDir, spec: runspec_lib.RunSpec, plan: partition_lib.WritePlan,
                    reader: assemble.UnitReader, partition_id: int,
                    separator_id: int | None, arrays: dict | None = None,
                    in_flight: list | None = None, submit: Callable | None = None,
                    committed: bool = False, check_only: bool = False) -> dict | None:
    """Writes one partition (one object per token array) and its doc table: the documents
    that start in it, in doc_index order, from the tokenized units in its rows.

    Returns {"partition", "rows", "tokens", "docs", "full_context_tokens"} and `doc_runs`'
    columns, checked by `partition.partitions`. arrays: the token arrays opened so far
    (name -> array), to reuse across the partitions of one writer. in_flight: where to
    leave this partition's writes unfinished (the caller waits for them: `finish_writes`),
    so tensorstore compresses and writes one partition while the next is filled; by
    default they are waited for here. submit: runs the doc table's write in the background
    (an executor's `submit`), its future joining `in_flight`. committed: the partition is
    committed (a run prepared again): each array's stored rows are read first and written
    only where they cannot be read (damaged); rows that read otherwise are refused
    (TokensChangedError). check_only: that check alone, nothing written (returns None): the
    pipeline checks every committed partition before any partition is written. A token
    array an actx before 0.3.0 wrote (no chunk checksums: a damaged chunk reads as other
    tokens) is not compared, and written as before.
    """
    start, count = plan.run.partition_range(partition_id)
    block, doc_rows = assemble.fill_partition(spec, plan, reader, partition_id, separator_id)
    arrays = {} if arrays is None else arrays  # opened arrays, kept by the caller
    for name in block:
        if name not in arrays:
            arrays[name] = open_token_array(run, name, plan.run.total_rows, spec)
    damaged = list(block) if not committed else \
        _damaged_arrays(run, arrays, block, start, count, partition_id)
    if check_only:
        return None
    writes = []
    for name in damaged:
        # The block is never changed once written: tensorstore may keep it, not copy it.
        writes.append(arrays[name][start:start + count].write(
            block[name], can_reference_source_data_indefinitely=True))
    if submit is not None and in_flight is not None:
        writes.append(submit(_write_doc_table, run, partition_id, doc_rows))
    else:
        _write_doc_table(run, partition_id, doc_rows)
    if in_flight is None:
        finish_writes(writes)
    else:
        in_flight.extend(writes)
    tokens = int((block["segment_ids"] > 0).sum())
    full_context = int(((block["context_start"] == 0) & (block["segment_ids"] > 0)).sum())
    return {"partition": partition_id, "rows": count, "tokens": tokens, "docs": len(doc_rows),
            "full_context_tokens": full_context,
            **doc_runs(block["segment_ids"][:, 0], block["positions"][:, 0],
                       spec.packing.seq_len)}


def _damaged_arrays(run: run_dir.RunDir, arrays: dict, block: dict, start: int, count: int,
                    partition_id: int) -> list[str]:
    """The arrays whose stored rows of a committed partition cannot be read (to write
    again); TokensChangedError where rows read other than `block`."""
    damaged = []
    for name, rows in block.items():
        if not chunk_checksums.in_metadata(arrays[name].spec().to_json().get("metadata", {})):
            damaged.append(name)  # the earlier format: a damaged chunk reads, unnoticed
            continue
        try:
            with store_errors.tensorstore_errors(run.uri_of(layout.token_array_key(name))):
                # Read strictly: the writer's array would read a lost object (every chunk
                # of this format is stored) as fill values, taken for changed inputs.
                reader = ts_context.strict_reader(arrays[name])
                stored = reader[start:start + count].read().result()
        except Exception as e:  # noqa: BLE001 - a store's refusal is raised as it is
            if isinstance(e, store_errors.StoreError) or not chunk_checksums.is_damage(e):
                raise
            damaged.append(name)
            continue
        if not np.array_equal(stored, rows):
            row = int(np.flatnonzero((stored != rows).any(axis=1))[0])
            raise _changed(run, f"partition {layout.partition_name(partition_id)} is "
                                f"committed, but the inputs now make other tokens for its "
                                f"rows ({name} differs first at row {start + row:,})")
    _check_against_markers(run, arrays, {name: block[name] for name in damaged},
                           partition_id)
    return damaged


def _check_against_markers(run: run_dir.RunDir, arrays: dict, rows: dict,
                           partition_id: int) -> None:
    """Rows of a committed partition about to be written where they cannot be read (or an
    earlier actx's arrays, which are written whole), against what its extractions read:
    each commit marker's token_checksums (schemas.commit). TokensChangedError where the
    inputs make other tokens than an extraction's activations were computed on. A marker
    without them (an earlier worker's), or one that cannot be read (verify says so), has
    nothing to compare."""
    names = [name for name in rows if name in commit_lib.MODEL_INPUTS]
    if not names:
        return
    for extraction in run.extraction_names():
        try:
            marker = commit_lib.read_marker(run.extraction(extraction).store, partition_id)
        except ValueError:
            continue
        if marker is None or not marker.token_checksums:
            continue
        for name in names:
            sums = marker.token_checksums.get(name, ())
            values = np.asarray(rows[name], dtype=arrays[name].dtype.numpy_dtype)
            for k, crc in enumerate(sums):
                lo = k * marker.block_rows
                if commit_lib.array_checksum(values[lo:lo + marker.block_rows]) != crc:
                    first = marker.row_start + lo
                    whose = f"extraction {extraction!r}" if extraction else "the run"
                    raise _changed(
                        run, f"partition {layout.partition_name(partition_id)} is committed "
                             f"and its {name} rows cannot be read; the inputs now make other "
                             f"tokens for rows {first:,}-"
                             f"{first + len(values[lo:lo + marker.block_rows]) - 1:,} than "
                             f"{whose}'s activations were computed on (its commit marker's "
                             f"token checksums)")


def doc_runs(first_segment_ids: np.ndarray, first_positions: np.ndarray,
             seq_len: int) -> dict[str, int]:
    """The manifest's columns on documents running through consecutive rows
    (manifest.Partition's `longest_doc_rows`, `continued_doc_rows`, `continued_from_rows`),
    from each row's column 0: a row continues the document of the row before when it holds
    a document token there at a position > 0 (the workers' rule, workers.loop.prefetch's
    continuation_flags; workers.loop.schedule.chains counts the rows before from the first
    row's position as here)."""
    continues = (np.asarray(first_segment_ids) > 0) & (np.asarray(first_positions) > 0)
    if continues.size == 0:
        return {"longest_doc_rows": 0, "continued_doc_rows": 0, "continued_from_rows": 0}
    # Each row not continuing starts a run; a run's length is the distance to the next start.
    starts = np.union1d([0, continues.size], np.flatnonzero(~continues))
    runs = np.diff(starts)
    continued = bool(continues[0])
    return {"longest_doc_rows": int(runs.max()),
            "continued_doc_rows": int(runs[0]) if continued else 0,
            "continued_from_rows": int(first_positions[0]) // seq_len if continued else 0}


# json.dumps(r, sort_keys=True) builds an encoder per call; one shared encoder writes the
# same bytes.
_DOC_ROW_ENCODER = json.JSONEncoder(sort_keys=True)


def _write_doc_table(run: run_dir.RunDir, partition_id: int, doc_rows: list[dict]) -> None:
    encode = _DOC_ROW_ENCODER.encode
    run.store.write(layout.docs_key(partition_id), "".join(
        encode(r) + "\n" for r in doc_rows).encode())


def finish_writes(writes: list) -> None:
    """Waits for array writes (raising the first failure, a store's refusal as one
    StoreError); empties the list."""
    with store_errors.tensorstore_errors():
        for write in writes:
            write.result()
    writes.clear()


def rejects_key(source_name: str) -> str:
    return f"{layout.REJECTS_PREFIX}{source_name}-00000.jsonl"


def write_rejects(run: run_dir.RunDir, source_name: str, rejects: list) -> dict:
    """All rejects of one source, in input order, as one JSONL object."""
    ordered = sorted(rejects, key=lambda r: r.record_key)
    run.store.write(rejects_key(source_name), b"".join(
        json.dumps(r.to_json_obj(), sort_keys=True, ensure_ascii=False).encode() + b"\n"
        for r in ordered))
    reasons: dict[str, int] = {}
    for r in ordered:
        kind = layout.reject_kind(r.reason)
        reasons[kind] = reasons.get(kind, 0) + 1
    return {"source": source_name, "rejected": len(ordered), "reasons": reasons}


def write_summary(run: run_dir.RunDir, plan: partition_lib.RunPlan, written: list[dict],
                  reject_stats: list[dict]) -> dict:
    """Checks the written partitions against the plan and stages the summary."""
    summary = {
        "total_rows": plan.total_rows,
        "partitions": [dataclasses.asdict(p) for p in partition_lib.partitions(plan, written)],
        "sources": {name: dataclasses.asdict(c)
                    for name, c in partition_lib.source_counts(plan, reject_stats).items()},
        "arc_tasks": list(plan.arc_tasks),
        "docs": plan.total_docs,
        "reject_reasons": {s["source"]: s["reasons"] for s in sorted(
            reject_stats, key=lambda s: s["source"])},
    }
    run.store.write_json(SUMMARY_KEY, summary)
    return summary
