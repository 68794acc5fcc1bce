"""The fast paths of `actx status` at pod scale hold the content of the straightforward ones:
the JSON text (written without the json module's pure-Python encoder) parses to what
json.dumps of the status object gives; the partition states read as the plain dict they
were; the manifest's partition columns read as the tuple of partitions they were; a silent
host's log line is read once and kept in the run, and read again when the log moves."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import time
import urllib.request

import pytest

from actx.deploy import cli
from actx.deploy.page import server as ui_server
from actx.deploy.status import host_logs
from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.deploy.status.partition_states import STATES, PartitionStates
from actx.schemas import commit, layout, manifest, store
from actx.schemas import run_dir
from tests import status_runs


def _status(run: str, *flags: str) -> str:
    out = io.StringIO()
    assert cli.main(["status", run, *flags], out=out) == 0
    return out.getvalue()


@pytest.mark.parametrize("n", [0, 1, 7, 3000])
def test_json_text_is_json_dumps_of_the_status_object(tmp_path, n):
    """Under 100k partitions the text is byte for byte json.dumps(indent=1, sort_keys=True)
    of `to_json_obj()`, one extraction or several."""
    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=n, n_hosts=min(n, 9) or 1,
                                  committed=n // 3, dead_hosts=1, now=time.time(), job="j1")
    handle = run_dir.open_run(run)
    status = runstate.compute_status(handle)
    one = status_text.render_extractions({"": status}, as_json=True)
    assert one == json.dumps(status.to_json_obj(), indent=1, sort_keys=True)
    both = status_text.render_extractions({"": status, "other": status}, as_json=True)
    assert both == json.dumps({"extractions": {"default": status.to_json_obj(),
                                               "other": status.to_json_obj()},
                               "complete": status.complete}, indent=1, sort_keys=True)


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randrange(-10**12, 10**12)
    if kind == 2:
        return rng.uniform(-1e6, 1e6)
    if kind in (3, 4):  # newlines, quotes, separators-like text and non-ASCII inside strings
        return "".join(rng.choice(['a', '\n', '"', ',', ': ', 'é', '\\', '\t', ' ', 'ü'])
                       for _ in range(rng.randrange(6)))
    if kind in (5, 6):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {"".join(rng.choice("ab\n\"é") for _ in range(rng.randrange(1, 4))):
            _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_status_json_dumps_is_json_dumps_with_indent_byte_for_byte():
    """The indented text of any JSON value (flat containers written by the C encoder,
    nested ones framed by hand) is json.dumps(indent=1, sort_keys=True)'s, strings with
    newlines, quotes, commas and non-ASCII characters included."""
    from actx.deploy.status import json_text as status_json

    rng = random.Random(11)
    for _ in range(3000):
        value = _random_json(rng)
        assert status_json.dumps(value) == json.dumps(value, indent=1, sort_keys=True), value


def test_json_of_150k_partitions_parses_to_the_plain_reading(tmp_path):
    """Past 100k partitions names sort differently as strings than as ids (the fast text
    keeps id order): the document parses to the same object, and each state is what a
    plain reading of the run's files gives."""
    now = time.time()
    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=150_000, n_hosts=32,
                                  committed=3000, dead_hosts=4, now=now, history_samples=2)
    for p in range(100_000, 100_500):  # markers past 100k too (a file each: kept few)
        os.link(os.path.join(run, layout.commit_key(0)), os.path.join(run, layout.commit_key(p)))
    text = _status(run, "--json")
    got = json.loads(text)
    status = runstate.compute_status(run_dir.open_run(run))
    assert got["partitions"] == status.to_json_obj()["partitions"]
    committed = {int(n[2:-5]) for n in os.listdir(os.path.join(run, "commits"))}
    beats = [json.load(open(os.path.join(run, "workers", n)))
             for n in os.listdir(os.path.join(run, "workers"))]
    stale = {b["partition"] for b in beats if now - b["updated_at"] > 60} - committed
    live = {b["partition"] for b in beats if now - b["updated_at"] <= 60} - committed
    plain = {}
    for p in range(150_000):
        plain[f"p-{p:05d}"] = ("committed" if p in committed else "in_progress" if p in live
                               else "stale" if p in stale else "pending")
    assert got["partitions"] == plain
    assert list(got["partitions"])[:3] == ["p-00000", "p-00001", "p-00002"]
    assert list(got["partitions"])[-1] == "p-149999"
    assert got["map"] == ["".join("CWS."[STATES.index(plain[f"p-{p:05d}"])]
                                  for p in range(i, min(i + 64, 150_000)))
                          for i in range(0, 150_000, 64)]


