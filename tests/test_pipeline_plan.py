"""The global steps of prepare see summaries only: per-file record counts (max_docs cut)
and per-pack-group summaries (plan); pack groups are packed alone and placed run-wide."""

import dataclasses

import numpy as np
import pytest

from pipeline import arc_render, pack, pack_group, partition
from pipeline.tokenize import TokenizedDoc
from schemas import layout, manifest as manifest_lib, runspec as R


def _doc(key, n, task=None):
    ids = np.arange(1, n + 1, dtype=np.int32) + 100 * key[2]
    attrs = None if task is None else np.full((len(arc_render.CHAR_ATTRS), n), 2, np.int32)
    return TokenizedDoc(key, ids, attrs, task, key[3], {"doc_id": f"{key[1]}:{key[2]}"})


def _spec(mode="segmented", seq_len=8, partition_rows=2, max_docs=(None, None), **packing):
    return R.RunSpec(R.ModelSpec(""), R.TokenizerSpec("tok"),
                     tuple(R.SourceSpec("text", (f"s{i}",), name=f"s{i}", max_docs=m)
                           for i, m in enumerate(max_docs)),
                     packing=R.PackingSpec(mode, seq_len, **packing),
                     layout=R.LayoutSpec(rows_per_shard=1, partition_rows=partition_rows))


def test_file_limits_cut_each_source_in_file_order():
    spec = _spec(max_docs=(5, 0))
    counts = [((0, "b"), 4), ((0, "a"), 3), ((0, "c"), 5), ((1, "a"), 2)]  # any order
    assert partition.file_limits(spec, counts) == {(0, "a"): 3, (0, "b"): 2, (0, "c"): 0,
                                                   (1, "a"): 0}
    with pytest.raises(ValueError, match="no max_docs"):
        partition.file_limits(_spec(), [((0, "a"), 1)])


def test_group_key_blocks_of_lines_sort_like_documents():
    k = pack_group.GROUP_LINES
    assert pack_group.group_key((0, "f", k - 1, 3)) == (0, "f", 0)
    assert pack_group.group_key((0, "f", k, 0)) == (0, "f", 1)
    keys = [(0, "a", 5, 0), (0, "a", k + 1, 0), (0, "b", 0, 0), (1, "a", 0, 0)]
    assert sorted(keys, key=pack_group.group_key) == keys


def test_pack_group_is_plan_pack_of_its_documents_alone():
    spec = _spec("concat", seq_len=4, separator="eos")
    docs = [_doc((0, "f", line, 0), n) for line, n in ((3, 2), (1, 3), (2, 4))]  # unsorted
    summary, rows = pack_group.pack_group(spec, 9, (0, "f", 0), docs)
    # Stream: d1(3) 9 d2(4) 9 d3(2): the group's last document gets no separator.
    assert summary == pack_group.GroupSummary((0, "f", 0), 3, 3, 3, 11, 0)
    flat = np.concatenate([r.arrays["input_ids"] for r in rows])
    assert flat[:11].tolist() == [101, 102, 103, 9, 201, 202, 203, 204, 9, 301, 302]
    assert [r.row for r in rows] == [0, 1, 2] and all(r.group == (0, "f", 0) for r in rows)
    assert [[d["doc_index"] for d in r.docs] for r in rows] == [[0], [1], [2]]
    assert rows[1].docs[0]["first_col"] == 0 and rows[0].docs[0]["n_tokens"] == 4
    assert set(rows[0].arrays) == set(layout.TOKEN_ARRAYS)  # no ARC arrays shipped
    with pytest.raises(ValueError, match="read twice"):
        pack_group.pack_group(spec, 9, (0, "f", 0), docs + docs[:1])


