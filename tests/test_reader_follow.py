"""A stream that follows a live run (reader.streaming.follow) on synthetic runs whose
partitions commit while it reads: every token once in the first epoch, against the run's
own token arrays; the commit order recorded and replayed; a resumed stream's next batch;
the wait that says why; and, on the GCS emulator, one listing per poll and no read per
partition but its data. Real workers: tests/test_reader_follow_workers.py."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import urllib.parse
import time

import numpy as np
import pytest

import actx
from actx.reader import errors
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import layout
from actx.schemas import store as store_lib
from tests import fault_proxy
from tests.reader_fixtures import build_run, commit_partition

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK = "layers.0.resid_post"
FAST = dict(follow=True, poll_s=0.02, stall_s=0.2, wait_timeout_s=30, buffer_tokens=64,
            block_rows=4, prefetch=1, settle_s=0.05)


def _later(truth, partitions, gap=0.05):
    """Commits `partitions` one after another from another thread, as workers would."""
    def go():
        for p in partitions:
            time.sleep(gap)
            commit_partition(truth, p)
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def _tokens(batches) -> np.ndarray:
    return np.concatenate([b.rows * 10_000 + b.cols for b in batches])


def _expected(truth) -> np.ndarray:
    rows, cols = np.nonzero(truth.committed_mask())
    return np.sort(rows * 10_000 + cols)


def _check_values(truth, batches) -> None:
    for b in batches:
        np.testing.assert_array_equal(b.acts[HOOK], truth.value(HOOK, b.rows, b.cols))
        np.testing.assert_array_equal(b.input_ids, truth.tokens["input_ids"][b.rows, b.cols])


def test_first_epoch_holds_every_token_once_as_partitions_commit(tmp_path):
    truth = build_run(str(tmp_path / "run"), num_partitions=6, committed=(0,))
    writer = _later(truth, [3, 1, 5, 2, 4])
    with actx.open_run(truth.uri).stream(HOOK, 40, window_partitions=2, epochs=2,
                                         **FAST) as stream:
        batches = list(stream)
    writer.join()
    first = [b for b in batches if b.epoch == 0]
    second = [b for b in batches if b.epoch == 1]
    # Epoch 1: each token of the complete run exactly once, the values its own.
    np.testing.assert_array_equal(np.sort(_tokens(first)), _expected(truth))
    _check_values(truth, batches)
    assert all(len(b) == 40 for b in first[:-1]) and 0 < len(first[-1]) <= 40
    assert [b.step for b in batches] == list(range(len(batches)))
    assert stream.first_epoch_steps == len(first)
    # The order the partitions committed in, recorded: windows of two in that order, so
    # every batch of a window's tokens comes from its two partitions (or the next's).
    assert stream.commit_order == (0, 3, 1, 5, 2, 4)
    part = _tokens(first) // 10_000 // truth.partition_rows
    windows = [(0, 3), (1, 5), (2, 4)]
    seen = [int(np.flatnonzero(np.isin(part, w)).max()) for w in windows]
    assert seen == sorted(seen)  # window by window
    # Epoch 2: a full shuffle of the complete run (drop_last, the default: the tail that
    # fills no batch is dropped there, as in any stream's epoch; never in the first).
    got, want = _tokens(second), _expected(truth)
    assert len(np.unique(got)) == len(got) == len(want) // 40 * 40
    assert np.isin(got, want).all()

    # Resumed inside the second epoch (the full shuffle): the same rest.
    k = len(first) + 2
    with actx.open_run(truth.uri).stream(HOOK, 40, window_partitions=2, epochs=2,
                                         resume=stream.state(batches[k]), **FAST) as resumed:
        rest = list(resumed)
    assert [(b.step, b.epoch) for b in rest] == [(b.step, b.epoch) for b in batches[k + 1:]]
    for a, b in zip(rest, batches[k + 1:]):
        np.testing.assert_array_equal(a.rows, b.rows)

    # The same stream again, on the complete run: the recorded order replays it batch for
    # batch; the markers' own times give the same order without it.
    for keywords in ({"commit_order": stream.commit_order}, {}):
        with actx.open_run(truth.uri).stream(HOOK, 40, window_partitions=2, epochs=2,
                                             **FAST, **keywords) as replay:
            again = list(replay)
        assert [(b.step, b.epoch) for b in again] == [(b.step, b.epoch) for b in batches]
        for a, b in zip(again, batches):
            np.testing.assert_array_equal(a.rows, b.rows)
            np.testing.assert_array_equal(a.cols, b.cols)


def test_a_resumed_stream_gives_the_same_next_batch_with_what_committed_meanwhile(tmp_path):
    truth = build_run(str(tmp_path / "run"), num_partitions=6, committed=(0, 2))
    keywords = dict(window_partitions=1, seed=7, **FAST)
    with actx.open_run(truth.uri).stream(HOOK, 24, **keywords) as stream:
        taken = []
        for batch in stream:
            taken.append(batch)
            if len(taken) == 5:  # inside the second partition's window
                break
        state = stream.state(taken[-1])
    assert state["commit_order"] == [0, 2] and state["next_step"] == 5
    for p in (5, 1):  # commit while the trainer is stopped
        commit_partition(truth, p)
        time.sleep(0.02)
    writer = _later(truth, [4, 3])
    with actx.open_run(truth.uri).stream(HOOK, 24, resume=state, **keywords) as resumed:
        rest = list(resumed)
    writer.join()
    assert [b.step for b in rest] == list(range(5, 5 + len(rest)))
    assert resumed.commit_order == (0, 2, 5, 1, 4, 3)
    # Every token of the run once, over the two streams.
    np.testing.assert_array_equal(np.sort(_tokens(taken + rest)), _expected(truth))
    _check_values(truth, rest)
    # The same batches as a stream that never stopped (replayed in the recorded order).
    with actx.open_run(truth.uri).stream(HOOK, 24, commit_order=resumed.commit_order,
                                         **keywords) as whole:
        reference = list(whole)
    for a, b in zip(reference, taken + rest, strict=True):
        assert a.step == b.step
        np.testing.assert_array_equal(a.rows, b.rows)
        np.testing.assert_array_equal(a.cols, b.cols)
    # A state of another order setting is refused by name.
    with pytest.raises(ValueError, match="follow_window saved 1, now 2"):
        actx.open_run(truth.uri).stream(HOOK, 24, resume=state,
                                        **dict(keywords, window_partitions=2))


def test_processes_share_each_window_and_read_every_token_once(tmp_path):
    truth = build_run(str(tmp_path / "run"), num_partitions=4, committed=(1,))
    writer = _later(truth, [0, 3, 2])
    got = {}

    def read(i):
        with actx.open_run(truth.uri).stream(HOOK, 16, window_partitions=2, process_index=i,
                                             process_count=2, **FAST) as stream:
            got[i] = list(stream)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.join()
    both = np.concatenate([_tokens(got[0]), _tokens(got[1])])
    np.testing.assert_array_equal(np.sort(both), _expected(truth))


@pytest.mark.parametrize("exact,codec", [(False, "zstd"), (False, "none"), (True, "zstd")])
def test_processes_take_equal_token_counts_however_many_windows(tmp_path, exact, codec):
    """A data-parallel loop steps its processes together: their first epochs must hold as
    many tokens (within one) and so as many batches, over any number of windows. Each
    window is split by tokens, continuing the count of the windows before it (a block at
    the edge of two shares read by both; codec none: copied from its mapped shard files);
    a resumed process takes the same batches on."""
    truth = build_run(str(tmp_path / "run"), num_partitions=9, committed=(4,), codec=codec)
    writer = _later(truth, [0, 7, 2, 8, 1, 6, 3, 5], gap=0.02)
    processes, size = 3, 8
    got, states = {}, {}

    def read(i):
        run = actx.open_run(truth.uri)
        keywords = dict(window_partitions=1, process_index=i, process_count=processes,
                        **({k: v for k, v in FAST.items()
                            if k not in ("buffer_tokens", "block_rows")} if exact else FAST))
        opened = run.batches if exact else run.stream
        with opened(HOOK, size, **keywords) as stream:
            got[i] = list(stream)
            states[i] = (stream.state(got[i][4]), keywords)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(processes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.join()
    counts = [len(_tokens(got[i])) for i in range(processes)]
    total = len(_expected(truth))
    # Every token once; the counts as even as they can be (the first processes hold the
    # one more where the total does not divide), so the batch counts are equal.
    np.testing.assert_array_equal(
        np.sort(np.concatenate([_tokens(got[i]) for i in range(processes)])), _expected(truth))
    assert counts == [total // processes + (i < total % processes) for i in range(processes)]
    assert len({len(got[i]) for i in range(processes)}) == 1, [len(got[i]) for i in got]
    assert all(len(b) == size for i in got for b in got[i][:-1])
    for i in got:
        _check_values(truth, got[i])
    # A process resumed after its fifth batch takes the same batches on.
    state, keywords = states[1]
    run = actx.open_run(truth.uri)
    opened = run.batches if exact else run.stream
    with opened(HOOK, size, resume=state, **keywords) as resumed:
        np.testing.assert_array_equal(_tokens(list(resumed)), _tokens(got[1][5:]))
    # A state saved before the split (whole blocks a process) would resume elsewhere.
    earlier = {k: v for k, v in state.items() if k != "follow_split"}
    with pytest.raises(ValueError, match="took whole blocks of a followed run's windows"):
        opened(HOOK, size, resume=earlier, **keywords)


def test_one_process_reads_each_window_as_a_stream_of_its_partitions(tmp_path):
    """With one process nothing is split: a window's tokens come in the order run.stream
    gives over its partitions with the window's seed."""
    from actx.reader.streaming import follow

    truth = build_run(str(tmp_path / "run"), num_partitions=4, committed=(2, 0, 1, 3))
    run = actx.open_run(truth.uri)
    keywords = {k: v for k, v in FAST.items() if k in ("buffer_tokens", "block_rows")}
    with run.stream(HOOK, 16, window_partitions=2, **FAST) as stream:
        got = _tokens(list(stream))
        order = stream.commit_order
    with run.stream(HOOK, 16, partitions=order[:2], seed=follow.window_seed(0, 0),
                    drop_last=False, **keywords) as own:
        window = _tokens(list(own))
    np.testing.assert_array_equal(got[:len(window)], window)


