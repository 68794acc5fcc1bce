"""Prepare over several files per source: per-file (per pack group) packing, run-wide
numbering that continues across files, the max_docs cut in file order, and global steps
that receive one summary per file or group, never per-document records."""

import json
import os

import numpy as np
import pytest
import zarr
from tokenizers import Tokenizer

from actx.pipeline import main, pack_group, partition, write_store
from actx.schemas import layout, runspec as R

FILES = {"a.jsonl": ["alpha one two three", "alpha four", "alpha five six seven eight"],
         "b.jsonl": ["beta one", None, "beta three and more", "beta four"],
         "c.jsonl": ["gamma one", "gamma two"]}


def _write(root):
    for name, lines in FILES.items():
        with open(os.path.join(root, name), "w") as f:
            f.write("".join((json.dumps({"text": t}) if t else "not json") + "\n"
                            for t in lines))
    with open(os.path.join(root, "d.parquet"), "wb") as f:
        f.write(b"not a parquet file")  # a whole-file reject, when it is read at all
    return os.path.join(root, "*")


def _spec(tok, glob, max_docs=None, mode="segmented"):
    return R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(tok, add_eos=True),
                     (R.SourceSpec("text", (glob,), name="t", max_docs=max_docs),),
                     packing=R.PackingSpec(mode, 8),
                     layout=R.LayoutSpec(rows_per_shard=1, partition_rows=2))


def _read(run, m):
    # A run without ARC sources has no ARC arrays (they would hold -1 only).
    assert sorted(os.listdir(os.path.join(run, "tokens"))) == sorted(
        layout.TOKEN_ARRAYS + ("zarr.json",) * os.path.exists(os.path.join(run, "tokens",
                                                                          "zarr.json")))
    arrays = {n: zarr.open_array(os.path.join(run, "tokens", n), mode="r")[:]
              for n in layout.TOKEN_ARRAYS}
    docs = []
    for p in m.partitions:
        with open(os.path.join(run, layout.docs_key(p.id))) as f:
            docs += [json.loads(line) for line in f]
    return arrays, docs


@pytest.fixture
def recorded(monkeypatch):
    """What the global steps receive (in-process runner: the patch reaches the DoFns)."""
    seen = {"plan": [], "limits": []}
    build_plan, file_limits = partition.build_plan, partition.file_limits

    def plan_spy(spec, summaries):
        seen["plan"].append(list(summaries))
        return build_plan(spec, summaries)

    def limits_spy(spec, counts):
        seen["limits"].append(list(counts))
        return file_limits(spec, counts)

    monkeypatch.setattr(partition, "build_plan", plan_spy)
    monkeypatch.setattr(partition, "file_limits", limits_spy)
    return seen


def test_numbering_continues_across_files(tmp_path, qwen_tokenizer_dir, recorded):
    glob = _write(tmp_path)
    run = str(tmp_path / "run")
    m = main.run_prepare(_spec(qwen_tokenizer_dir, glob), run, max_reject_fraction=0.5)
    arrays, docs = _read(run, m)
    assert m.sources["t"].read == 10 and m.sources["t"].rejected == 2  # b:2 and d.parquet
    assert [d["doc_index"] for d in docs] == list(range(8))
    assert [(os.path.basename(d["file"]), d["line"]) for d in docs] == [
        ("a.jsonl", 1), ("a.jsonl", 2), ("a.jsonl", 3), ("b.jsonl", 1), ("b.jsonl", 3),
        ("b.jsonl", 4), ("c.jsonl", 1), ("c.jsonl", 2)]
    # Each file starts a fresh row (col 0); rows of later files follow on.
    firsts = {}
    for d in docs:
        firsts.setdefault(os.path.basename(d["file"]), (d["first_row"], d["first_col"]))
    a_rows = max(d["first_row"] for d in docs if d["file"].endswith("a.jsonl")) + 1
    assert firsts["a.jsonl"] == (0, 0) and firsts["b.jsonl"] == (a_rows, 0)
    assert firsts["c.jsonl"][1] == 0 and firsts["c.jsonl"][0] > a_rows
    tok = Tokenizer.from_file(os.path.join(qwen_tokenizer_dir, "tokenizer.json"))
    for d in docs:
        mask = arrays["doc_index"] == d["doc_index"]
        text = FILES[os.path.basename(d["file"])][d["line"] - 1]
        assert arrays["input_ids"][mask].tolist() == tok.encode(
            text, add_special_tokens=False).ids + [151643]
        assert arrays["input_ids"][d["first_row"], d["first_col"]] == arrays["input_ids"][mask][0]
    assert (arrays["segment_ids"] > 0).sum() == m.total_tokens
    assert len(m.partitions) > 1 and m.total_rows == arrays["input_ids"].shape[0]
    # The global step got one summary per pack group (here one per file with documents).
    [summaries] = recorded["plan"]
    assert all(isinstance(s, pack_group.GroupSummary) for s in summaries)
    assert sorted(os.path.basename(s.key[1]) for s in summaries) == ["a.jsonl", "b.jsonl",
                                                                     "c.jsonl"]
    assert recorded["limits"] == []  # no max_docs: no counting pass