def test_status_without_history_reads_what_the_whole_history_gives(tmp_path):
    """status reads heartbeats without their history (only its first sample and last two
    are kept): elapsed time, average and current rate, and every other field, are what the
    whole history gives, on histories that are not straight lines."""
    now = time.time()
    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=400, n_hosts=12,
                                  committed=100, dead_hosts=3, now=now, history_samples=40)
    rng = random.Random(3)
    workers = os.path.join(run, "workers")
    for name in os.listdir(workers):
        with open(os.path.join(workers, name)) as f:
            beat = json.load(f)
        t, n, samples = beat["updated_at"] - 900, 0, []
        for _ in range(rng.randrange(4, 40)):
            t, n = t + rng.uniform(1, 20), n + rng.randrange(0, 10**6)
            samples.append([round(t, 1), n])
        beat["history"] = samples
        with open(os.path.join(workers, name), "w") as f:
            json.dump(beat, f)
    handle = run_dir.open_run(run)
    lean = runstate.compute_status(handle, now=now)
    whole = runstate.compute_status(handle, now=now, history=True)
    assert all(len(h.history) == 3 for h in lean.hosts)
    assert lean.to_json_obj() == whole.to_json_obj()
    assert lean.current_tokens_per_s == whole.current_tokens_per_s > 0
    assert lean.elapsed_s == whole.elapsed_s


@pytest.mark.parametrize("dense", [True, False])
def test_partition_states_read_as_the_dict_they_replace(dense):
    rng = random.Random(5)
    ids = list(range(500)) if dense else sorted(rng.sample(range(10_000), 500))
    sets = [set(rng.sample(ids, 120)) | {10**9, -1} for _ in range(3)]  # strays ignored
    states = PartitionStates.build(ids, [(sets[0], "stale"), (sets[1], "in_progress"),
                                         (sets[2], "committed")])
    plain = dict.fromkeys(ids, "pending")
    for chosen, state in zip(sets, ("stale", "in_progress", "committed")):
        plain.update((p, state) for p in chosen if p in plain)
    assert dict(states) == plain and states == plain and len(states) == 500
    assert list(states) == ids
    assert all(states[p] == plain[p] for p in ids)
    for missing in (10**9, -1, 500 if dense else 1, "3", True):
        if missing not in plain:
            assert missing not in states
            with pytest.raises(KeyError):
                states[missing]
    for state in STATES:
        assert states.ids_in(state) == sorted(p for p, s in plain.items() if s == state)
    assert states.counts() == {s: sum(v == s for v in plain.values()) for s in STATES}
    failed = sorted(sets[2])[:3]
    chars = states.chars(failed)
    assert chars == "".join("F" if p in failed else "CWS."[STATES.index(plain[p])]
                            for p in sorted(ids))
    text = states.json_text("  ")
    assert json.loads(text) == {f"p-{p:05d}": s for p, s in plain.items()}


def test_manifest_columns_read_as_the_partitions_they_hold(tmp_path):
    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=300, n_hosts=2,
                                  committed=0)
    loaded = manifest.read_manifest(store.open_store(run))
    raw = json.load(open(os.path.join(run, "manifest.json")))["partitions"]
    built = tuple(manifest.Partition(**dict(zip(raw, values))) for values in zip(*raw.values()))
    table = loaded.partitions
    assert isinstance(table, manifest.PartitionTable)
    assert table[7] == built[7] and table[-1] == built[-1] and table[2:5] == built[2:5]
    assert table == built and built == table and len(table) == 300
    assert list(table) == list(built) and loaded.partition(299) == built[299]
    assert manifest.partition_column(table, "tokens") == [p.tokens for p in built]
    assert manifest.partition_column(built, "tokens") == raw["tokens"]
    # Written back, it is the file it was read from; replaced, it is a manifest like any.
    assert json.loads(manifest.encode(loaded)) == json.loads(manifest.encode(
        dataclasses.replace(loaded, partitions=built)))
    with pytest.raises(IndexError):
        table[300]


