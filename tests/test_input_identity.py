"""What a source's inputs are, read as written or refused by name: a directory's files
(data in any case of extension; a compressed or other unreadable file refused before any
work, with a glob that reads the rest; anything else named as not read), a JSON object
that writes a key actx reads twice (JSON keeps the last value unsaid: a document's text
or id silently replaced), a parquet id that is not UTF-8 (read with U+FFFD in its place),
and a doc_id that names several documents (the reader refuses it and lists them by
doc_index, the key that names one)."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from actx import reader
from actx.pipeline import fileio, preflight, sources
from actx.schemas import layout, manifest, runspec, store
from tests import reader_fixtures as rf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source(*paths: str, **settings) -> runspec.SourceSpec:
    return runspec.RunSpec.from_dict({
        "model": {"path": "unused"}, "tokenizer": {"path": "unused"},
        "sources": [{"kind": "text", "paths": list(paths), **settings}],
        "packing": {"mode": "segmented", "seq_len": 32}}).sources[0]


def _prepare(tmp_path, tokenizer, *paths: str, run: str = "run"):
    args = [x for p in paths for x in ("--text", p)]
    return subprocess.run(
        [sys.executable, "-m", "actx.pipeline.main", "--out", str(tmp_path / run),
         "--tokenizer", tokenizer, *args, "--seq-len", "32", "--runner=FnApiRunner"],
        cwd=REPO, text=True, capture_output=True, timeout=300)


def _line(text: str) -> str:
    return json.dumps({"text": text}) + "\n"


def test_a_directory_reads_any_case_refuses_what_it_cannot_read_and_names_the_rest(
        tmp_path, qwen_tokenizer_dir):
    data = tmp_path / "data"
    (data / "en").mkdir(parents=True)
    (data / "en" / "part-0.jsonl").write_text(_line("nested lower case"))
    (data / "PART-1.JSONL").write_text(_line("upper-case extension"))
    (data / "part-2.Parquet").write_bytes(_parquet({"text": [b"a parquet row"]}))
    (data / "README.md").write_text("# about this data\n")
    (data / "_SUCCESS").write_text("")
    skipped: list[str] = []
    found = fileio.expand_path(str(data), skipped)
    assert [os.path.relpath(f, data) for f in found] == [
        "PART-1.JSONL", "en/part-0.jsonl", "part-2.Parquet"]
    assert skipped == [str(data / "README.md")]  # a hidden file is not named
    assert preflight.format_problem(_source(str(data)), found) == ""
    # A compressed shard beside them: refused before any work (it was left out unsaid).
    with gzip.open(data / "en" / "part-3.jsonl.gz", "wt") as f:
        f.write(_line("a compressed shard"))
    proc = _prepare(tmp_path, qwen_tokenizer_dir, str(data))
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said
    [error] = [x for x in said.splitlines() if "error:" in x]
    assert (f"{data}/en/part-3.jsonl.gz: a gz file is not a format actx reads" in error
            and "convert it" in error), error
    assert not (tmp_path / "run").exists()
    # Its advice followed as printed: the glob it names reads the directory's other files
    # of that format (the nested one included), and prepare finishes.
    [glob] = re.findall(r"name the files to read with a glob in the source's paths, "
                        r"e\.g\. '([^']+)'", error)
    assert glob == f"{data}/**/*.jsonl", error
    proc = _prepare(tmp_path, qwen_tokenizer_dir, glob)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = manifest.read_manifest(store.open_store(str(tmp_path / "run")))
    assert (m.docs_read, m.docs_accepted) == (1, 1)  # the lower-case .jsonl: a glob's case
    # Without the compressed shard the directory is read whole, README named as not read.
    os.remove(data / "en" / "part-3.jsonl.gz")
    proc = _prepare(tmp_path, qwen_tokenizer_dir, str(data), run="run2")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert (f"1 file(s) in the sources' directories are not data (data files end in "
            f".parquet, .jsonl, .ndjson, .json, .txt) and are not read: {data}/README.md"
            in said), said
    m = manifest.read_manifest(store.open_store(str(tmp_path / "run2")))
    assert (m.docs_read, m.docs_accepted, m.docs_rejected) == (3, 3, 0)


def test_a_gcs_directory_is_listed_by_the_same_rule(gcs_bucket):
    from actx.schemas import gcs_store, uri

    loc = uri.parse(f"{gcs_bucket}/inputs")
    bucket = gcs_store.gcs_client().bucket(loc.bucket)
    for name, data in (("a.jsonl", _line("a")), ("deep/B.TXT", "b\n"),
                       ("c.jsonl.zst", "x"), ("notes.md", "n"), ("deep/.hidden", "h")):
        bucket.blob(f"{loc.path}/{name}").upload_from_string(data)
    skipped: list[str] = []
    found = fileio.expand_path(f"{gcs_bucket}/inputs", skipped)
    root = f"{gcs_bucket}/inputs"
    assert found == [f"{root}/a.jsonl", f"{root}/c.jsonl.zst", f"{root}/deep/B.TXT"]
    assert skipped == [f"{root}/notes.md"]
    problem = preflight.format_problem(_source(root), found)
    assert problem.startswith(f"{root}/c.jsonl.zst: a zst file is not a format actx reads")
    # gs:// globs match across folders with one *: the advice's glob says so.
    assert f"e.g. '{root}/*.jsonl'" in problem, problem
    assert fileio.expand_path(f"{root}/*.jsonl") == [f"{root}/a.jsonl"]


@pytest.mark.parametrize("name", ["lines.jsonl", "array.json"])
def test_a_key_written_twice_is_a_reject_not_its_last_value(tmp_path, name):
    objects = [
        '{"id": "a", "text": "the real document", "text": ""}',
        '{"id": "b", "text": "kept", "id": "another id"}',
        '{"id": "c", "text": "a nested key is no duplicate", "meta": {"text": "x", "id": 1}}',
        '{"id": "d", "text": "plain"}',
    ]
    path = tmp_path / name
    path.write_text("\n".join(objects) + "\n" if name.endswith(".jsonl")
                    else "[" + ",\n".join(objects) + "]")
    records = list(sources.read_file(0, _source(str(path)), "s", str(path)))
    docs = [(r.doc_id, r.text) for r in records if isinstance(r, sources.TextRecord)]
    assert docs == [("c", "a nested key is no duplicate"), ("d", "plain")]
    rejects = [(r.line, r.reason) for r in records if isinstance(r, sources.Reject)]
    first = 1 if name.endswith(".jsonl") else 0  # lines from 1, array elements from 0
    where = "line's" if name.endswith(".jsonl") else "element's"
    assert rejects == [
        (first, f"duplicate key ['text'] in the {where} object - JSON keeps its last value "
                f"unsaid; keep one"),
        (first + 1, f"duplicate key ['id'] in the {where} object - JSON keeps its last "
                    f"value unsaid; keep one")]
    # A key actx does not read may repeat (JSON's last value is nobody's document).
    assert sources.repeated_keys(sources.parse_json('{"text": "t", "x": 1, "x": 2}'),
                                 ("text", "id")) == []
    assert sources.parse_json(objects[0]) == json.loads(objects[0])  # JSON's own value


def _parquet(columns: dict) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({k: pa.array(v, pa.binary()) for k, v in columns.items()}), out)
    return out.getvalue()


def test_a_parquet_id_or_text_that_is_not_utf8_is_a_reject_that_names_its_column(tmp_path):
    path = tmp_path / "rows.parquet"
    path.write_bytes(_parquet({"id": [b"caf\xe9-1", b"ok-2", b"ok-3"],
                               "text": [b"valid text", b"caf\xe9 au lait", b"fine"]}))
    records = list(sources.read_file(0, _source(str(path)), "s", str(path)))
    assert [(r.doc_id, r.text) for r in records if isinstance(r, sources.TextRecord)] == [
        ("ok-3", "fine")]
    rejects = {r.line: r.reason for r in records if isinstance(r, sources.Reject)}
    assert rejects == {
        0: "invalid UTF-8, the value is cp1252: in field 'id' at byte 3 (0xe9); write column "
           "'id' as UTF-8 where the parquet file is made (its cp1252 bytes decoded, e.g. "
           "value.decode('cp1252'))",
        1: "invalid UTF-8, the value is cp1252: in field 'text' at byte 3 (0xe9); write "
           "column 'text' as UTF-8 where the parquet file is made (its cp1252 bytes "
           "decoded, e.g. value.decode('cp1252'))"}
    # The advice is not iconv, which would damage the binary file.
    assert not any("iconv" in r for r in rejects.values())


def test_files_of_one_name_in_two_folders_keep_both_documents_and_their_files(
        tmp_path, qwen_tokenizer_dir):
    for lang, text in (("en", "hello there"), ("fr", "bonjour tout le monde")):
        (tmp_path / "data" / lang).mkdir(parents=True)
        (tmp_path / "data" / lang / "part-0.jsonl").write_text(_line(text))
    proc = _prepare(tmp_path, qwen_tokenizer_dir, str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = store.open_store(str(tmp_path / "run"))
    docs = [json.loads(line) for line in s.read(layout.docs_key(0)).decode().splitlines()]
    assert [(d["doc_id"], os.path.relpath(d["file"], tmp_path / "data"), d["line"])
            for d in docs] == [("part-0.jsonl:1", "en/part-0.jsonl", 1),
                               ("part-0.jsonl:1", "fr/part-0.jsonl", 1)]


def test_a_doc_id_of_several_documents_is_refused_with_each_doc_index(tmp_path):
    truth = rf.build_run(str(tmp_path / "run"))
    s = store.open_store(truth.uri)
    # Two documents of committed partitions given one id, as the data's own id column or
    # two files of one name in two folders give them.
    tables = {p: [json.loads(x) for x in s.read(layout.docs_key(p)).decode().splitlines()]
              for p in (0, 1)}
    first, second = tables[0][1], tables[1][0]
    for doc in (first, second):
        doc["doc_id"] = "shared"
    second["file"] = "fr/synthetic.jsonl"
    for p, docs in tables.items():
        s.write(layout.docs_key(p), "".join(json.dumps(d) + "\n" for d in docs).encode())
    run = reader.open_run(truth.uri)
    with pytest.raises(reader.AmbiguousDocumentError) as refused:
        run.document("shared", ["embed"])
    said = str(refused.value)
    assert said == (
        f"{run.location}: doc_id 'shared' names 2 documents of the committed partitions: "
        f"doc_index {first['doc_index']} (synthetic.jsonl line {first['line']}); doc_index "
        f"{second['doc_index']} (fr/synthetic.jsonl line {second['line']}); ask for one by "
        f"its doc_index, e.g. run.document({first['doc_index']})"), said
    assert isinstance(refused.value, KeyError)  # as an unknown id is
    # The doc_index it names reads that document: its tokens by tokens/doc_index.
    for doc in (first, second):
        sel = run.document(doc["doc_index"], ["embed"])
        r, c = np.nonzero(truth.tokens["doc_index"] == doc["doc_index"])
        np.testing.assert_array_equal(sel.rows, r)
        np.testing.assert_array_equal(sel.cols, c)
        np.testing.assert_array_equal(sel.acts["embed"], truth.value("embed", r, c))
    # An id of one document still reads it.
    other = tables[0][0]
    assert run.document(other["doc_id"]).meta["doc_index"] == other["doc_index"]


def test_an_arc_directory_refuses_a_compressed_task_file_by_name(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "007bbfb7.json").write_text("{}")
    (tmp_path / "tasks" / "00d62c1b.json.gz").write_bytes(gzip.compress(b"{}"))
    found = fileio.expand_path(str(tmp_path / "tasks"))
    source = runspec.SourceSpec("arc", (str(tmp_path / "tasks"),))
    assert preflight.format_problem(source, found) == (
        f"{tmp_path}/tasks/00d62c1b.json.gz: a gz file is not a format actx reads; expected "
        f"json (an ARC-AGI task file) or jsonl (one task object per line): convert it, or "
        f"set the source's format if the name misleads; or, to read the directory without "
        f"it, name the files to read with a glob in the source's paths, e.g. "
        f"'{tmp_path}/tasks/*.json'")
    assert fileio.expand_path(f"{tmp_path}/tasks/*.json") == [
        f"{tmp_path}/tasks/007bbfb7.json"]
