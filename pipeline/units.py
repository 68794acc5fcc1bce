"""Work units: bounded pieces of one input file, planned cheaply and read on their own.

A unit is a block of whole lines (JSONL, text) of at most `max_bytes` bytes, a range of
consecutive parquet rows whose uncompressed size is at most about `max_bytes` (part of a
large row group, or several small ones), or the tasks of an ARC JSON file. A single line longer than `max_bytes` is a unit by itself
(a document is never split). Units never cross a pack group (`pack_group.GROUP_LINES`
lines or rows), so the packing of a group, and so the output, does not depend on how its
lines were cut into units.

Planning reads a parquet file's footer only; a line file is scanned once for newlines, one
window of `max_bytes` at a time. A file that cannot be opened becomes one unit that reads
as its whole-file reject, exactly as `sources.read_file` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterator

import numpy as np

from actx.pipeline import fileio
from actx.pipeline import pack_group
from actx.pipeline import sources
from actx.schemas import runspec as runspec_lib

DEFAULT_UNIT_BYTES = 32 << 20  # text per unit: a few seconds of tokenizing per unit
PARQUET_BATCH_ROWS = 1024
_BLANK = b" \t\n\r\x0b\x0c"  # what bytes.strip() removes: a line of only these is blank


@dataclasses.dataclass(frozen=True)
class WorkUnit:
    """One unit of one file.

    fmt: the file's format, or "unreadable" (error says why; reads as one reject).
    first / stop: the file lines (1-based), parquet rows or ARC JSON tasks it covers.
    byte_start / byte_stop: its bytes (line formats); row_group / group_row: the parquet
    row group and the row inside it where the unit starts (it may run into the next ones). index / units_in_file: its
    place among the file's units (progress). records: what it holds for max_docs
    (documents and rejects alike), -1 when not counted.
    """

    source_index: int
    path: str
    fmt: str
    first: int
    stop: int
    byte_start: int = 0
    byte_stop: int = 0
    row_group: int = -1
    group_row: int = 0
    error: str = ""
    index: int = 0
    units_in_file: int = 1
    records: int = -1

    @property
    def key(self) -> tuple:
        """(source_index, path, first): sorts like the documents it holds."""
        return (self.source_index, self.path, self.first)

    @property
    def group(self) -> tuple:
        return pack_group.group_key(self.key)

    @property
    def unit_id(self) -> str:
        """A name for its objects: unique per (source, file, first line)."""
        digest = hashlib.sha1(self.path.encode()).hexdigest()[:16]
        return f"s{self.source_index:03d}-{digest}-{max(self.first, -1) + 1:012d}"


def _numbered(units: list[WorkUnit]) -> list[WorkUnit]:
    return [dataclasses.replace(u, index=i, units_in_file=len(units))
            for i, u in enumerate(units)]


def _count_nonblank(data: bytes, at_start: bool) -> int:
    """The records `data` holds (its non-blank lines) as sources reads them: at the file's
    start without a byte-order mark."""
    return sum(1 for line in sources.without_bom(data, at_start).split(b"\n") if line.strip())


def _line_units(source_index: int, path: str, fmt: str, f, max_bytes: int,
                count: bool) -> list[WorkUnit]:
    size = fileio.file_size(f)
    units, pos, line = [], 0, 1
    while pos < size:
        allowed = (line // pack_group.GROUP_LINES + 1) * pack_group.GROUP_LINES - line
        window = fileio.read_range(f, pos, min(size, pos + max_bytes))
        newlines = np.flatnonzero(np.frombuffer(window, np.uint8) == 10)
        records = -1
        if len(newlines) >= allowed:  # the pack group ends inside the window
            cut, lines = int(newlines[allowed - 1]) + 1, allowed
        elif pos + len(window) >= size:  # the rest of the file
            cut, lines = len(window), len(newlines) + (0 if window.endswith(b"\n") else 1)
        elif len(newlines):
            cut, lines = int(newlines[-1]) + 1, len(newlines)
        else:  # one line longer than max_bytes: a unit of its own
            cut = len(window)
            nonblank = bool(sources.without_bom(window, pos == 0).strip(_BLANK))
            while pos + cut < size:
                more = fileio.read_range(f, pos + cut, min(size, pos + cut + max_bytes))
                end = more.find(b"\n")
                nonblank = nonblank or bool((more if end < 0 else more[:end]).strip(_BLANK))
                cut += len(more) if end < 0 else end + 1
                if end >= 0:
                    break
            lines, records = 1, int(nonblank)
        if count and records < 0:
            records = _count_nonblank(window[:cut], pos == 0)
        units.append(WorkUnit(source_index, path, fmt, line, line + lines, pos, pos + cut,
                              records=records if count else -1))
        pos, line = pos + cut, line + lines
    return units


def _parquet_units(source_index: int, path: str, f, max_bytes: int) -> list[WorkUnit]:
    """Consecutive rows of about max_bytes uncompressed: a large row group is split, small
    ones are joined (each unit costs a file open, a stored object and a pause of the
    tokenizer), and a unit ends at a pack group's end."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(f).metadata
    units, row, current = [], 0, None  # current: [first row, row group, group row, bytes left]

    def close(stop: int) -> None:
        nonlocal current
        first, row_group, group_row, _ = current
        units.append(WorkUnit(source_index, path, "parquet", first, stop, row_group=row_group,
                              group_row=group_row, records=stop - first))
        current = None

    for rg in range(meta.num_row_groups):
        group = meta.row_group(rg)
        n = group.num_rows
        row_bytes = max(1, group.total_byte_size) / max(1, n)
        r = 0
        while r < n:
            first = row + r
            if current is None:
                current = [first, rg, r, max_bytes]
            fits = int(current[3] // row_bytes)
            if fits == 0 and first > current[0]:  # the unit is full
                close(first)
                continue
            fits = max(fits, 1)  # a row larger than max_bytes is a unit of its own
            to_group_end = (first // pack_group.GROUP_LINES + 1) * pack_group.GROUP_LINES - first
            take = min(fits, n - r, to_group_end)
            full = take < n - r  # the unit ends inside this row group
            r += take
            current[3] -= take * row_bytes
            if full or take == to_group_end:
                close(row + r)
        row += n
    if current is not None:
        close(row)
    return units


def _arc_json_units(source_index: int, source: runspec_lib.SourceSpec, name: str, path: str,
                    f) -> list[WorkUnit]:
    """ARC JSON is one JSON document: every unit parses the file (ARC files are small)
    and reads its block of GROUP_LINES tasks."""
    em = sources.Emitter(source_index, source, name, path, "row")
    return _blocks_of_records(source_index, path, list(sources.read_arc_json(em, f.read(),
                                                                             None)))


def _json_array_units(source_index: int, source: runspec_lib.SourceSpec, name: str,
                      path: str, f) -> list[WorkUnit]:
    """A JSON array of documents is one JSON document: every unit parses the file and
    reads its block of GROUP_LINES elements (as ARC JSON)."""
    em = sources.Emitter(source_index, source, name, path, "row")
    f.seek(0)  # past the head that said it is an array
    return _blocks_of_records(source_index, path, list(sources.read_json(em, f.read(), None)))


def _blocks_of_records(source_index: int, path: str, records: list) -> list[WorkUnit]:
    """The units of a file parsed whole: blocks of GROUP_LINES records, or the one unit of
    its whole-file reject."""
    if records and records[0].line < 0:
        return [WorkUnit(source_index, path, "json", -1, 0, records=1)]
    g = pack_group.GROUP_LINES
    return [WorkUnit(source_index, path, "json", start, min(start + g, len(records)),
                     records=min(g, len(records) - start))
            for start in range(0, len(records), g)]


def plan_units(spec: runspec_lib.RunSpec, source_index: int, path: str,
               max_bytes: int = DEFAULT_UNIT_BYTES) -> list[WorkUnit]:
    """The units of one file, in file order; records counted when the source has max_docs."""
    source = spec.sources[source_index]
    fmt = sources.file_format(source, path)
    count = source.max_docs is not None
    try:
        with fileio.open_input(path) as f:
            if fmt == "parquet":
                units = _parquet_units(source_index, path, f, max_bytes)
            elif fmt == "json" and source.kind == "arc":
                units = _arc_json_units(source_index, source, spec.source_name(source_index),
                                        path, f)
            elif fmt == "json" and sources.is_json_array(fileio.read_range(f, 0, 4096)):
                units = _json_array_units(source_index, source,
                                          spec.source_name(source_index), path, f)
            else:
                units = _line_units(source_index, path, "txt" if fmt == "txt" else "jsonl", f,
                                    max_bytes, count)
    except Exception as e:  # noqa: BLE001 - any failure to open is a whole-file reject
        units = [WorkUnit(source_index, path, "unreadable", -1, 0,
                          error=f"unreadable file: {type(e).__name__}: {e}", records=1)]
    if not count:
        units = [dataclasses.replace(u, records=-1) for u in units]
    return _numbered(units)


def read_unit(spec: runspec_lib.RunSpec, unit: WorkUnit, limit: int | None = None
              ) -> Iterator[sources.TextRecord | sources.ArcTaskRecord | sources.Reject]:
    """The unit's records in file order; limit: at most this many (max_docs)."""
    source = spec.sources[unit.source_index]
    name = spec.source_name(unit.source_index)
    line_kind = "row" if unit.fmt in ("parquet", "json") else "line"
    em = sources.Emitter(unit.source_index, source, name, unit.path, line_kind)
    if unit.fmt == "unreadable":
        yield em.reject(-1, unit.error)
        return
    try:
        with fileio.open_input(unit.path) as f:
            if unit.fmt == "parquet":
                yield from _parquet_unit(em, f, unit, limit)
            elif unit.fmt == "json":
                read = sources.read_arc_json if source.kind == "arc" else sources.read_json
                yield from read(em, f.read(), limit, unit.first, unit.stop)
            else:
                data = fileio.read_range(f, unit.byte_start, unit.byte_stop)
                reader = sources.read_txt if unit.fmt == "txt" else sources.read_jsonl
                yield from reader(em, data, limit, unit.first)
    except Exception as e:
        # The file was readable when planned: a failure now (a corrupt row group, a file
        # changed or removed mid-run) would leave this file's accounting ambiguous.
        raise RuntimeError(f"{unit.path}: reading {unit.fmt} lines/rows {unit.first}.."
                           f"{unit.stop - 1} failed: {type(e).__name__}: {e}; check the file "
                           f"(it must not change while prepare runs)") from e


def _parquet_unit(em, f, unit: WorkUnit, limit: int | None):
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    wanted = sources.parquet_columns(em.source, pf.schema_arrow.names)
    n_rows = unit.stop - unit.first
    row_groups, rows = [], -unit.group_row  # the row groups that hold the unit's rows
    for rg in range(unit.row_group, pf.metadata.num_row_groups):
        if rows >= n_rows:
            break
        row_groups.append(rg)
        rows += pf.metadata.row_group(rg).num_rows

    def batches():
        skip, left = unit.group_row, n_rows
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=row_groups,
                                     columns=wanted):
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            batch = batch.slice(skip, min(left, batch.num_rows - skip))
            skip, left = 0, left - batch.num_rows
            yield batch
            if left <= 0:
                return

    yield from sources.parquet_records(em, batches(), unit.first, limit)