class _CountingStore:
    """The run's real store, counting the reads of log objects."""

    def __init__(self, inner):
        self._inner, self.log_reads, self.fail_writes = inner, [], False

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read_range(self, key, start, end):
        self.log_reads.append(key)
        return self._inner.read_range(key, start, end)

    def write_json(self, key, obj):
        if self.fail_writes:
            raise PermissionError(f"{key}: read-only credentials")
        return self._inner.write_json(key, obj)


def _silent_run(tmp_path, hosts=6):
    return status_runs.write_local(str(tmp_path / "r"), n_partitions=40, n_hosts=hosts,
                                   committed=10, dead_hosts=hosts, now=time.time(), job="tpu-1")


def test_a_silent_hosts_log_is_read_once_and_again_when_it_moves(tmp_path):
    run = _silent_run(tmp_path)
    handle = run_dir.open_run(run)
    counting = _CountingStore(handle.store)
    handle = dataclasses.replace(handle, store=counting)
    first = runstate.compute_status(handle)
    assert len(counting.log_reads) == 6
    for h in first.hosts:  # the line each log ends with, as the launcher copied it
        want = host_logs.last_log_line(status_runs.host_log(int(h.host[-3:]), dead=True))
        assert want.startswith("RuntimeError:") and h.message.endswith(f"ends: {want}")
    assert os.path.exists(os.path.join(run, layout.log_lines_key("tpu-1")))
    counting.log_reads.clear()
    again = runstate.compute_status(handle)
    assert counting.log_reads == [] and [h.message for h in again.hosts] == [
        h.message for h in first.hosts]
    # One host's launcher copied more of its log: that log alone is read again.
    moved = os.path.join(run, layout.log_key("tpu-1", "host-002"))
    with open(moved, "a") as f:
        f.write("MemoryError: host-002 ran out of memory\n")
    later = runstate.compute_status(handle)
    assert counting.log_reads == [layout.log_key("tpu-1", "host-002")]
    assert later.hosts[2].message.endswith("ends: MemoryError: host-002 ran out of memory")
    assert [h.message for i, h in enumerate(later.hosts) if i != 2] == [
        h.message for i, h in enumerate(first.hosts) if i != 2]


def test_the_log_cache_is_a_cache(tmp_path):
    """Damaged, missing or unwritable: status shows the same lines, read from the logs."""
    run = _silent_run(tmp_path, hosts=3)
    handle = run_dir.open_run(run)
    clean = [h.message for h in runstate.compute_status(handle).hosts]
    cache = os.path.join(run, layout.log_lines_key("tpu-1"))
    for damage in (b"{not json", b'{"version": 99, "lines": {}}', b'{"version": 1, "lines": 3}'):
        with open(cache, "wb") as f:
            f.write(damage)
        assert [h.message for h in runstate.compute_status(handle).hosts] == clean
        assert json.load(open(cache))["version"] == host_logs.CACHE_VERSION  # rewritten
    os.remove(cache)
    counting = _CountingStore(handle.store)
    counting.fail_writes = True
    read_only = dataclasses.replace(handle, store=counting)
    for _ in range(2):
        assert [h.message for h in runstate.compute_status(read_only).hosts] == clean
    assert len(counting.log_reads) == 6 and not os.path.exists(cache)
    # A cached line of another log version is not believed.
    runstate.compute_status(handle)
    data = json.load(open(cache))
    key = layout.log_key("tpu-1", "host-001")
    data["lines"][key][1] = "an older version"
    data["lines"][key][2] = "a line that log no longer ends with"
    with open(cache, "w") as f:
        json.dump(data, f)
    assert [h.message for h in runstate.compute_status(handle).hosts] == clean


