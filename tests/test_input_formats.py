"""Inputs as people have them (issue 66, item 4): a JSON array file (`.json`, or
`format: json`) is read as documents with the JSONL rules for text_field and id_field; a
format that cannot be read is refused before any work in one line naming the format
expected; a file that is not UTF-8 is named so, with the encoding that reads it. The
references are the documents as written here; prepare runs for real (Beam's in-process
runner, the real Qwen2.5 tokenizer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actx.pipeline import preflight, sources, units
from actx.schemas import manifest, runspec, store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [{"body": f"document {i} in an array", "key": f"k{i}"} for i in range(7)]


def _spec(path: str, **source) -> runspec.RunSpec:
    return runspec.RunSpec.from_dict({
        "model": {"path": "unused"}, "tokenizer": {"path": "unused"},
        "sources": [{"kind": "text", "paths": [path], **source}],
        "packing": {"mode": "segmented", "seq_len": 32}})


def _through_units(spec: runspec.RunSpec, path: str):
    """The records as prepare's pipeline reads them: planned into work units, each read."""
    return [r for unit in units.plan_units(spec, 0, path, max_bytes=64)
            for r in units.read_unit(spec, unit)]


@pytest.mark.parametrize("name,fmt", [("docs.json", "auto"), ("docs.data", "json")])
def test_a_json_array_is_read_as_documents_with_the_fields_rules(tmp_path, name, fmt):
    path = str(tmp_path / name)
    with open(path, "w") as f:
        json.dump(DOCS[:3] + [{"other": 1}, "not an object"] + DOCS[3:], f, indent=2)
    spec = _spec(path, text_field="body", id_field="key", format=fmt)
    for records in (list(sources.read_file(0, spec.sources[0], "s", path)),
                    _through_units(spec, path)):
        docs = [r for r in records if isinstance(r, sources.TextRecord)]
        assert [(d.text, d.doc_id) for d in docs] == [(d["body"], d["key"]) for d in DOCS]
        assert [d.line for d in docs] == [0, 1, 2, 5, 6, 7, 8]  # array positions
        rejects = [r for r in records if isinstance(r, sources.Reject)]
        assert [(r.line, r.reason.split(",")[0]) for r in rejects] == [
            (3, "missing text field 'body'"),
            (4, "JSON array element is a str")]
        assert all(r.to_json_obj()["row"] == r.line for r in rejects)
    # Without an id_field value a document is named by its file and position, as JSONL's.
    spec = _spec(path, text_field="body", id_field="none", format=fmt)
    [first, *_] = sources.read_file(0, spec.sources[0], "s", path)
    assert first.doc_id == f"{name}:0"


def test_a_json_file_of_json_lines_still_reads_as_lines(tmp_path):
    path = tmp_path / "lines.json"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    records = list(sources.read_file(0, _spec(str(path), text_field="body").sources[0], "s",
                                     str(path)))
    assert [(r.text, r.line, r.line_kind) for r in records] == [
        (d["body"], i + 1, "line") for i, d in enumerate(DOCS)]


BOM = "\ufeff".encode("utf-8")  # what Notepad and PowerShell put before UTF-8 text


def _arc_task(i: int) -> dict:
    return {"train": [{"input": [[i % 10]], "output": [[(i + 1) % 10]]}],
            "test": [{"input": [[i % 10, 0]], "output": [[0, i % 10]]}]}


BOM_FILES = {
    # name: (file name, its bytes without the mark, source settings)
    "jsonl": ("docs.jsonl", "".join(json.dumps(d) + "\n" for d in DOCS).encode(),
              {"text_field": "body", "id_field": "key"}),
    "txt": ("docs.txt", "".join(d["body"] + "\r\n" for d in DOCS).encode(), {}),
    "json array": ("docs.json", json.dumps(DOCS).encode(),
                   {"text_field": "body", "id_field": "key"}),
    "ARC JSONL": ("tasks.jsonl", "".join(json.dumps({"task_id": f"t{i}", **_arc_task(i)})
                                         + "\n" for i in range(5)).encode(), {"kind": "arc"}),
    "ARC JSON": ("tasks.json", json.dumps({f"t{i}": _arc_task(i) for i in range(3)}).encode(),
                 {"kind": "arc"}),
}