def test_every_reader_builds_the_same_order_whenever_it_lists(tmp_path, monkeypatch):
    """A marker's version is its write's time, and it is seen a little later (a local file
    is linked in place after its write; a GCS upload ends after its generation): a reader
    that lists in between sees a marker with a later time before one with an earlier time.
    Readers that took what they listed in time order at once then built different orders,
    so the processes of a data-parallel job cut different windows (the audit: 114 of 480
    tokens twice, 128 never). A partition joins the order once its time is settle_s behind
    the store's clock: every reader builds the order of the markers' times."""
    from actx.reader.streaming import follow

    truth = build_run(str(tmp_path / "run"), num_partitions=4, committed=(0,))
    run = actx.open_run(truth.uri)
    marker = lambda p: os.path.join(truth.uri, layout.commit_key(p))  # noqa: E731
    t0 = os.stat(marker(0)).st_mtime_ns
    clock = [t0]
    monkeypatch.setattr(follow.time, "time_ns", lambda: clock[0])

    def follower():
        return follow.CommitFollower(run, None, follow.FollowOptions(
            follow=True, settle_s=1.0), threading.Event())

    def commit(p, at_s):
        commit_partition(truth, p)
        os.utime(marker(p), ns=(t0 + int(at_s * 1e9),) * 2)  # written at t0 + at_s

    early = follower()
    commit(2, 2.0)  # seen first, written second ...
    clock[0] = t0 + int(2.5e9)
    early.poll()
    assert early.order == [0], early.order  # partition 2 is not settled: 1 may come
    commit(1, 1.0)  # ... partition 1, written before it, seen after it
    clock[0] = t0 + int(3.5e9)
    early.poll()
    late = follower()
    late.poll()
    assert early.order == late.order == [0, 1, 2], (early.order, late.order)
    # A complete run settles at once, in the markers' order, for every reader.
    commit(3, 3.4)
    early.poll()
    assert early.order == [0, 1, 2, 3] and early.complete