def test_the_page_of_a_pod_scale_run_through_its_server(tmp_path):
    """The live page's data for a 150k-partition run, answered by its server, holds what
    status says (its time is in bench/status.py)."""
    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=150_000, n_hosts=64,
                                  committed=2000, dead_hosts=64, now=time.time(),
                                  job="tpu-9", history_samples=4)
    handle = run_dir.open_run(run)
    source = ui_server.PageSource(handle, 60.0, min_interval_s=0.0)
    server = ui_server.make_server(source, 0, 5.0)
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/data.json"
        data = json.loads(urllib.request.urlopen(url, timeout=30).read())
    finally:
        server.shutdown()
        server.server_close()
    status = json.loads(_status(run, "--json"))
    assert data["counts"] == status["counts"] == {
        "committed": 2000, "in_progress": 0, "stale": 64, "pending": 147_936}
    assert data["map"] == "".join(status["map"])
    assert [h["message"] for h in data["hosts"]] == [h["message"] for h in status["hosts"]]
    assert all("ends: RuntimeError: host-" in h["message"] for h in data["hosts"])


@pytest.mark.parametrize("server_page, gcs_page", [(5000, 1000), (40, 40), (40, 20)])
def test_marker_listing_on_gcs_as_pages_come(gcs_bucket, monkeypatch, server_page, gcs_page):
    """One page: one request. Pages of GCS's size: the rest cut into ranges past the first
    page, listed at once. Pages larger than GCS's (an emulator): followed one by one.
    Each gives the markers a plain listing of names gives."""
    run = f"{gcs_bucket}/runs/pages-{server_page}-{gcs_page}"
    status_runs.write_store(run, n_partitions=420, n_hosts=4, committed=333, dead_hosts=1)
    s = store.open_store(run)
    for p in (400, 411):  # markers past gaps, in the last range
        s.write(layout.commit_key(p), s.read(layout.commit_key(0)))
    monkeypatch.setattr(commit, "LIST_RANGE", 50)  # 9 ranges
    monkeypatch.setattr(type(s), "PAGE_ASK", server_page)
    monkeypatch.setattr(type(s), "GCS_PAGE_ITEMS", gcs_page)
    pages = []
    real = type(s)._list_page
    monkeypatch.setattr(type(s), "_list_page", lambda self, *a: pages.append(a) or real(self, *a))
    want = set(range(333)) | {400, 411}
    assert commit.committed_partitions(s, 420) == want
    starts = [a[2] for a in pages]  # each page's startOffset
    assert {int(k[len("commits/p-"):-5]) for k in s.list("commits/")} == want
    if server_page == 5000:
        assert starts == [None]
    elif server_page == gcs_page:
        assert starts[0] is None and len([x for x in starts if x is not None]) >= 8
    else:
        assert starts == [None] * -(-335 // 40)


def test_status_and_the_page_show_the_latest_reference_verify(tmp_path):
    from actx.schemas import reference_verification as ref

    run = _silent_run(tmp_path, hosts=2)
    assert "reference:" not in _status(run)
    assert json.loads(_status(run, "--json"))["reference"] is None
    record = ref.ReferenceRecord(
        at=1.8e9, ok=False, reference="transformers on torch (cpu), float32", seed=0,
        sample=2, tolerance=1e-4, hooks={"layers.0.resid_post": 0.02},
        documents=(ref.CheckedDocument("document d1", "p-00001", 30, 0,
                                       {"layers.0.resid_post": 0.02}),),
        failures=("document d1 (partition p-00001), hook layers.0.resid_post: relative "
                  "error 0.02 > tolerance 0.0001",))
    ref.write_record(store.open_store(run), record)
    assert f"verify:     {record.summary()}" in _status(run).splitlines()
    got = json.loads(_status(run, "--json"))["reference"]
    assert got == {"at": 1.8e9, "ok": False, "summary": record.summary()}
    assert "FAILED: document d1 (partition p-00001)" in got["summary"]
    page = ui_server.PageSource(run_dir.open_run(run), 60.0).data()
    assert page["reference"] == got
    with open(os.path.join(run, ref.REFERENCE_RECORD_KEY), "w") as f:
        f.write('{"at": "yesterday"}')
    assert "reference: unreadable record: " in _status(run)


def test_status_says_what_each_host_did_and_why_one_idles(tmp_path):
    """Issue 50's status: tokens, partitions committed, partitions taken from other
    replicas' lists or given up to them, and the reason a host without work gives."""
    from actx.schemas import config, heartbeat

    run = status_runs.write_local(str(tmp_path / "r"), n_partitions=8, n_hosts=2,
                                  committed=8, dead_hosts=0, now=time.time())
    s = store.open_store(run)
    beats = {
        "host-000": dict(tokens_done=12_345, partitions_done=3, stolen_from={"r1": 2},
                         state="done"),
        "host-001": dict(tokens_done=0, partitions_done=0, given_up={"r0": 2}, state="done",
                         idle_reason="its partitions were all taken by r0 while it loaded"),
    }
    for replica, (host, fields) in enumerate(beats.items()):
        hb = heartbeat.Heartbeat(host=host, replica=replica, process_index=0,
                                 attempt=f"{host}-1", updated_at=time.time(), **fields)
        s.write_json(layout.heartbeat_key(host), config.to_dict(hb))
    text = _status(run)
    assert ("did: 12,345 tokens; 3 partition(s) committed; took 2 from other replicas' "
            "lists (r1 2)") in text
    assert ("did: 0 tokens; 0 partition(s) committed; 2 of its own taken by others first "
            "(r0 2); idle: its partitions were all taken by r0 while it loaded") in text
    hosts = {h["host"]: h for h in json.loads(_status(run, "--json"))["hosts"]}
    assert hosts["host-000"]["stolen_from"] == {"r1": 2}
    assert hosts["host-001"]["given_up"] == {"r0": 2}
    assert hosts["host-001"]["idle_reason"].startswith("its partitions were all taken")
    page = {h["host"]: h for h in ui_server.PageSource(run_dir.open_run(run), 60.0)
            .data()["hosts"]}
    assert page["host-001"]["did"] in text and page["host-000"]["did"] in text


@pytest.mark.parametrize("packing, causes", [
    ({"mode": "segmented", "seq_len": 64}, "past packing.max_context"),
    ({"mode": "segmented", "seq_len": 64, "overflow": "truncate"}, None),
    ({"mode": "concat", "seq_len": 64},
     "documents continued from an earlier concat row"),
])
def test_the_context_line_names_the_causes_of_the_runs_packing(packing, causes):
    from actx.deploy.status import text as status_text
    from actx.schemas import runspec

    spec = runspec.RunSpec.from_dict({
        "name": "c", "model": {"path": "m"}, "tokenizer": {"path": "t"},
        "sources": [{"kind": "text", "paths": ["a.jsonl"]}], "packing": packing})
    ident = {"packing": spec.packing.mode,
             "max_context": spec.packing.max_context if spec.packing.carries_context else None}
    line = status_text._context_causes(ident)
    if causes is None:
        assert line == ""
    else:
        assert line == f" (the rest: {causes}; tokens/context_start says which)"
        assert ("concat" in line) == (packing["mode"] == "concat")


def test_a_host_that_stopped_beating_says_its_counts_are_its_last_heartbeats():
    """A worker killed between a commit and its next beat: its last heartbeat counts fewer
    partitions than its markers (a fault audit saw status lag them); its line says whose
    figure it is, while the totals count the markers."""
    from actx.deploy.status import runstate
    from actx.deploy.status import text as status_text

    def host(live: bool, state: str) -> runstate.HostState:
        return runstate.HostState(host="local-r0h0", state=state, live=live, age_s=90.0,
                                  partition=None, step=0, steps=0, tokens_per_s=0.0,
                                  tokens_done=4_096, message="", partitions_done=2)

    assert status_text.host_did(host(False, "working")) == (
        "by its last heartbeat, 4,096 tokens; 2 partition(s) committed")
    assert status_text.host_did(host(True, "working")) == "4,096 tokens; 2 partition(s) committed"
    assert status_text.host_did(host(False, "done")) == "4,096 tokens; 2 partition(s) committed"