@pytest.mark.parametrize("name", list(BOM_FILES))
def test_a_byte_order_mark_is_not_text(tmp_path, name):
    """A UTF-8 file that begins with a byte-order mark (Windows editors write one) reads
    as the same documents as the file without it: the mark is neither JSON (which refused
    the first line) nor the first document's text (a txt line would begin with U+FEFF,
    which tokenizes). The reference: the same bytes without the mark."""
    file_name, data, source = BOM_FILES[name]
    plain, marked = tmp_path / "plain", tmp_path / "marked"
    plain.mkdir(), marked.mkdir()
    (plain / file_name).write_bytes(data)
    (marked / file_name).write_bytes(BOM + data)

    def documents(path, max_docs=None):
        """Each way prepare reads the file: whole (with max_docs), and planned into work
        units, each read, with the units' count of records (max_docs takes them by it)."""
        spec = _spec(str(path), max_docs=max_docs, **source)
        plan = units.plan_units(spec, 0, str(path), max_bytes=64)
        ways = [list(sources.read_file(0, spec.sources[0], "s", str(path), limit=max_docs)),
                [r for unit in plan for r in units.read_unit(spec, unit)]]
        assert not [r for way in ways for r in way if isinstance(r, sources.Reject)], ways
        found = [[(r.text, r.doc_id) if isinstance(r, sources.TextRecord)
                  else (r.task_id, r.task) for r in way] for way in ways]
        return found, (sum(u.records for u in plan) if max_docs else None)

    (whole, in_units), _ = documents(plain / file_name)
    assert whole == in_units and len(whole) > 2
    assert documents(marked / file_name) == ([whole, whole], None)
    assert documents(marked / file_name, max_docs=2) == ([whole[:2], whole], len(whole))
    assert not any("\ufeff" in str(doc) for doc in whole)
    if name not in ("json array", "ARC JSON"):
        # A first line of the mark alone holds no document, as a blank line does.
        (marked / file_name).write_bytes(BOM + b"\n" + data)
        (whole_after, _), counted = documents(marked / file_name, max_docs=len(whole))
        assert [doc[0] for doc in whole_after] == [doc[0] for doc in whole]
        assert counted == len(whole)


def test_a_txt_line_ends_at_its_line_break_alone(tmp_path):
    """A txt document is its line without the line break ("\n" or "\r\n"): a carriage
    return inside or at the end of the text is text, which tokenizes."""
    path = tmp_path / "lines.txt"
    path.write_bytes(b"a\rb\r\r\n  spaced  \nlast\r")
    spec = _spec(str(path))
    for records in (list(sources.read_file(0, spec.sources[0], "s", str(path))),
                    _through_units(spec, str(path))):
        assert [r.text for r in records] == ["a\rb\r", "  spaced  ", "last"]


def _prepare(tmp_path, qwen_tokenizer_dir, path, *flags):
    return subprocess.run(
        [sys.executable, "-m", "actx.pipeline.main", "--out", str(tmp_path / "run"),
         "--tokenizer", qwen_tokenizer_dir, "--text", str(path), "--seq-len", "32",
         "--runner=FnApiRunner", *flags], cwd=REPO, text=True, capture_output=True,
        timeout=300)


def test_prepare_reads_a_json_array(tmp_path, qwen_tokenizer_dir):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps(DOCS))
    proc = _prepare(tmp_path, qwen_tokenizer_dir, path, "--text-field", "body",
                    "--id-field", "key")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = manifest.read_manifest(store.open_store(str(tmp_path / "run")))
    assert (m.docs_read, m.docs_accepted, m.docs_rejected) == (len(DOCS), len(DOCS), 0)


def _parquet_bytes() -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({"text": ["hello there"], "id": ["k0"]}), out)
    return out.getvalue()