def test_max_docs_cuts_in_the_middle_of_the_second_file(tmp_path, qwen_tokenizer_dir,
                                                        recorded):
    glob = _write(tmp_path)
    run = str(tmp_path / "run")
    m = main.run_prepare(_spec(qwen_tokenizer_dir, glob, max_docs=5), run,
                         max_reject_fraction=0.5)
    _, docs = _read(run, m)
    # Records in file order: a:1 a:2 a:3 b:1 b:2(reject) | b:3 b:4 c:* d.parquet cut.
    assert (m.sources["t"].read, m.sources["t"].accepted, m.sources["t"].rejected) == (5, 4, 1)
    assert [(os.path.basename(d["file"]), d["line"]) for d in docs] == [
        ("a.jsonl", 1), ("a.jsonl", 2), ("a.jsonl", 3), ("b.jsonl", 1)]
    with open(os.path.join(run, write_store.rejects_key("t"))) as f:
        [reject] = [json.loads(line) for line in f]
    assert reject["file"].endswith("b.jsonl") and reject["line"] == 2
    # The cut was computed from one count per work unit (here one unit per file).
    [counts] = recorded["limits"]
    assert sorted((os.path.basename(p), first, n) for (_, p, first), n in counts) == [
        ("a.jsonl", 1, 3), ("b.jsonl", 1, 4), ("c.jsonl", 1, 2), ("d.parquet", -1, 1)]
    [summaries] = recorded["plan"]
    assert [(os.path.basename(s.key[1]), s.docs) for s in sorted(summaries, key=lambda s: s.key)
            ] == [("a.jsonl", 3), ("b.jsonl", 1)]


def test_pack_groups_split_a_long_file(tmp_path, qwen_tokenizer_dir, monkeypatch, recorded):
    """With GROUP_LINES lines per pack group, one file packs as several groups (each
    starting a fresh row), and the doc_index order is unchanged."""
    monkeypatch.setattr(pack_group, "GROUP_LINES", 2)
    glob = _write(tmp_path)
    run = str(tmp_path / "run")
    m = main.run_prepare(_spec(qwen_tokenizer_dir, glob, mode="concat"), run,
                         max_reject_fraction=0.5)
    arrays, docs = _read(run, m)
    [summaries] = recorded["plan"]
    assert sorted((os.path.basename(s.key[1]), s.key[2]) for s in summaries) == [
        ("a.jsonl", 0), ("a.jsonl", 1), ("b.jsonl", 0), ("b.jsonl", 1), ("b.jsonl", 2),
        ("c.jsonl", 0), ("c.jsonl", 1)]
    assert [d["doc_index"] for d in docs] == list(range(8))
    starts = {(os.path.basename(s.key[1]), s.key[2]): s for s in summaries}
    # concat restarts per group: a group's first document sits at column 0, and only
    # documents followed by another of their group carry a separator.
    for d in docs:
        key = (os.path.basename(d["file"]), d["line"] // 2)
        first_line = min(x["line"] for x in docs if (os.path.basename(x["file"]),
                                                     x["line"] // 2) == key)
        if d["line"] == first_line:
            assert d["first_col"] == 0
    assert (arrays["input_ids"] == 151643).sum() == sum(
        s.docs * 2 - 1 for s in starts.values())  # own EOS per doc + separators
    assert np.array_equal(np.unique(arrays["doc_index"][arrays["doc_index"] >= 0]),
                          np.arange(8))


def test_only_summaries_are_collected_globally(tmp_path, qwen_tokenizer_dir):
    """In the pipeline graph, every global combine (ToList, CombineGlobally) reads the
    output of the per-unit count or of the per-group planner, never documents."""
    import apache_beam as beam
    from apache_beam.pipeline import PipelineVisitor
    from apache_beam.transforms import combiners, core

    from actx.pipeline import beam_pipeline

    spec = _spec(qwen_tokenizer_dir, _write(tmp_path), max_docs=5)
    p = beam.Pipeline()
    beam_pipeline.build(p, spec, str(tmp_path / "run"), [(0, str(tmp_path / "a.jsonl"))], None)
    found = []

    class Visitor(PipelineVisitor):
        def enter_composite_transform(self, node):
            if isinstance(node.transform, (combiners.ToList, core.CombineGlobally)):
                [pcoll] = node.inputs
                found.append((node.full_label.split("/")[0], pcoll.producer.full_label))

    p.visit(Visitor())
    assert sorted(set(found)) == [("AllGroupSummaries", "PlanGroups/ParDo(PlanGroupFn)"),
                                  ("AllUnitCounts", "CountRecords"),
                                  ("AllUnitLayouts", "PlanGroups/ParDo(PlanGroupFn)")]