def test_a_local_markers_time_is_taken_after_its_write_reaches_the_disk(tmp_path,
                                                                        monkeypatch):
    """The order settles markers settle_s behind their times; a local marker's time was its
    temporary's write, before an fsync that can stall for seconds on a busy disk, so it
    could be seen long after its time. The time is taken after the fsync, right before
    the link that makes it seen."""
    from actx.schemas import store as store_module

    fsync = os.fsync
    monkeypatch.setattr(store_module.os, "fsync", lambda fd: (time.sleep(1.0), fsync(fd)))
    s = store_lib.open_store(str(tmp_path))
    before = time.time_ns()
    assert s.create(layout.commit_key(0), b"{}")
    stamp = int(s.list_stamps(layout.COMMITS_PREFIX)[layout.commit_key(0)][1])
    assert stamp >= before + 0.9e9, (stamp - before) / 1e9


def test_memory_runs_order_their_markers_as_they_appear(tmp_path):
    """memory://: every version was 0 (ordered by partition id: a reader that listed before
    partition 1 committed put it after 2, one that listed after, before). The memory
    kvstore counts its writes: a marker's version is the count at its write, seen as made,
    so readers agree whenever they list."""
    from actx.reader.streaming import follow

    truth = build_run("memory://follow-order", num_partitions=4, committed=(0,))
    run = actx.open_run(truth.uri)

    def follower():
        return follow.CommitFollower(run, None, follow.FollowOptions(follow=True),
                                     threading.Event())

    early = follower()
    commit_partition(truth, 2)
    early.poll()
    commit_partition(truth, 1)
    early.poll()
    late = follower()
    late.poll()
    assert early.order == late.order == [0, 2, 1], (early.order, late.order)


