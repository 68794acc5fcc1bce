"""Work units smaller than a file: planning (bounded bytes, never across a pack group),
reading (the records of the whole file), the same run whatever the unit size, and no
element larger than a small bound crossing a stage boundary on the multi-process runner."""

import importlib
import json
import os

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from apache_beam.coders import typecoders

from actx.pipeline import main, pack_group, sample_data, sources, units
from actx.schemas import layout, runspec as R
from tests.pipeline_fixtures import size_checking_coder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(root):
    """A parquet file of 5 row groups (one long document, one null text) and a JSONL file
    with blank lines, rejects, lines longer than a unit and no final newline."""
    rows = sample_data.make_fineweb_rows(230, 4)
    rows[9]["text"] = " ".join(r["text"] for r in rows[:25])
    rows[17]["text"] = None
    parquet = os.path.join(root, "fw.parquet")
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=50)
    jsonl = os.path.join(root, "long.jsonl")
    with open(jsonl, "w") as f:
        for i in range(160):
            if i % 31 == 4:
                f.write("not json\n")
            elif i % 29 == 2:
                f.write("   \n")
            elif i % 40 == 7:
                f.write(json.dumps({"text": f"long {i} " + "word " * 900}) + "\n")
            else:
                f.write(json.dumps({"text": f"doc {i} " + "tok " * (i % 37)}) + "\n")
        f.write(json.dumps({"text": "the last line has no newline"}))
    return parquet, jsonl


def _spec(tok, parquet, jsonl, mode="segmented", max_docs=None):
    return R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(tok, add_eos=True),
                     (R.SourceSpec("fineweb", (parquet,), name="fw", max_docs=max_docs),
                      R.SourceSpec("text", (jsonl,), name="t", max_docs=max_docs)),
                     packing=R.PackingSpec(mode, 64, max_context=256),
                     layout=R.LayoutSpec(rows_per_shard=2, partition_rows=4))


def _tree(run):
    out = {}
    for d, _, files in os.walk(run):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.relpath(os.path.join(d, name), run)] = f.read()
    return out


def test_line_units_are_bounded_and_read_the_whole_file(tmp_path, qwen_tokenizer_dir,
                                                        monkeypatch):
    monkeypatch.setattr(pack_group, "GROUP_LINES", 64)
    parquet, jsonl = _inputs(str(tmp_path))
    spec = _spec(qwen_tokenizer_dir, parquet, jsonl, max_docs=10 ** 6)
    planned = units.plan_units(spec, 1, jsonl, max_bytes=3000)
    size = os.path.getsize(jsonl)
    assert planned[0].byte_start == 0 and planned[-1].byte_stop == size
    for a, b in zip(planned, planned[1:]):
        assert a.byte_stop == b.byte_start and a.stop == b.first
    with open(jsonl, "rb") as f:
        data = f.read()
    for u in planned:
        lines = data[u.byte_start:u.byte_stop].rstrip(b"\n").split(b"\n")
        assert u.byte_stop - u.byte_start <= 3000 or len(lines) == 1  # one long line
        assert len(lines) == u.stop - u.first
        assert u.first // 64 == (u.stop - 1) // 64  # never across a pack group
    assert len(planned) > 10
    whole = list(sources.read_file(1, spec.sources[1], "t", jsonl))
    assert [r for u in planned for r in units.read_unit(spec, u)] == whole
    assert sum(u.records for u in planned) == len(whole)  # the max_docs count, per unit