def test_build_plan_takes_group_summaries_and_prefix_sums_them():
    spec = _spec(partition_rows=2)
    g = pack_group.GroupSummary
    summaries = [g((1, "x", 0), 1, 1, 1, 5, 0, ()),
                 g((0, "b", 0), 2, 4, 3, 20, 1, ("t1", "t2")),
                 g((0, "a", 1), 1, 1, 1, 6, 2, ()),
                 g((0, "a", 0), 3, 3, 2, 12, 0, ("t3",))]
    plan = partition.build_plan(spec, summaries)
    assert plan.groups == {(0, "a", 0): partition.GroupPlacement(0, 0, (2,)),
                           (0, "a", 1): partition.GroupPlacement(2, 3, ()),
                           (0, "b", 0): partition.GroupPlacement(3, 4, (0, 1)),
                           (1, "x", 0): partition.GroupPlacement(6, 8, ())}
    assert (plan.total_rows, plan.total_docs, plan.total_tokens) == (7, 9, 43)
    assert plan.arc_tasks == ("t1", "t2", "t3")
    assert plan.accepted == (6, 1) and plan.truncated_tokens == (3, 0)
    assert plan.n_partitions == 4 and plan.partition_range(3) == (6, 1)
    counts = partition.source_counts(plan, [{"source": "s0", "rejected": 2}])
    assert counts == {"s0": manifest_lib.SourceCounts(8, 6, 2, 3),
                      "s1": manifest_lib.SourceCounts(1, 1, 0, 0)}
    # Its input is summaries: one record per group, nothing per document.
    assert all(dataclasses.fields(s)[0].name == "key" for s in summaries)
    with pytest.raises(ValueError, match="read twice"):
        partition.build_plan(spec, summaries + summaries[:1])


def test_place_row_shifts_rows_docs_and_remaps_tasks():
    spec = _spec("pad", seq_len=4)
    docs = [_doc((0, "f", 1, v), 3, task="tb") for v in (0, 1)] + [_doc((0, "f", 2, 0), 2)]
    summary, rows = pack_group.pack_group(spec, None, (0, "f", 0), docs)
    assert summary.task_ids == ("tb",) and summary.records == 2
    plan = partition.build_plan(spec, [summary, pack_group.GroupSummary(
        (0, "a", 0), 1, 5, 3, 9, 0, ("ta",))])
    placed = [partition.place_row(plan, r) for r in rows]
    assert [(pid, r.row) for pid, r in placed] == [(1, 3), (2, 4), (2, 5)]
    r0 = placed[0][1]
    assert r0.arrays["doc_index"].tolist() == [5, 5, 5, -1]
    assert r0.arrays["arc_task"].tolist() == [1, 1, 1, -1]  # "tb" is task 1 run-wide
    assert r0.arrays["arc_variant"].tolist() == [0, 0, 0, -1]
    assert r0.docs[0]["doc_index"] == 5 and r0.docs[0]["first_row"] == 3
    assert "arc_task" not in placed[2][1].arrays and rows[2].row == 2


def test_partitions_checked_against_plan():
    g = pack_group.GroupSummary
    plan = partition.build_plan(_spec(partition_rows=2), [g((0, "a", 0), 3, 3, 3, 10, 0)])
    ok = [{"partition": 0, "rows": 2, "tokens": 7, "docs": 2, "full_context_tokens": 7},
          {"partition": 1, "rows": 1, "tokens": 3, "docs": 1, "full_context_tokens": 2}]
    assert partition.partitions(plan, ok[::-1]) == (
        manifest_lib.Partition(0, 0, 2, 7, 2, 7), manifest_lib.Partition(1, 2, 1, 3, 1, 2))
    with pytest.raises(RuntimeError, match="not written"):
        partition.partitions(plan, ok[:1])
    with pytest.raises(RuntimeError, match="written twice"):
        partition.partitions(plan, ok + ok[:1])
    with pytest.raises(RuntimeError, match="the plan has"):
        partition.partitions(plan, [ok[0], {**ok[1], "tokens": 4}])


def test_groups_pack_like_one_plan_pack_per_group():
    """Across groups, rows and doc_index continue: placing each group's rows equals packing
    each group alone and stacking the results."""
    spec = _spec("segmented", seq_len=6)
    groups = {(0, "a", 0): [_doc((0, "a", i, 0), n) for i, n in enumerate([3, 2, 4])],
              (0, "b", 0): [_doc((0, "b", i, 0), n) for i, n in enumerate([5, 1])]}
    packed = {k: pack_group.pack_group(spec, None, k, d) for k, d in groups.items()}
    plan = partition.build_plan(spec, [s for s, _ in packed.values()])
    placed = sorted((partition.place_row(plan, r)[1] for _, rows in packed.values()
                     for r in rows), key=lambda r: r.row)
    assert [r.row for r in placed] == list(range(plan.total_rows)) == [0, 1, 2]
    offset = 0
    for key in sorted(groups):
        alone = pack.plan_pack([len(d.token_ids) for d in groups[key]], spec.packing)
        for d, pieces in enumerate(alone.pieces):
            p = pieces[0]
            row = placed[plan.groups[key].first_row + p.row]
            assert row.arrays["doc_index"][p.col] == offset + d
        offset += len(groups[key])
    assert [d["doc_index"] for r in placed for d in r.docs] == list(range(5))