def test_a_stalled_run_is_waited_for_with_its_phase_dead_hosts_and_advice(tmp_path, caplog):
    truth = build_run(str(tmp_path / "run"), num_partitions=3, committed=(0,))
    store = store_lib.open_store(truth.uri)
    now = time.time()
    heartbeat_lib.HeartbeatWriter(store, "local-r0h0").beat(heartbeat_lib.Heartbeat(
        host="local-r0h0", replica=0, process_index=0, state="failed", attempt="a",
        updated_at=now, message="out of memory in partition 1"), force=True)
    heartbeat_lib.HeartbeatWriter(store, "local-r0h1").beat(heartbeat_lib.Heartbeat(
        host="local-r0h1", replica=0, process_index=1, state="working", attempt="b",
        updated_at=now - 600, partition=2), force=True)
    stream = actx.open_run(truth.uri).stream(HOOK, 16, window_partitions=1,
                                             **dict(FAST, wait_timeout_s=0.6))
    taken = []
    with caplog.at_level("WARNING", logger="actx.reader.follow"):
        with pytest.raises(errors.RunStalledError) as raised:
            for batch in stream:
                taken.append(batch)
    stream.close()
    said = str(raised.value)
    assert "phase failed" in said and "1 of 3 partitions committed" in said
    assert "local-r0h0 failed (out of memory in partition 1)" in said
    assert "local-r0h1 working (stale)" in said
    assert f"`actx rerun {truth.uri}` after a fix" in said
    assert "resume=stream.state(last_batch)" in said
    assert any("phase failed" in r.getMessage() for r in caplog.records)  # said while waiting
    # Nothing skipped, no epoch ended: the batches so far are partition 0's tokens only
    # (the last short one still held back: the epoch goes on).
    got = _tokens(taken)
    assert len(np.unique(got)) == len(got) and (got // 10_000 < truth.partition_rows).all()
    assert all(len(b) == 16 for b in taken)
    assert len(got) == truth.committed_mask().sum() // 16 * 16


def test_a_stopped_run_rerun_later_continues_the_same_stream(tmp_path):
    truth = build_run(str(tmp_path / "run"), num_partitions=4, committed=(0,))
    store = store_lib.open_store(truth.uri)
    heartbeat_lib.HeartbeatWriter(store, "local-r0h0").beat(heartbeat_lib.Heartbeat(
        host="local-r0h0", replica=0, process_index=0, state="preempted", attempt="a",
        updated_at=time.time()), force=True)
    with actx.open_run(truth.uri).stream(HOOK, 16, window_partitions=1,
                                         **dict(FAST, stall_s=0.1)) as stream:
        it = iter(stream)
        first = [next(it) for _ in range(truth.committed_mask().sum() // 16)]
        deadline = time.monotonic() + 60  # stopped: the stream waits, and says so
        while not stream.waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "phase stopped" in stream.waiting and "dead hosts: local-r0h0 stopped" \
            in stream.waiting and f"`actx rerun {truth.uri}` finishes them" in stream.waiting
        writer = _later(truth, [2, 1, 3])  # the rerun
        rest = list(it)
    writer.join()
    np.testing.assert_array_equal(np.sort(_tokens(first + rest)), _expected(truth))


def test_follow_keywords_need_follow_and_outlier_is_refused(tmp_path):
    truth = build_run(str(tmp_path / "run"), num_partitions=2, committed=(0,))
    run = actx.open_run(truth.uri)
    with pytest.raises(TypeError, match="window_partitions: only with follow=True"):
        run.stream(HOOK, 8, window_partitions=2)
    with pytest.raises(ValueError, match="'outlier' needs the token norms"):
        run.stream(HOOK, 8, follow=True, exclude=["outlier"])
    with pytest.raises(ValueError, match=r"wait_timeout_s \(20\) must be longer than "
                                         r"settle_s \(30\)"):
        run.stream(HOOK, 8, follow=True, wait_timeout_s=20)


def test_masks_and_normalisation_work_on_a_live_run(tmp_path):
    truth = build_run(str(tmp_path / "run"), num_partitions=4, committed=(0, 1))
    run = actx.open_run(truth.uri)
    stats = run.compute_stats([HOOK])[HOOK]
    record = store_lib.open_store(truth.uri).read_json(layout.STATS_KEY)["hooks"][HOOK]
    assert record["partitions"] == [0, 1] and record["run_partitions"] == 4
    assert not stats.complete
    writer = _later(truth, [3, 2])
    with run.stream(HOOK, 32, exclude=["bos", "padding"], normalize="standardize",
                    window_partitions=2, **FAST) as stream:
        batches = list(stream)
    writer.join()
    mask = truth.committed_mask() & (truth.tokens["input_ids"] != 1)
    rows, cols = np.nonzero(mask)
    np.testing.assert_array_equal(np.sort(_tokens(batches)), np.sort(rows * 10_000 + cols))
    b = batches[0]
    want = (truth.value(HOOK, b.rows, b.cols).astype(np.float64) - stats.mean) / np.sqrt(
        stats.var)
    np.testing.assert_allclose(b.acts[HOOK], want, rtol=1e-5, atol=1e-5)
    # Once the run is complete, statistics computed again cover it, and say so.
    assert actx.open_run(truth.uri).compute_stats([HOOK])[HOOK].complete


def follow_in_process(out, uri, batch_size, options, env=None, timeout=300):
    """tests.follow_probe in a process of its own; what it read."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.follow_probe", str(out), uri, HOOK, str(batch_size),
         json.dumps(options)], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        return json.load(f)


def test_gcs_follower_lists_once_per_poll_and_reads_no_marker(tmp_path, gcs_emulator_server):
    """The follower in its own process, both its GCS clients (tensorstore's and
    google-cloud-storage's) through a proxy that records every request."""
    uri = gcs_emulator_server.create_bucket("actx-follow") + "/run"
    truth = build_run(uri, num_partitions=4, committed=(0,), rows_per_shard=8)
    proxy = fault_proxy.FaultProxy(gcs_emulator_server.url).start()
    seen = []
    lock = threading.Lock()

    def record(req):
        with lock:
            seen.append((req.method, req.path, req.object_name))
        return False

    proxy.add_rule("503", record, times=None)
    poll, stall = 0.25, 0.6
    options = dict(window_partitions=1, poll_s=poll, stall_s=stall, wait_timeout_s=60,
                   buffer_tokens=128, block_rows=8)
    def commit_once_it_follows():  # this process's commits do not go through the proxy
        while not any("commits%2F" in path or "commits/" in path for _, path, _ in seen):
            time.sleep(0.05)
        for p in (2, 1, 3):
            time.sleep(1.0)
            commit_partition(truth, p)

    writer = threading.Thread(target=commit_once_it_follows, daemon=True)
    writer.start()
    start = time.monotonic()
    try:
        got = follow_in_process(tmp_path / "out.json", uri, 64, options,
                                env={"TENSORSTORE_GCS_HTTP_URL": proxy.url,
                                     "STORAGE_EMULATOR_HOST": proxy.url})
    finally:
        proxy.stop()
    took = time.monotonic() - start
    writer.join()
    rows, cols = np.nonzero(truth.committed_mask())
    assert sorted(got["tokens"]) == sorted((rows * truth.seq_len + cols).tolist())
    listed = collections.Counter(
        urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("prefix", [""])[0]
        for method, path, name in seen
        if method == "GET" and not name and urllib.parse.urlsplit(path).path.endswith("/o"))
    # Besides: the bucket's metadata, once, where the store is opened.
    assert sum(1 for m, p, n in seen if m == "GET" and not n and not
               urllib.parse.urlsplit(p).path.endswith("/o")) <= 1
    # One listing of commits/ per poll interval at most (the first at open), as the
    # stream counted them; while it waits past stall_s, one of workers/ per stall_s
    # says why. Nothing else is listed.
    # (open_run lists once more: the snapshot a run is opened with.)
    assert listed["run/commits/"] == got["listings"] + 1
    assert 3 <= got["listings"] <= took / poll + 2
    assert 0 < listed["run/workers/"] <= took / stall + 1
    # (and open_run lists whether a verify recorded failed partitions: once)
    assert listed["run/verify/latest.json"] <= 1, listed
    # (and the hook's shard objects, once, at its first read: a committed partition's
    # lost objects would read as zeros, reader.shard_presence. Every object here was
    # written before the run was opened, so no later commit looks for its own again.)
    assert listed["run/activations/layers.0.resid_post/c/"] == 1, listed
    assert set(listed) <= {"run/", "run/commits/", "run/workers/", "run/verify/latest.json",
                           "run/activations/layers.0.resid_post/c/"}, listed
    # No marker is read; what is read once per run (specs, array metadata) is read once,
    # not once per partition or window; the rest is the partitions' data.
    reads = collections.Counter(name for method, name in
                                ((m, n) for m, _, n in seen) if method == "GET" and name)
    assert not [k for k in reads if k.startswith("run/commits/")]
    once = {k: n for k, n in reads.items() if not k.startswith(("run/activations/",
                                                                 "run/tokens/"))
            or k.endswith((".json", "zarr.json"))}
    assert all(n <= 2 for n in once.values()), once
    assert all(k.startswith(("run/activations/", "run/tokens/")) for k in reads
               if k not in once), reads


def test_exact_batches_follow_window_by_window(tmp_path):
    """run.batches(follow=True): each window of the commit order in one exact permutation
    of its tokens (what run.batches gives over those partitions), every token once."""
    truth = build_run(str(tmp_path / "run"), num_partitions=4, committed=(1,))
    writer = _later(truth, [3, 0, 2])
    run = actx.open_run(truth.uri)
    with run.batches(HOOK, 32, follow=True, window_partitions=2, poll_s=0.02,
                     wait_timeout_s=30, settle_s=0.05, epochs=2, drop_last=False) as batches:
        got = list(batches)
    writer.join()
    first = [b for b in got if b.epoch == 0]
    np.testing.assert_array_equal(np.sort(_tokens(first)), _expected(truth))
    np.testing.assert_array_equal(np.sort(_tokens([b for b in got if b.epoch == 1])),
                                  _expected(truth))
    _check_values(truth, got)
    assert batches.commit_order == (1, 3, 0, 2)
    # The first window's tokens are run.batches' permutation of partitions 1 and 3, with
    # the window's seed, cut into the same batches.
    from actx.reader.streaming import follow

    with run.batches(HOOK, 32, partitions=[1, 3], seed=follow.window_seed(0, 0),
                     drop_last=False) as own:
        window = _tokens(list(own))
    np.testing.assert_array_equal(_tokens(first)[:len(window)], window)


def test_exact_batches_that_gave_up_on_a_stalled_run_resume_as_their_error_says(tmp_path):
    """RunStalledError says to open the stream again with resume=stream.state(last_batch):
    run.batches(follow=True) takes resume= too (it took no such keyword: the advice failed
    as printed), and goes on with the next batch of the unbroken order."""
    truth = build_run(str(tmp_path / "run"), num_partitions=3, committed=(0,))
    run = actx.open_run(truth.uri)
    keywords = dict(follow=True, window_partitions=1, poll_s=0.02, stall_s=0.1,
                    settle_s=0.05, drop_last=False)
    taken = []
    with pytest.raises(errors.RunStalledError) as raised:
        with run.batches(HOOK, 16, wait_timeout_s=0.4, **keywords) as stalled:
            for batch in stalled:
                taken.append(batch)
    assert "resume=stream.state(last_batch)" in str(raised.value)
    assert taken  # partition 0's whole batches came before the wait
    commit_partition(truth, 1)
    commit_partition(truth, 2)
    with run.batches(HOOK, 16, resume=stalled.state(taken[-1]), wait_timeout_s=30,
                     **keywords) as resumed:
        rest = list(resumed)
    with run.batches(HOOK, 16, wait_timeout_s=30, commit_order=stalled.commit_order,
                     **keywords) as unbroken:
        whole = list(unbroken)
    assert [b.step for b in rest] == [b.step for b in whole[len(taken):]]
    np.testing.assert_array_equal(_tokens(taken + rest), _tokens(whole))
    with pytest.raises(TypeError, match="start_step="):
        run.batches(HOOK, 16, resume=stalled.state(taken[-1]))
