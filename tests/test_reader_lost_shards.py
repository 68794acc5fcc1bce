"""A committed partition whose stored activation objects are gone is refused by every
read, by name, where the objects held values other than zeros (reader.shard_presence);
one the worker wrote as zeros (kept by the store as no object) reads as zeros. The
reference is what was written (tests.reader_fixtures' truth) and the markers' checksums;
on local disk, and on a loopback GCS server, where the listings go in key ranges and
several arrays at once. (A real run's lost object, followed by the advice to its end:
tests/test_advice_followed.py.)"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from actx import reader
from actx.schemas import commit, layout, store as store_lib
from tests import reader_fixtures as rf

HOOK = "layers.0.resid_post"


def _run(uri, **kwargs):
    """4 partitions of 8 rows, shards of 4 rows, partitions 0, 1 and 2 committed."""
    args = dict(num_partitions=4, partition_rows=8, rows_per_shard=4, committed=(0, 1, 2))
    args.update(kwargs)
    return rf.build_run(str(uri), **args)


def _shard(truth, hook, shard):
    return os.path.join(truth.uri, "activations", hook, "c", str(shard), "0", "0")


def _refused(call):
    with pytest.raises(reader.LostDataError) as e:
        call()
    return str(e.value)


def _every_read_of_partition_1_is_refused(run, hook, truth):
    """Rows, tokens, gather, document, stream, batches and statistics: each refuses, and
    each read that leaves partition 1 out returns what was written."""
    said = _refused(lambda: run.rows(hook, 8, 16))
    _refused(lambda: run.tokens(hook, 12, 0, 4))
    _refused(lambda: run.gather([hook], np.array([0, 13]), np.array([1, 2])))
    _refused(lambda: run.stream(hook, 8, seed=0))
    _refused(lambda: run.batches(hook, 8, seed=0))
    _refused(lambda: run.compute_stats([hook]))
    np.testing.assert_array_equal(run.rows(hook, 0, 8), truth.stored[hook][0:8])
    np.testing.assert_array_equal(run.rows(hook, 16, 24), truth.stored[hook][16:24])
    got = [b.acts[hook] for b in run.stream(hook, 8, seed=0, partitions=[0, 2],
                                            drop_last=False, epochs=1)]
    mask = truth.committed_mask().copy()
    mask[8:16] = False
    assert sum(len(a) for a in got) == int(mask.sum())
    return said


def test_a_lost_object_is_refused_by_every_read_with_the_commands_that_finish_it(tmp_path):
    truth = _run(tmp_path / "run")
    os.remove(_shard(truth, HOOK, 3))  # rows 12..15, of partition 1
    run = reader.open_run(truth.uri)
    said = _every_read_of_partition_1_is_refused(run, HOOK, truth)
    assert "1 committed partition(s) (p-00001)" in said, said
    assert f"activations/{HOOK}/c/3/0/0 not stored" in said and "rows 12-15" in said, said
    assert (f"`actx verify {truth.uri} --repair` turns them back into pending, then "
            f"`actx rerun {truth.uri}` extracts them again") in said, said
    # The other hook of the same partition is whole: it reads.
    np.testing.assert_array_equal(run.rows("embed", 8, 16), truth.stored["embed"][8:16])
    # A TransformerLens name of the hook is the same array: refused alike.
    assert "p-00001" in _refused(lambda: run.rows("blocks.0.hook_resid_post", 8, 16))


def test_an_object_written_as_zeros_is_read_as_zeros(tmp_path):
    """The store keeps a block of zeros as no object: its marker says zeros, so it reads."""
    truth = _run(tmp_path / "run", committed=(0, 2))
    truth.stored[HOOK][12:16] = 0  # what the worker wrote (and checksummed) there
    assert rf.commit_partition(truth, 1)
    os.remove(_shard(truth, HOOK, 3))
    run = reader.open_run(truth.uri)
    rows = run.rows(HOOK, 8, 16)
    np.testing.assert_array_equal(rows, truth.stored[HOOK][8:16])
    assert not rows[4:].any() and rows[:4].any()
    s = run.stream(HOOK, 8, seed=0, drop_last=False, epochs=1)
    assert sum(len(b.rows) for b in s) == int(truth.committed_mask().sum())


def test_every_lost_partition_is_named_and_a_repair_leaves_the_rest_readable(tmp_path):
    truth = _run(tmp_path / "run")
    os.remove(_shard(truth, HOOK, 0))  # partition 0
    os.remove(_shard(truth, HOOK, 5))  # partition 2
    run = reader.open_run(truth.uri)
    said = _refused(lambda: run.stream(HOOK, 8, seed=0))
    assert "2 committed partition(s) (p-00000, p-00002)" in said, said
    # What `actx verify RUN --repair` does to them: their markers go, they read as
    # pending, and the rest of the run reads.
    from actx.deploy import cli
    import io

    out = io.StringIO()
    assert cli.main(["verify", truth.uri, "--repair"], out=out) == 1, out.getvalue()
    assert "REPAIRED: 2 partition(s)" in out.getvalue(), out.getvalue()
    run = reader.open_run(truth.uri)
    assert run.committed == (1,)
    np.testing.assert_array_equal(run.rows(HOOK, 8, 16), truth.stored[HOOK][8:16])


def test_a_partition_committed_after_the_listing_is_looked_for_again(tmp_path, monkeypatch):
    """A reader following a live run looked at the hook's objects before partitions 1 and
    2 wrote theirs: once their markers are seen, their objects are looked for again (one
    by one where they are fewer than the listing's pages, else in one new listing), not
    taken as lost; partition 3's, lost before its commit, are refused."""
    monkeypatch.setattr(commit, "LIST_RANGE", 2)  # 16 shards: a listing of 8 pages
    truth = _run(tmp_path / "run", committed=(0,))
    held = tmp_path / "held"
    for shard in (2, 3, 4, 5):  # partitions 1 and 2's objects, not written yet
        os.makedirs(held / str(shard))
        shutil.move(_shard(truth, HOOK, shard), held / str(shard) / "0")
    os.remove(_shard(truth, HOOK, 7))  # partition 3's: lost before it commits
    run = reader.open_run(truth.uri)
    listed = []  # the array's look at every object (local disk: a stat each), and one by one
    existing, size = type(run.store).existing, type(run.store).size
    monkeypatch.setattr(type(run.store), "existing", lambda self, prefix, keys, cuts: (
        listed.append(prefix) or existing(self, prefix, keys, cuts)))
    monkeypatch.setattr(type(run.store), "size",
                        lambda self, key: listed.append(key) or size(self, key))
    np.testing.assert_array_equal(run.rows(HOOK, 0, 8), truth.stored[HOOK][0:8])
    assert listed == [f"activations/{HOOK}/c/"]

    def write_and_commit(pid, shards):  # as a worker does: the objects, then the marker
        for shard in shards:
            shutil.move(held / str(shard) / "0", _shard(truth, HOOK, shard))
        assert rf.commit_partition(truth, pid)

    write_and_commit(1, (2, 3))
    assert rf.commit_partition(truth, 3)
    run.observe_committed(commit.committed_partitions(run.store))
    np.testing.assert_array_equal(run.rows(HOOK, 8, 16), truth.stored[HOOK][8:16])
    assert listed[1:] == [layout.activation_shard_key(HOOK, 2),
                          layout.activation_shard_key(HOOK, 3)], listed
    said = _refused(lambda: run.rows(HOOK, 24, 32))
    assert "p-00003" in said and f"activations/{HOOK}/c/7/0/0 not stored" in said, said
    assert listed[3:] == [layout.activation_shard_key(HOOK, 7)], listed
    # More objects to look for than the listing has pages: one listing instead.
    monkeypatch.setattr(commit, "LIST_RANGE", 1000)  # one page
    write_and_commit(2, (4, 5))
    run.observe_committed(commit.committed_partitions(run.store))
    np.testing.assert_array_equal(run.rows(HOOK, 16, 24), truth.stored[HOOK][16:24])
    assert listed[4:] == [f"activations/{HOOK}/c/"], listed
    # Each array is looked at once, each object once: nothing more per read.
    run.rows(HOOK, 0, 24)
    _refused(lambda: run.rows(HOOK, 24, 32))
    assert len(listed) == 5, listed


def test_a_float8_hooks_lost_scales_are_refused(tmp_path):
    truth = _run(tmp_path / "run", dtype="float8_e4m3")
    os.remove(_shard(truth, f"{HOOK}.scale", 2))  # rows 8..11 of partition 1
    run = reader.open_run(truth.uri)
    said = _refused(lambda: run.rows(HOOK, 8, 16))
    assert f"array {HOOK}.scale" in said and "p-00001" in said, said
    np.testing.assert_array_equal(run.rows(HOOK, 0, 8), truth.stored[HOOK][0:8])


def test_on_gcs_the_listing_goes_in_ranges_and_finds_what_is_lost(gcs_bucket, monkeypatch):
    """A hook's objects listed in key ranges at once (as the markers are, past one page of
    names): every stored object is found (no partition wrongly refused), the one deleted
    is named."""
    monkeypatch.setattr(commit, "LIST_RANGE", 3)  # 16 shards: 6 ranges
    uri = f"{gcs_bucket}/runs/lost"
    truth = _run(uri, num_partitions=8, committed=tuple(range(8)))
    s = store_lib.open_store(uri)
    s.delete(layout.activation_shard_key(HOOK, 11))  # rows 44..47: partition 5
    split = []
    real = type(s).list_split
    monkeypatch.setattr(type(s), "list_split",
                        lambda self, prefix, cuts: split.append((prefix, cuts))
                        or real(self, prefix, cuts))
    monkeypatch.setattr(type(s), "GCS_PAGE_ITEMS", 2)
    monkeypatch.setattr(type(s), "PAGE_ASK", 2)
    run = reader.open_run(uri)
    said = _refused(lambda: run.stream([HOOK, "embed"], 8, seed=0))
    assert "1 committed partition(s) (p-00005)" in said, said
    assert sorted(p for p, _ in split if "activations" in p) == [
        "activations/embed/c/", f"activations/{HOOK}/c/"]  # both at once
    got = [b.acts[HOOK] for b in run.stream(HOOK, 8, seed=0, drop_last=False, epochs=1,
                                            partitions=[0, 1, 2, 3, 4, 6, 7])]
    mask = truth.committed_mask().copy()
    mask[40:48] = False
    assert sum(len(a) for a in got) == int(mask.sum())


def test_a_named_extractions_view_looks_for_its_own_objects(tmp_path):
    """An extraction's objects lie under extractions/NAME/ (schemas.extraction_store): its
    view looks there, for its keys as the reader names them."""
    from actx.schemas import absent_shards, extraction_store

    base = store_lib.open_store(str(tmp_path / "run"))
    view = extraction_store.view(base, "other")
    for i in (0, 2):
        view.write(layout.activation_shard_key(HOOK, i), b"x")
    base.write(layout.activation_shard_key(HOOK, 1), b"x")  # the default extraction's
    assert absent_shards.stored_shards(view, HOOK, 3) == {0, 2}
    assert absent_shards.stored_shards(base, HOOK, 3) == {1}
    assert os.path.isfile(tmp_path / "run" / layout.extraction_key(
        "other", layout.activation_shard_key(HOOK, 2)))


def test_an_array_in_another_shard_layout_is_read_not_refused(tmp_path):
    """Objects of 8 rows where the run's layout says 4 (no actx writer makes one): the
    check, which knows objects of rows_per_shard rows, leaves the array alone rather than
    refuse partitions for keys it never had; its values read as written."""
    import dataclasses

    from actx.schemas import runspec, ts_context, uri

    truth = _run(tmp_path / "run")
    spec = runspec.RunSpec.from_dict(store_lib.open_store(truth.uri).read_json("run.json"))
    wide = dataclasses.replace(spec.layout, rows_per_shard=8)
    shutil.rmtree(os.path.join(truth.uri, "activations", "embed"))
    values = truth.stored["embed"]
    arr = ts_context.open_array(layout.activation_array(
        "embed", values.shape[0], values.shape[1], values.shape[2], truth.dtype, wide
    ).spec(uri.parse(truth.uri), create=True))
    arr.write(values).result()
    assert not os.path.exists(_shard(truth, "embed", 4))  # rows 16..23 are in object 2
    run = reader.open_run(truth.uri)
    np.testing.assert_array_equal(run.rows("embed", 16, 24), values[16:24])
    # The hook in the run's own layout is still checked.
    os.remove(_shard(truth, HOOK, 3))
    _refused(lambda: run.rows(HOOK, 8, 16))