def test_parquet_units_split_row_groups(tmp_path, qwen_tokenizer_dir, monkeypatch):
    monkeypatch.setattr(pack_group, "GROUP_LINES", 64)
    parquet, jsonl = _inputs(str(tmp_path))
    spec = _spec(qwen_tokenizer_dir, parquet, jsonl)
    planned = units.plan_units(spec, 0, parquet, max_bytes=4000)
    assert {u.row_group for u in planned} == set(range(5))
    assert len(planned) > 5 and [u.first for u in planned[1:]] == [u.stop for u in planned[:-1]]
    assert all(u.first // 64 == (u.stop - 1) // 64 for u in planned)
    whole = list(sources.read_file(0, spec.sources[0], "fw", parquet))
    assert [r for u in planned for r in units.read_unit(spec, u)] == whole
    assert [r for u in planned for r in units.read_unit(spec, u, limit=1)] == [
        next(r for r in whole if r.line == u.first) for u in planned]


def test_parquet_units_join_small_row_groups(tmp_path, qwen_tokenizer_dir, monkeypatch):
    """Row groups smaller than a unit are joined: a unit holds about max_bytes of rows
    (measured by the row groups' sizes in the footer), spans row groups, still ends at a
    pack group's end, and reads as the file does."""
    monkeypatch.setattr(pack_group, "GROUP_LINES", 128)
    parquet, jsonl = _inputs(str(tmp_path))
    spec = _spec(qwen_tokenizer_dir, parquet, jsonl)
    meta = pq.ParquetFile(parquet).metadata
    row_bytes = [meta.row_group(g).total_byte_size / meta.row_group(g).num_rows
                 for g in range(meta.num_row_groups) for _ in range(meta.row_group(g).num_rows)]
    max_bytes = 3 * max(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    planned = units.plan_units(spec, 0, parquet, max_bytes=max_bytes // 2)
    assert [u.first for u in planned[1:]] == [u.stop for u in planned[:-1]]
    assert planned[0].first == 0 and planned[-1].stop == len(row_bytes) == 230
    assert any(u.first // 50 != (u.stop - 1) // 50 for u in planned)  # across row groups
    assert all(sum(row_bytes[u.first:u.stop]) <= max_bytes // 2 + 1e-6 for u in planned)
    assert all(u.first // 128 == (u.stop - 1) // 128 for u in planned)
    whole = list(sources.read_file(0, spec.sources[0], "fw", parquet))
    assert [r for u in planned for r in units.read_unit(spec, u)] == whole
    # Without a byte bound only the pack groups cut the file.
    assert [(u.first, u.stop, u.row_group, u.group_row)
            for u in units.plan_units(spec, 0, parquet, max_bytes=1 << 30)] == [
        (0, 128, 0, 0), (128, 230, 2, 28)]


@pytest.mark.parametrize("mode,max_docs", [("segmented", None), ("concat", 150)])
def test_units_smaller_than_a_file_prepare_the_same_run(tmp_path, qwen_tokenizer_dir, mode,
                                                        max_docs):
    """Tokens, rows, positions, doc tables, rejects and manifest of a prepare in units of
    2 KB equal those of one unit per file."""
    parquet, jsonl = _inputs(str(tmp_path))
    spec = _spec(qwen_tokenizer_dir, parquet, jsonl, mode, max_docs)
    assert len(units.plan_units(spec, 0, parquet, 2000)) > 5
    assert len(units.plan_units(spec, 1, jsonl, 2000)) > 5
    one = main.run_prepare(spec, str(tmp_path / "one"), max_reject_fraction=0.5,
                           unit_bytes=1 << 30)
    small = main.run_prepare(spec, str(tmp_path / "small"), max_reject_fraction=0.5,
                             unit_bytes=2000)
    assert one == small and one.total_rows > 20
    assert _tree(str(tmp_path / "one")) == _tree(str(tmp_path / "small"))
    assert not [k for k in _tree(str(tmp_path / "small")) if k.startswith(
        ("prepare/units/", "prepare/progress/"))]  # the unit tokens are gone


ELEMENT_BOUND = 8 << 10


def test_no_large_element_crosses_a_stage_boundary(tmp_path, qwen_tokenizer_dir, monkeypatch):
    """On the multi-process runner, with every untyped element encoded by a coder that
    refuses more than ELEMENT_BOUND bytes, prepare runs through, although one unit's tokens
    alone are larger: tokens never travel between stages. The same coder does stop a run
    whose bound is below its summaries."""
    parquet, jsonl = _inputs(str(tmp_path))
    spec = _spec(qwen_tokenizer_dir, parquet, jsonl)
    registry = beam.coders.registry
    fallback = registry._fallback_coder
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.setattr(registry, "_fallback_coder", typecoders.FirstOf(
        [size_checking_coder(ELEMENT_BOUND), fallback]))
    run = str(tmp_path / "run")
    m = main.run_prepare(spec, run, ["--direct_num_workers=2",
                                     "--direct_running_mode=multi_processing"],
                         max_reject_fraction=0.5, unit_bytes=20000)
    assert m.total_tokens * 4 > 10 * ELEMENT_BOUND  # the token data, 13x the bound
    monkeypatch.setattr(registry, "_fallback_coder", fallback)
    reference = str(tmp_path / "reference")
    main.run_prepare(spec, reference, max_reject_fraction=0.5)
    assert _tree(run) == _tree(reference)
    # The largest unit's tokens would not have passed the bound.
    from actx.pipeline import unit_tokens
    tokens, _ = unit_tokens.tokenize_unit(
        importlib.import_module("actx.pipeline.tokenize").load_tokenizer(qwen_tokenizer_dir), spec,
        units.plan_units(spec, 0, parquet, 20000)[0], None, [])
    assert len(tokens.to_bytes()) > ELEMENT_BOUND
    monkeypatch.setattr(registry, "_fallback_coder", typecoders.FirstOf(
        [size_checking_coder(200), fallback]))
    with pytest.raises(Exception, match="element crossing a stage boundary"):
        main.run_prepare(spec, str(tmp_path / "tight"), max_reject_fraction=0.5,
                         unit_bytes=20000)


def test_a_run_without_arc_sources_has_no_arc_arrays_and_selects_the_same(reader_run,
                                                                          tmp_path):
    """Provenance selections on a run whose ARC arrays are absent behave as if they held
    -1 everywhere: ARC filters select nothing, other filters select what they did."""
    import shutil

    from actx import reader

    copy = str(tmp_path / "no-arc")
    shutil.copytree(reader_run.uri, copy)
    for name in layout.ARC_ARRAYS:
        shutil.rmtree(os.path.join(copy, "tokens", name))
    full, bare = reader.open_run(reader_run.uri), reader.open_run(copy)
    assert len(full.select("embed", arc_variant=1)) > 0
    for filters in ({"arc_variant": 1}, {"arc_part": "assistant", "whole_document": True},
                    {"arc_grid": "test_input", "cells_only": True}):
        assert len(bare.select("embed", **filters)) == 0
    # A filter on an array that is there still selects: every token saw its document.
    import tensorstore as ts

    context = ts.open({"driver": "zarr3", "kvstore": {
        "driver": "file", "path": os.path.join(copy, "tokens", "context_start") + "/"}}).result()
    segments = reader_run.tokens["segment_ids"]
    context.write(np.where(segments > 0, 0, -1).astype(np.int32)).result()
    sel = reader.open_run(copy).select("embed", whole_document=True)
    want = (segments > 0) & reader_run.committed_mask()
    assert len(sel) > 0 and np.array_equal(sel.rows * segments.shape[1] + sel.cols,
                                           np.flatnonzero(want))
    assert len(reader.open_run(copy).select("embed", whole_document=True, arc_variant=0)) == 0


def test_progress_lines_while_preparing(tmp_path, qwen_tokenizer_dir, caplog):
    """Progress lines at the interval, the last one with every document, token and file."""
    import logging
    import re

    parquet, jsonl = _inputs(str(tmp_path))
    caplog.set_level(logging.INFO, logger="actx.prepare")
    m = main.run_prepare(_spec(qwen_tokenizer_dir, parquet, jsonl), str(tmp_path / "run"),
                         max_reject_fraction=0.5, unit_bytes=3000, progress_interval_s=0.05)
    lines = [r.getMessage() for r in caplog.records if "tokens tokenized" in r.getMessage()]
    assert len(lines) >= 2
    docs, tokens, done, total, written = map(int, re.match(
        r"prepare: (\d+) docs (\d+) tokens tokenized \(.*\); files (\d+)/(\d+) done; "
        r"(\d+) partition", lines[-1].replace(",", "")).groups())
    assert (docs, tokens, done, total, written) == (
        sum(p.docs for p in m.partitions), m.total_tokens, 2, 2, len(m.partitions))
