"""Text the tokenizer cannot take, through the real `actx prepare` (a subprocess, as a user
types it): each bad document becomes a reject naming its file, its line (or row) and why,
the other documents are prepared, and the run does not abort.

The text of a JSON string may hold a lone surrogate ("\\ud800", valid JSON) that is no
Unicode text: HF's Rust tokenizers refuse it (TypeError) and it cannot be written as UTF-8.
Bytes that are not UTF-8 (in .jsonl, .txt or parquet binary) are refused per line or row;
a JSON array file that is not UTF-8 is one reject of the whole file.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _actx(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "actx.deploy.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _inputs(d) -> list[str]:
    d.mkdir()
    jl = d / "a.jsonl"
    jl.write_bytes(b"\n".join([
        b'{"id": "j1", "text": "a good document"}',
        b'{"id": "j2", "text": "a\\ud800b"}',             # lone high surrogate
        b'{"id": "j3", "text": "caf\xe9 in latin-1"}',     # not UTF-8
        b'{"id": "j4\\udc00", "text": "good text, bad id"}',  # lone low surrogate in the id
        b'{"id": "j5", "text": "paired \\ud83d\\ude00 is fine"}',  # a pair: valid
    ]) + b"\n")
    arr = d / "b.json"
    arr.write_bytes(b'[{"id": "a0", "text": "array doc"}, {"id": "a1", "text": "x\\udfffy"}]')
    txt = d / "c.txt"
    txt.write_bytes(b"plain line one\nbad \xff byte\nplain line three\n")
    par = d / "d.parquet"  # parquet strings cannot hold surrogates; binary can hold bad bytes
    pq.write_table(pa.table({"id": ["p0", "p1"],
                             "text": pa.array([b"parquet doc", b"\xed\xa0\x80 bytes"],
                                              pa.binary())}), par)
    whole = d / "e.json"  # a JSON array that is not UTF-8: one reject of the whole file
    whole.write_bytes(b'[{"id": "w0", "text": "caf\xe9"}]')
    return [str(p) for p in (jl, arr, txt, par, whole)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, qwen_tokenizer_dir):
    t = tmp_path_factory.mktemp("badtext")
    paths = _inputs(t / "in")
    spec = {"name": "badtext", "model": {"path": ""}, "tokenizer": {"path": qwen_tokenizer_dir},
            "sources": [{"kind": "text", "paths": paths}],
            "packing": {"mode": "segmented", "seq_len": 16},
            "layout": {"rows_per_shard": 2, "partition_rows": 4}}
    (t / "spec.json").write_text(json.dumps(spec))
    run = str(t / "run")
    proc = _actx("prepare", "--spec", str(t / "spec.json"), "--out", run,
                 "--max-reject-fraction", "1", "--runner=FnApiRunner")
    return proc, run, paths


def _rejects(run: str) -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(run, "rejects", "*.jsonl"))):
        for line in open(path, encoding="utf-8"):
            r = json.loads(line)
            out[(os.path.basename(r["file"]), r.get("line", r.get("row", -1)))] = r
    return out


def _doc_ids(run: str) -> set[str]:
    ids = set()
    for path in glob.glob(os.path.join(run, "docs", "*.jsonl")):
        ids.update(json.loads(line)["doc_id"] for line in open(path, encoding="utf-8"))
    return ids


def test_prepare_does_not_abort(prepared):
    proc, run, _ = prepared
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert "Traceback" not in said and "TextEncodeInput" not in said, said
    assert "7 rejected" in said, said


def test_each_bad_document_is_a_reject_with_file_line_and_reason(prepared):
    _, run, _ = prepared
    rejects = _rejects(run)
    assert set(rejects) == {("a.jsonl", 2), ("a.jsonl", 3), ("a.jsonl", 4), ("b.json", 1),
                            ("c.txt", 2), ("d.parquet", 1), ("e.json", -1)}
    reason = lambda key: rejects[key]["reason"]  # noqa: E731
    assert reason(("a.jsonl", 2)).startswith(
        "text field 'text' is not valid Unicode (lone surrogate \\ud800 at character 1) - "
        "fix or drop it at the source")
    assert reason(("b.json", 1)).startswith(
        "text field 'text' is not valid Unicode (lone surrogate \\udfff at character 1)")
    assert reason(("a.jsonl", 4)).startswith(
        "field 'id' is not valid Unicode (lone surrogate \\udc00 at character 2)")
    assert reason(("a.jsonl", 3)).startswith("invalid UTF-8, the file is cp1252: at byte 25")
    assert reason(("c.txt", 2)).startswith("invalid UTF-8")
    assert reason(("d.parquet", 1)).startswith("invalid UTF-8") and "'text'" in reason(
        ("d.parquet", 1))
    assert reason(("e.json", -1)).startswith("invalid UTF-8, the file is cp1252")
    # the snippet shows the bad line, its surrogate as an escape (so it could be written)
    assert rejects[("a.jsonl", 2)]["snippet"] == '{"id": "j2", "text": "a\\ud800b"}'
    assert "\\udfff" in rejects[("b.json", 1)]["snippet"]


def test_the_other_documents_are_prepared(prepared):
    _, run, _ = prepared
    assert _doc_ids(run) == {"j1", "j5", "a0", "c.txt:1", "c.txt:3", "p0"}
    manifest = json.load(open(os.path.join(run, "manifest.json")))
    assert manifest["totals"] == {"docs_accepted": 6, "docs_read": 13, "docs_rejected": 7}
    reasons = manifest["sources"]["text0"]["reasons"]
    assert reasons["text field 'text' is not valid Unicode"] == 2
    assert reasons["field 'id' is not valid Unicode"] == 1


def test_hf_tokenizer_refuses_a_lone_surrogate(qwen_tokenizer_dir):
    """Why it must be a reject: the tokenizer itself cannot encode such a str."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(qwen_tokenizer_dir, "tokenizer.json"))
    with pytest.raises(TypeError):
        tok.encode_batch(["a\ud800b"])
