"""The global steps of prepare see summaries only: per-unit record counts (max_docs cut),
the unit summaries of one pack group, per-group summaries and per-unit placements; a
group packed unit by unit equals the group packed at once, and partitions assembled from
stored units equal the group's rows."""

import dataclasses

import numpy as np
import pytest

from actx.pipeline import assemble, pack, pack_group, partition, unit_tokens, units
from actx.schemas import layout, manifest as manifest_lib, run_dir, runspec as R, store


def _spec(mode="segmented", seq_len=8, partition_rows=2, max_docs=(None, None), **packing):
    return R.RunSpec(R.ModelSpec(""), R.TokenizerSpec("tok"),
                     tuple(R.SourceSpec("text", (f"s{i}",), name=f"s{i}", max_docs=m)
                           for i, m in enumerate(max_docs)),
                     packing=R.PackingSpec(mode, seq_len, **packing),
                     layout=R.LayoutSpec(rows_per_shard=1, partition_rows=partition_rows))


def test_file_limits_cut_each_source_in_file_order():
    spec = _spec(max_docs=(5, 0))
    counts = [((0, "b", 1), 4), ((0, "a", 1), 2), ((0, "a", 9), 1), ((0, "c", 1), 5),
              ((1, "a", 1), 2)]  # per work unit, any order
    assert partition.file_limits(spec, counts) == {(0, "a", 1): 2, (0, "a", 9): 1,
                                                   (0, "b", 1): 2, (0, "c", 1): 0,
                                                   (1, "a", 1): 0}
    with pytest.raises(ValueError, match="no max_docs"):
        partition.file_limits(_spec(), [((0, "a", 1), 1)])


def test_group_key_blocks_of_lines_sort_like_documents():
    k = pack_group.GROUP_LINES
    assert pack_group.group_key((0, "f", k - 1, 3)) == (0, "f", 0)
    assert pack_group.group_key((0, "f", k, 0)) == (0, "f", 1)
    keys = [(0, "a", 5, 0), (0, "a", k + 1, 0), (0, "b", 0, 0), (1, "a", 0, 0)]
    assert sorted(keys, key=pack_group.group_key) == keys


def _unit(path, first, lengths, records=None, tasks=()):
    unit = units.WorkUnit(0, path, "jsonl", first, first + len(lengths))
    return unit_tokens.UnitSummary(unit, len(lengths) if records is None else records,
                                   np.asarray(lengths, np.int32), tasks)


@pytest.mark.parametrize("mode", ["pad", "segmented", "concat"])
def test_plan_group_of_units_is_plan_pack_of_the_whole_group(mode):
    spec = _spec(mode, seq_len=4, separator="eos")
    lengths = [[3, 1, 6], [], [2, 2, 5, 1], [1], []]  # empty units hold only rejects
    summaries = [_unit("f", 10 * i + 1, n, tasks=("t2", "t1") if i == 2 else ())
                 for i, n in enumerate(lengths)]
    summary, layouts = pack_group.plan_group(spec, (0, "f", 0), summaries[::-1])
    whole = pack.plan_pack(sum(lengths, []), spec.packing, 1 if mode == "concat" else 0)
    assert summary == pack_group.GroupSummary((0, "f", 0), 8, 8, whole.total_rows,
                                              sum(whole.stored_tokens), 0, ("t1", "t2"))
    pieces = []
    for layout_ in layouts:
        [s] = [u for u in summaries if u.unit.unit_id == layout_.unit_id]
        plan = pack.plan_pack(s.lengths.tolist(), spec.packing, 1 if mode == "concat" else 0,
                              layout_.start, layout_.last)
        assert layout_.row_start == plan.pieces[0][0].row and layout_.row_stop == plan.total_rows
        assert layout_.first_doc == len(pieces)
        pieces += plan.pieces
    assert tuple(pieces) == whole.pieces
    assert [u.last for u in layouts] == [False, False, True]  # the last unit with documents
    with pytest.raises(ValueError, match="read twice"):
        pack_group.plan_group(spec, (0, "f", 0), summaries + summaries[:1])


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


