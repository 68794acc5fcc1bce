"""What makes status fast at pod scale, checked against straightforward readings: the
columnar manifest (and the old list form), the typed loader's fast path and its errors,
heartbeat history, parallel heartbeat reads and range-split listings on the GCS emulator."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time

import pytest

from actx.deploy import cli
from actx.schemas import commit, config, heartbeat, layout, manifest, store
from tests import status_runs


def _status_json(run: str) -> dict:
    out = io.StringIO()
    assert cli.main(["status", run, "--json"], out=out) == 0
    return json.loads(out.getvalue())


def test_manifest_columns_load_as_a_plain_parse_reads_them(tmp_path):
    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=2500, n_hosts=4,
                                  committed=0)
    raw = json.load(open(os.path.join(run, "manifest.json")))
    columns = raw["partitions"]
    plain = [dict(zip(columns, values)) for values in zip(*columns.values())]
    loaded = manifest.read_manifest(store.open_store(run))
    assert [dataclasses.asdict(p) for p in loaded.partitions] == plain
    assert loaded.total_tokens == raw["total_tokens"] == sum(columns["tokens"])
    # The list form of earlier manifests (version 1) loads to the same partitions.
    old = dict(raw, partitions=plain, version=1)
    assert manifest.Manifest.from_json_obj(old).partitions == loaded.partitions


def test_new_fields_with_defaults_load_from_older_columns():
    @dataclasses.dataclass(frozen=True)
    class Row:
        a: int
        b: int = 7
        c: str = "x"

    assert config.from_columns(Row, {"a": [1, 2]}, "t") == (Row(1), Row(2))
    assert config.from_columns(Row, {"a": [1], "c": ["y"]}, "t") == (Row(1, 7, "y"),)
    defaulted = [f for f in dataclasses.fields(manifest.Partition)
                 if f.default is not dataclasses.MISSING]
    if defaulted:  # fields added after a run was prepared take their defaults
        raw = json.loads(manifest.encode(_small_manifest()))
        for f in defaulted:
            del raw["partitions"][f.name]
        parts = manifest.Manifest.from_json_obj(raw).partitions
        assert all(getattr(p, f.name) == f.default for p in parts for f in defaulted)


def _small_manifest() -> manifest.Manifest:
    parts = tuple(manifest.Partition(id=i, row_start=4 * i, row_count=4, tokens=10 + i, docs=1)
                  for i in range(5))
    return manifest.Manifest(fingerprint="f", seq_len=8, total_rows=20,
                             total_tokens=sum(p.tokens for p in parts), partitions=parts,
                             sources={"s": manifest.SourceCounts(5, 5, 0)}, vocab_size=10)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["tokens"].__setitem__(3, "x"),
     "manifest.json: partitions.tokens[3]: expected an integer, got str 'x'"),
    (lambda c: c.__setitem__("tokenz", [1] * 5),
     "manifest.json: partitions.tokenz: unknown column; known columns: id, "),
    (lambda c: c["docs"].pop(),
     "manifest.json: partitions.docs: expected a list of 5 values"),
    (lambda c: c.pop("row_count"),
     "manifest.json: partitions.row_count: required column is missing"),
])
def test_damaged_columns_say_which_column_and_row(edit, message):
    raw = json.loads(manifest.encode(_small_manifest()))
    edit(raw["partitions"])
    with pytest.raises(config.ConfigError) as e:
        manifest.Manifest.from_json_obj(raw, "manifest.json")
    assert str(e.value).startswith(message), str(e.value)


def test_a_manifest_of_a_newer_version_is_refused_by_name():
    raw = json.loads(manifest.encode(_small_manifest()))
    assert raw["version"] == manifest.MANIFEST_VERSION == 4
    # Earlier versions read, without the columns they did not have.
    added = {3: {"longest_doc_rows"}, 4: {"continued_doc_rows", "continued_from_rows"}}
    for version in (1, 2, 3, 4):
        missing = set().union(*(cols for v, cols in added.items() if v > version))
        older = dict(raw, version=version, partitions={
            k: v for k, v in raw["partitions"].items() if k not in missing})
        assert manifest.Manifest.from_json_obj(older).partitions == _small_manifest().partitions
    with pytest.raises(config.ConfigError) as e:
        manifest.Manifest.from_json_obj(dict(raw, version=5), "gs://b/run/manifest.json")
    assert str(e.value) == (
        "gs://b/run/manifest.json: manifest version 5 was written by a newer actx (this one "
        "reads versions 1 to 4); upgrade actx (pip install --upgrade actx-lm) to read this run")


def test_fast_path_errors_are_the_slow_paths():
    raw = json.loads(manifest.encode(_small_manifest()))
    raw["partitions"] = [dict(zip(raw["partitions"], v))
                         for v in zip(*raw["partitions"].values())]
    raw["partitions"][2]["tokens"] = True
    with pytest.raises(config.ConfigError, match=r"^m: partitions\[2\]\.tokens: expected an "
                                                 r"integer, got bool True$"):
        manifest.Manifest.from_json_obj(raw, "m")
    raw["partitions"][2]["tokens"] = 1
    raw["sources"]["s"]["reed"] = 1
    with pytest.raises(config.ConfigError, match=r"^m: sources\.s\.reed: unknown key \(did you "
                                                 r"mean 'read'\?\)"):
        manifest.Manifest.from_json_obj(raw, "m")


def test_heartbeat_history_spans_the_attempt_and_stays_small():
    s = store.open_store("memory://hb-history")
    writer = heartbeat.HeartbeatWriter(s, "h0")
    t0 = 1.8e9
    for i in range(500):
        hb = heartbeat.Heartbeat(host="h0", replica=0, process_index=0, state="working",
                                 attempt="a", updated_at=t0 + 2 * i, tokens_done=1000 * i)
        writer.beat(hb, force=True)
    raw = json.loads(s.read(layout.heartbeat_key("h0")))
    hist = raw["history"]
    assert len(hist) <= heartbeat.MAX_HISTORY
    assert hist[-1] == [t0 + 998, 499_000]  # the newest sample is always kept
    assert hist[0][0] - t0 < 0.1 * 998  # and the oldest reach back to the start
    assert all(b[0] > a[0] and b[1] > a[1] for a, b in zip(hist, hist[1:]))
    [beat] = heartbeat.read_heartbeats(s)
    assert [list(x) for x in beat.history] == hist


def test_status_counts_match_a_plain_reading(tmp_path):
    now = time.time()
    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=3000, n_hosts=64,
                                  committed=1234, dead_hosts=5, now=now)
    st = _status_json(run)
    committed = {int(n[2:-5]) for n in os.listdir(os.path.join(run, "commits"))}
    beats = [json.load(open(os.path.join(run, "workers", n)))
             for n in os.listdir(os.path.join(run, "workers"))]
    live = {b["partition"] for b in beats if time.time() - b["updated_at"] <= 60} - committed
    dead = {b["partition"] for b in beats if time.time() - b["updated_at"] > 60} - committed
    tokens = json.load(open(os.path.join(run, "manifest.json")))["partitions"]["tokens"]
    assert st["counts"] == {"committed": len(committed), "in_progress": len(live),
                            "stale": len(dead), "pending": 3000 - len(committed | live | dead)}
    assert st["tokens_done"] == sum(tokens[p] for p in committed)
    assert st["tokens_per_s"] == pytest.approx(
        sum(b["tokens_per_s"] for b in beats if time.time() - b["updated_at"] <= 60), abs=0.1)


@pytest.mark.parametrize("n", [2_000, 15_999, 99_999, 150_000, 123_457])
def test_listing_ranges_cut_the_sorted_markers_evenly(n):
    """The cuts a paged store lists between (from a sample of the keys, not all of them)
    are sorted, one fewer than the ranges, and each range holds within 5% of an equal
    share of the keys as they sort, past 100k ids too ("p-100000.json" sorts between
    "p-10000.json" and "p-10001.json")."""
    import bisect

    ranges = min(commit.MAX_RANGES, -(-n // commit.LIST_RANGE))
    cuts = commit.range_boundaries(n, ranges)
    keys = sorted(layout.commit_key(p) for p in range(n))
    assert cuts == sorted(set(cuts)) and len(cuts) == ranges - 1
    edges = [0, *(bisect.bisect_left(keys, c) for c in cuts), n]
    sizes = [b - a for a, b in zip(edges, edges[1:])]
    assert max(sizes) <= 1.05 * n / ranges and min(sizes) >= 0.95 * n / ranges, sizes


def test_listing_in_ranges_finds_every_marker(tmp_path):
    """A store that lists each range on its own (as GCS does in parallel) finds every
    marker of a run past 100k partitions, none twice."""
    class RangedStore(store.LocalStore):
        PARALLEL_LISTING = True
        seen: list = []

        def list_split(self, prefix, boundaries):
            keys = self.list(prefix)
            cuts = [None, *boundaries, None]
            parts = [[k for k in keys if (lo is None or k >= lo) and (hi is None or k < hi)]
                     for lo, hi in zip(cuts, cuts[1:])]
            self.seen.append([len(p) for p in parts])
            return [k for part in parts for k in part]

    s = RangedStore(store.open_store(str(tmp_path)).location)
    ids = set(range(0, 130_000, 97)) | {99_999, 100_000, 100_001, 129_999}
    for p in ids:
        s.write(layout.commit_key(p), b"{}")
    assert commit.committed_partitions(s, 130_000) == ids
    assert len(s.seen[0]) == 16 and sum(s.seen[0]) == len(ids)


def test_gcs_listing_in_ranges_and_parallel_heartbeats(gcs_bucket, monkeypatch):
    run = f"{gcs_bucket}/runs/scale"
    status_runs.write_store(run, n_partitions=420, n_hosts=40, committed=333, dead_hosts=3)
    s = store.open_store(run)
    monkeypatch.setattr(commit, "LIST_RANGE", 50)  # 9 ranges listed at once
    assert commit.committed_partitions(s, 420) == set(range(333))
    assert commit.committed_partitions(s, 420) == commit.committed_partitions(s)
    beats = heartbeat.read_heartbeats(s, max_parallel=16)
    plain = [config.from_dict(heartbeat.Heartbeat, s.read_json(k))
             for k in s.list(layout.WORKERS_PREFIX)]
    assert beats == plain and len(beats) == 40


def test_gcs_heartbeats_from_one_listing_of_summaries(gcs_bucket, monkeypatch):
    """Heartbeats written as workers write them: status and the page read them from the
    listing alone and get what reading every object gives (status: with each message cut
    at 500 characters); the page reads only the objects whose summary cannot stand for
    them: a cut message, or a summary without the history (a writer before 0.3.0, or
    none at all)."""
    s = store.open_store(f"{gcs_bucket}/runs/summaries")
    for h in range(5):
        writer = heartbeat.HeartbeatWriter(s, f"h{h}")
        for i in range(3):
            writer.beat(heartbeat.Heartbeat(
                host=f"h{h}", replica=h, process_index=0, state="working", attempt="a",
                updated_at=1.8e9 + i, partition=h, tokens_done=100 * i + h,
                tokens_per_s=1.5 * h, message="m" * (600 if h == 0 else 3)), force=True)
    s.write_json(layout.heartbeat_key("old"), config.to_dict(heartbeat.Heartbeat(
        host="old", replica=9, process_index=0, state="done", attempt="b", updated_at=1.0)))
    earlier = heartbeat.Heartbeat(host="h5", replica=5, process_index=0, state="done",
                                  attempt="c", updated_at=2.0, history=((1.0, 5), (2.0, 9)))
    s.write_with_summary(layout.heartbeat_key("h5"), store.dumps(config.to_dict(earlier)),
                         heartbeat.summary(dataclasses.replace(earlier, history=())))
    summaries = s.list_summaries(layout.WORKERS_PREFIX)
    assert summaries[layout.heartbeat_key("old")] is None  # written without one: read
    assert sum(v is not None for v in summaries.values()) == 6
    plain = [config.from_dict(heartbeat.Heartbeat, s.read_json(k))
             for k in s.list(layout.WORKERS_PREFIX)]
    read = []
    real = s.read_many
    monkeypatch.setattr(s, "read_many", lambda keys, **kw: read.extend(keys) or real(keys, **kw))
    full = heartbeat.read_heartbeats(s)
    assert full == plain and len(full[1].history) == 3
    assert read == [layout.heartbeat_key(h) for h in ("h0", "h5", "old")]
    read.clear()
    listed = heartbeat.read_heartbeats(s, history=False)
    assert read == [layout.heartbeat_key("old")]
    expected = [dataclasses.replace(b, message=b.message[:500],
                                    history=() if b.host == "h5" else b.history) for b in full]
    assert listed == expected


@pytest.mark.parametrize("history", [False, True])
def test_heartbeats_read_again_are_parsed_again_only_where_they_changed(tmp_path, history):
    """A host lists the heartbeats about once an interval: a heartbeat whose text is what
    the last reading parsed is that reading's (the same object); one rewritten since is
    read as written, and one deleted is gone."""
    s = store.open_store(str(tmp_path / "run"))
    writers = [heartbeat.HeartbeatWriter(s, f"h{h}") for h in range(3)]

    def beat(h: int, tokens: int) -> heartbeat.Heartbeat:
        return heartbeat.Heartbeat(host=f"h{h}", replica=h, process_index=0, state="working",
                                   attempt="a", updated_at=1.8e9 + tokens,
                                   tokens_done=tokens, message=f"m{tokens}")

    for h, writer in enumerate(writers):
        writer.beat(beat(h, 10 + h), force=True)
    first = heartbeat.read_heartbeats(s, history=history)
    writers[1].beat(beat(1, 50), force=True)
    s.delete(layout.heartbeat_key("h2"))
    again = heartbeat.read_heartbeats(s, history=history)
    plain = [config.from_dict(heartbeat.Heartbeat, s.read_json(k))
             for k in s.list(layout.WORKERS_PREFIX)]
    assert [(b.host, b.tokens_done, b.message) for b in again] == [
        (b.host, b.tokens_done, b.message) for b in plain] == [("h0", 10, "m10"),
                                                                ("h1", 50, "m50")]
    assert again[0] is first[0] and again[1] is not first[1]
    # The same object in another run is another heartbeat.
    other = store.open_store(str(tmp_path / "other"))
    heartbeat.HeartbeatWriter(other, "h0").beat(beat(0, 10), force=True)
    assert heartbeat.read_heartbeats(other, history=history)[0] is not first[0]


def test_a_summary_keeps_the_history_while_it_fits():
    hb = heartbeat.Heartbeat(host="h" * 40, replica=511, process_index=0, state="working",
                             attempt="a" * 60, updated_at=1.8e9, tokens_done=10**12,
                             message="x" * 600, idle_reason="y" * 400,
                             history=tuple((1.8e9 + 0.1 * i, 10**12 + i)
                                           for i in range(heartbeat.MAX_HISTORY)))
    text = heartbeat.summary(hb)
    assert len(text) <= heartbeat.SUMMARY_BYTES < 8192  # GCS custom metadata: 8 KB an object
    assert config.from_dict(heartbeat.Heartbeat, json.loads(text)) == dataclasses.replace(
        hb, message="x" * 500)
    crowded = dataclasses.replace(hb, held=tuple(range(10**6, 10**6 + 800)))
    text = heartbeat.summary(crowded)  # past the budget: the history stays in the object
    assert json.loads(text)["history"] == [] and json.loads(text)["held"] == list(crowded.held)


def test_text_map_of_a_large_run_keeps_the_urgent_states(tmp_path):
    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=5000, n_hosts=16,
                                  committed=2000, dead_hosts=2, now=time.time())
    st = _status_json(run)
    out = io.StringIO()
    assert cli.main(["status", run], out=out) == 0
    text = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("map ("))
    assert "one character per 2 partitions" in text[start]
    rows = [line.split()[1] for line in text[start + 1:]]
    assert len(rows) <= 64
    drawn = "".join(rows)
    names = sorted(st["partitions"])
    for i, c in enumerate(drawn):  # each character: the most urgent of its two partitions
        states = {st["partitions"][n] for n in names[2 * i:2 * i + 2]}
        expected = ("S" if "stale" in states else "W" if "in_progress" in states
                    else "." if "pending" in states else "C")
        assert c == expected, (i, states)