REFUSED = {
    # name: (file name, its bytes, source settings, what the one line must say)
    "a JSON array under format jsonl": (
        "docs.jsonl", json.dumps(DOCS).encode(), {"format": "jsonl"},
        "holds a JSON array, not JSON lines (one object per line); set the source's format "
        "to json"),
    "a csv file": ("docs.csv", b"body,key\nhello,k0\n", {},
                   "a csv file is not a format actx reads; expected jsonl (one JSON object "
                   "per line), json (an array of JSON objects), parquet or txt"),
    "JSON lines under format parquet": (
        "docs.jsonl", b'{"text": "x"}\n', {"format": "parquet"},
        "not a parquet file (it does not start with PAR1); expected format parquet"),
    # Each row was rejected as text that is not UTF-8, not named as what it is.
    "a parquet file named .jsonl": (
        "docs.jsonl", _parquet_bytes(), {},
        "a parquet file (it starts with PAR1), read as jsonl by its name; name it .parquet, "
        "or set the source's format to parquet"),
    # Each line, JSON, was a document of its raw text: the key named was never looked at.
    "text_field on a .txt file": (
        "docs.txt", b'{"body": "hello", "key": "k0"}\n', {"text_field": "body"},
        "read as plain text (one document per line) by its .txt name, which has no field for "
        "text_field 'body' to name; if its lines are JSON objects set the source's format to "
        "jsonl"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_format_that_cannot_be_read_is_refused_before_work(tmp_path, qwen_tokenizer_dir,
                                                             name):
    file_name, data, source, expected = REFUSED[name]
    path = tmp_path / file_name
    path.write_bytes(data)
    spec = _spec(str(path), **source)
    problem = preflight.format_problem(spec.sources[0], [str(path)])
    assert expected in problem and "\n" not in problem, problem
    flags = [x for k, v in source.items() for x in (f"--{k.replace('_', '-')}", v)]
    proc = _prepare(tmp_path, qwen_tokenizer_dir, path, *flags)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said
    [line] = [x for x in said.splitlines() if "error:" in x]
    assert expected in line and str(path) in line, line
    assert not (tmp_path / "run").exists()  # before any work: nothing written


def test_text_field_is_refused_only_where_every_file_is_plain_text(tmp_path):
    """A source of a .txt and a .jsonl file with text_field: the JSON file uses it, the
    text file's lines are its documents; no refusal, whichever file comes first."""
    txt, jsonl = tmp_path / "a.txt", tmp_path / "b.jsonl"
    txt.write_text("a line of text\n")
    jsonl.write_text('{"body": "x"}\n')
    for files in ([str(txt), str(jsonl)], [str(jsonl), str(txt)]):
        source = runspec.SourceSpec("text", tuple(files), text_field="body")
        assert preflight.format_problem(source, files) == ""
    source = runspec.SourceSpec("text", (str(txt),), text_field="body")
    assert "has no field for text_field 'body'" in preflight.format_problem(source, [str(txt)])


def test_arc_tasks_in_parquet_are_refused(tmp_path):
    spec = runspec.SourceSpec("arc", (str(tmp_path / "t.parquet"),))
    problem = preflight.format_problem(spec, [str(tmp_path / "t.parquet")])
    assert "format parquet cannot hold ARC tasks; expected format json" in problem


def test_a_latin1_file_is_named_with_its_encoding(tmp_path, qwen_tokenizer_dir):
    texts = ["café au lait", "naïve résumé", "Zürich über alles"]
    path = tmp_path / "latin.jsonl"
    path.write_bytes("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                             for t in texts).encode("latin-1"))
    records = list(sources.read_file(0, _spec(str(path)).sources[0], "s", str(path)))
    for record, text in zip(records, texts):
        # The encoding named is one that gives back exactly the text written.
        enc = record.reason.split("the file is ")[1].split(":")[0]
        raw = json.dumps({"text": text}, ensure_ascii=False).encode("latin-1")
        assert json.loads(raw.decode(enc))["text"] == text, record.reason
        assert record.reason.startswith("invalid UTF-8, the file is ")
        assert f"iconv -f {enc} -t utf-8" in record.reason
    # The whole file rejected: prepare's refusal names the encoding in its reasons.
    proc = _prepare(tmp_path, qwen_tokenizer_dir, path)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "no input was accepted (3 of 3 rejected)" in said, said
    assert "invalid UTF-8, the file is cp1252: 3" in said, said


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_every_line_of_a_utf16_file_is_named_utf16(tmp_path, encoding):
    """Split at newline bytes, a UTF-16 file's lines after its first have no byte-order
    mark, and NUL bytes decode as UTF-8: each was rejected as malformed JSON (or read as
    text of NULs, or as another document: CJK text), hiding the one cause. Each line now
    names the encoding (a little-endian file's last newline leaves one more, a NUL)."""
    for name, lines in (("u.jsonl", [json.dumps({"text": f"line {i} é"}, ensure_ascii=False)
                                     for i in range(5)]),
                        ("u.txt", [f"line {i} é" for i in range(5)]),
                        ("cjk.txt", ["a title in ASCII: 我在这里", "你好世界", "я здесь", "日本語", "中文"])):
        path = tmp_path / name
        path.write_bytes("".join(line + "\n" for line in lines).encode(encoding))
        records = list(sources.read_file(0, _spec(str(path)).sources[0], "s", str(path)))
        assert len(records) in (5, 6), records  # each line, and the NUL a newline may leave
        for record in records:
            assert record.reason.startswith("invalid UTF-8, the file is utf-16: "), record
            assert "iconv -f utf-16 -t utf-8" in record.reason


def test_utf16_and_binary_are_told_apart():
    raw = '{"text": "hi"}'.encode("utf-16")
    with pytest.raises(UnicodeDecodeError) as e:
        raw.decode("utf-8")
    assert "the file is utf-16" in sources.not_utf8(raw, e.value)
    raw = b"\x00\x01\xff\x02"
    with pytest.raises(UnicodeDecodeError) as e:
        raw.decode("utf-8")
    assert sources.not_utf8(raw, e.value).startswith(
        "invalid UTF-8, not text in cp1252 or latin-1 either")


def test_text_field_and_id_field_are_described_apart():
    """docs/configuration.md (generated from SourceSpec's docstring) says what each does."""
    page = open(os.path.join(REPO, "docs", "configuration.md")).read()
    rows = {line.split("|")[1].strip(" `"): line.split("|")[5].strip()
            for line in page.splitlines() if line.startswith("| `spec.sources[].")}
    text, ident = rows["spec.sources[].text_field"], rows["spec.sources[].id_field"]
    assert text != ident
    assert "text" in text and " id" not in text and "document's id" in ident