def test_place_units_rows_and_write_tasks():
    spec = _spec("segmented", seq_len=4, partition_rows=2)
    groups = {(0, "a", 0): [_unit("a", 1, [3, 3, 1]), _unit("a", 4, [4, 2])],
              (0, "b", 0): [_unit("b", 1, [9])]}
    planned = {k: pack_group.plan_group(spec, k, v) for k, v in groups.items()}
    plan = partition.build_plan(spec, [s for s, _ in planned.values()])
    write_plan = partition.place_units(plan, [l for _, ls in planned.values() for l in ls])
    # a: rows 0-1 ([3], [3 1]) then 2-3 ([4], [2]); b: rows 4-6 (9 tokens).
    assert [(u.row_start, u.row_stop, u.first_doc) for u in write_plan.units] == [
        (0, 2, 0), (2, 4, 3), (4, 7, 5)]
    assert [u.unit_id for u in write_plan.units_in_rows(1, 3)] == [
        u.unit_id for u in write_plan.units[:2]]
    tasks = write_plan.write_tasks()
    assert sorted(p for _, pids in tasks for p in pids) == list(range(plan.n_partitions))
    by_id = {u.unit_id: u for u in write_plan.units}
    for unit_id, pids in tasks:  # each partition goes to the unit holding its first row
        for pid in pids:
            row = plan.partition_range(pid)[0]
            assert by_id[unit_id].row_start <= row < by_id[unit_id].row_stop


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


@pytest.mark.parametrize("mode", ["pad", "segmented", "concat"])
def test_partitions_from_stored_units_equal_one_packing_of_each_group(tmp_path, mode):
    """Partitions assembled from units stored apart equal the rows of packing each
    group's documents at once (pack.fill_rows over the whole group)."""
    spec = _spec(mode, seq_len=5, partition_rows=2)
    rng = np.random.default_rng(0)
    groups, stores, docs_of = {}, str(tmp_path), {}
    for key, n_units in (((0, "a", 0), 3), ((0, "b", 0), 2)):
        groups[key] = []
        for u in range(n_units):
            lengths = rng.integers(1, 12, size=rng.integers(0, 4)).astype(np.int32)
            ids = [rng.integers(10, 99, size=n).astype(np.int32) for n in lengths]
            summary = _unit(key[1], 100 * u + 1, lengths)
            tokens = unit_tokens.UnitTokens(
                lengths, np.concatenate(ids) if ids else np.zeros(0, np.int32), None,
                np.zeros(len(lengths), np.int32), [None] * len(lengths),
                [{"doc_id": f"{key[1]}{u}.{d}"} for d in range(len(lengths))])
            store.open_store(stores).write(unit_tokens.cache_key(summary.unit.unit_id),
                                           tokens.to_bytes())
            groups[key].append(summary)
            docs_of.setdefault(key, []).extend(ids)
    planned = {k: pack_group.plan_group(spec, k, v) for k, v in groups.items()}
    plan = partition.build_plan(spec, [s for s, _ in planned.values()])
    write_plan = partition.place_units(plan, [l for _, ls in planned.values() for l in ls])
    expected = pack_group.empty_block(plan.total_rows, 5, 0)
    doc = 0
    for key in sorted(groups):
        whole = pack.plan_pack([len(i) for i in docs_of[key]], spec.packing,
                               1 if mode == "concat" else 0)
        for d, ids in enumerate(docs_of[key]):
            packed = pack.packed_ids(ids, whole.stored_tokens[d], 7)
            pack.fill_rows(expected, -plan.groups[key].first_row, whole.pieces[d], packed,
                           doc + d, packing=spec.packing)
        doc += len(docs_of[key])
    reader = assemble.UnitReader(run_dir.RunDir.at(stores), spec)
    got = [assemble.fill_partition(spec, write_plan, reader, pid, 7)
           for pid in range(plan.n_partitions)]
    for name in layout.TOKEN_ARRAYS:
        assert np.array_equal(np.concatenate([b[name] for b, _ in got]), expected[name]), name
    table = [d for _, rows in got for d in rows]
    assert [d["doc_index"] for d in table] == list(range(doc))
    for d in table:
        assert expected["doc_index"][d["first_row"], d["first_col"]] == d["doc_index"]
