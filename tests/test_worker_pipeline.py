"""One pipeline across partitions: a partition boundary never drains the steps in flight,
and the stream's bytes equal one schedule per partition, whatever the steps in flight.

In-process workers (8 simulated CPU devices), tiny random models, token stores packed by the
real packer: `overflow: continue` (rows carry context), `overflow: truncate` and `concat`
(rows independent).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from actx.schemas import commit as commit_lib
from actx.schemas import layout, manifest, store, worker_options
from tests import hf_models, token_runs, worker_procs
from actx.workers.loop import prefetch, runner, schedule
from actx.workers.write import writer

RUNS = {
    "continue": dict(),
    "truncate": dict(overflow="truncate", lengths=token_runs.LONG_DOC_LENGTHS * 4),
    "concat": dict(mode="concat"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen2", "qwen2"))


def _run(model_dir, path, packing: str, partition_rows: int) -> str:
    token_runs.write_long_document_run(str(path), model_dir, partition_rows=partition_rows,
                                       hooks="layers.1.resid_post,final_norm",
                                       **RUNS[packing])
    return str(path)


@pytest.mark.parametrize("packing", sorted(RUNS))
def test_next_partition_is_dispatched_before_the_last_rows_are_handled(
        model_dir, tmp_path, monkeypatch, packing):
    """The output thread holds partition 0's last rows until the step function has been
    called for partition 1's first rows (or 30 s pass): a loop that drains its steps at a
    partition's end never calls it, since those rows are not yet handled."""
    run = _run(model_dir, tmp_path / "run", packing, partition_rows=8)
    part0 = manifest.read_manifest(store.open_store(run)).partition(0)
    last_row0 = part0.row_start + part0.row_count - 1
    events: list[tuple] = []
    next_dispatched = threading.Event()
    dispatching = threading.local()

    batches = prefetch.Prefetcher.__iter__

    def iterate(self):  # the dispatching thread takes each batch just before its step
        for batch in batches(self):
            dispatching.batch = batch
            yield batch

    monkeypatch.setattr(prefetch.Prefetcher, "__iter__", iterate)
    add_slots = writer.PartitionWriter.add_slots

    def add(self, rows, write, pieces, tokens=None):
        if any(w and r == last_row0 for r, w in zip(rows, write)):
            events.append(("last rows of 0 handled", next_dispatched.wait(30)))
        add_slots(self, rows, write, pieces, tokens)

    monkeypatch.setattr(writer.PartitionWriter, "add_slots", add)
    commit = commit_lib.commit

    def commit_marker(s, marker):
        events.append(("marker", marker.partition))
        return commit(s, marker)

    monkeypatch.setattr(commit_lib, "commit", commit_marker)
    worker = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8, steps_in_flight=2))
    step_fn = worker.loaded.fn

    def step(*args, **kwargs):
        batch = dispatching.batch
        if any(w and r > last_row0 for r, w in zip(batch.step.rows, batch.step.write)):
            if not next_dispatched.is_set():
                events.append(("step with rows of 1",))
            next_dispatched.set()
        return step_fn(*args, **kwargs)

    worker.loaded = dataclasses.replace(worker.loaded, fn=step)
    assert worker.run() == 0
    assert ("last rows of 0 handled", True) in events, events
    assert events.index(("step with rows of 1",)) < events.index(("marker", 0)), events
    assert commit_lib.committed_partitions(store.open_store(run)) == set(
        range(len(manifest.read_manifest(store.open_store(run)).partitions)))


@pytest.mark.parametrize("packing", sorted(RUNS))
def test_stream_bytes_equal_one_schedule_per_partition(model_dir, tmp_path, packing):
    """Partitions of 12 rows and steps of 8: the stream runs rows of two partitions in one
    step; with 1 or 3 steps in flight it stores the bytes of the per-partition schedule."""
    reference = _run(model_dir, tmp_path / "ref", packing, partition_rows=12)
    worker = runner.Worker(worker_options.WorkerOptions(run=reference, batch_size=8))
    pids = [p.id for p in worker.manifest.partitions]
    assert len(pids) >= 3
    session = worker.open_session()
    try:
        for pid in pids:  # one schedule per partition: planned, run and drained alone
            worker.run_partition(pid, session.pool, session.committer)
        session.committer.drain()
    finally:
        session.close()
    ref_markers = _markers(reference)
    assert sorted(ref_markers) == pids
    for in_flight in (1, 3):
        run = worker_procs.copy_token_store(reference, str(tmp_path / f"run{in_flight}"))
        w = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8,
                                               steps_in_flight=in_flight))
        assert w.run() == 0
        assert w.timings.steps > 0
        worker_procs.assert_same_activations(run, reference)
        assert {p: m.checksums for p, m in _markers(run).items()} == {
            p: m.checksums for p, m in ref_markers.items()}


def test_output_memory_modes_store_the_same_bytes(model_dir, tmp_path, monkeypatch):
    """Where the step's outputs land (transfer.OUTPUT_MEMORY; bench/extract.py A/Bs them on
    a GPU) changes no stored byte: the CPU's pinned_host memory kind stands in for a GPU's.
    "pinned_host": the executable writes its outputs there; "pinned_copy": it leaves them
    in device memory and the loop copies them there; either way the output thread reads
    arrays in pinned host memory."""
    import jax

    from actx.workers.loop import outputs, transfer

    reference = _run(model_dir, tmp_path / "ref", "continue", partition_rows=12)
    assert runner.Worker(worker_options.WorkerOptions(run=reference, batch_size=8)).run() == 0
    kinds = set()
    host_pieces = outputs.host_pieces

    def recorded(outs, timings):
        kinds.update(x.sharding.memory_kind for x in outs.values())
        return host_pieces(outs, timings)

    monkeypatch.setattr(outputs, "host_pieces", recorded)
    for mode in ("pinned_host", "pinned_copy"):
        kinds.clear()
        monkeypatch.setattr(transfer, "OUTPUT_MEMORY", mode)
        run = worker_procs.copy_token_store(reference, str(tmp_path / mode))
        worker = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8))
        assert (worker.loaded.fn.output_memory_kind == "pinned_host") == (mode == "pinned_host")
        assert worker.run() == 0
        assert kinds == {"pinned_host"}, mode
        worker_procs.assert_same_activations(run, reference)
        assert {p: m.checksums for p, m in _markers(run).items()} == {
            p: m.checksums for p, m in _markers(reference).items()}
    monkeypatch.setattr(transfer, "OUTPUT_MEMORY", "pinned")
    with pytest.raises(ValueError, match="pinned_copy"):
        transfer.output_memory_kind(jax)


def _markers(run: str) -> dict[int, commit_lib.CommitMarker]:
    s = store.open_store(run)
    return {p: commit_lib.read_marker(s, p) for p in commit_lib.committed_partitions(s)}


def test_an_error_on_the_output_thread_stops_the_loop_and_commits_nothing_after(
        model_dir, tmp_path, monkeypatch):
    run = _run(model_dir, tmp_path / "run", "truncate", partition_rows=8)
    add_slots = writer.PartitionWriter.add_slots
    calls = []

    def add(self, rows, write, pieces, tokens=None):
        calls.append(rows)
        if len(calls) == 3:
            raise OSError("disk gone")
        add_slots(self, rows, write, pieces, tokens)

    monkeypatch.setattr(writer.PartitionWriter, "add_slots", add)
    worker = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8, steps_in_flight=3))
    with pytest.raises(OSError, match="disk gone"):
        worker.run()
    # Partitions of 8 rows, one step each: the third step's partition and later are not
    # committed; at most the two before it are.
    assert commit_lib.committed_partitions(store.open_store(run)) <= {0, 1}
    assert len(calls) == 3


def test_a_planning_error_is_raised_before_the_failure_of_a_step_it_caused(
        model_dir, tmp_path, monkeypatch):
    """The third partition choice raises; the output thread, holding the first step, then
    fails too (as a multi-host leader's step does once the host it told of its error has
    left): the worker raises the choice's error, the cause, and commits nothing."""
    run = _run(model_dir, tmp_path / "run", "truncate", partition_rows=8)
    choose, chosen = runner.Worker.choose_partition, []
    choice_failed = threading.Event()

    def failing_choice(self, tried, idle=True, rows_in_hand=0):
        chosen.append(rows_in_hand)
        if len(chosen) == 3:
            choice_failed.set()
            raise OSError("claims store unreachable (test)")
        return choose(self, tried, idle, rows_in_hand)

    def lost_peer(self, rows, write, pieces, tokens=None):
        assert choice_failed.wait(30)
        raise ConnectionResetError("the step's peer reset the connection (test)")

    monkeypatch.setattr(runner.Worker, "choose_partition", failing_choice)
    monkeypatch.setattr(writer.PartitionWriter, "add_slots", lost_peer)
    worker = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8,
                                                        steps_in_flight=1))
    with pytest.raises(OSError, match="claims store unreachable") as raised:
        worker.run()
    assert raised.value.__suppress_context__  # the step's failure is logged, not chained
    assert len(chosen) == 3
    assert commit_lib.committed_partitions(store.open_store(run)) == set()


def test_output_thread_bounds_the_steps_in_flight():
    from actx.workers.loop import outputs

    handled, release = [], threading.Event()

    def handle(i):
        release.wait(10)
        handled.append(i)

    thread = outputs.OutputThread(handle, steps_in_flight=2)
    thread.wait_for_room()
    thread.put(0)
    thread.wait_for_room()
    thread.put(1)
    blocked = threading.Thread(target=thread.wait_for_room)
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # two steps unhandled: no room for a third
    release.set()
    blocked.join(10)
    assert not blocked.is_alive()
    thread.put(2)
    thread.drain()
    thread.close()
    assert handled == [0, 1, 2]


@pytest.mark.parametrize("packing", ["truncate", "concat"])
def test_two_host_replica_streams_independent_rows_byte_identical(model_dir, tmp_path,
                                                                  packing):
    """Rows without context now stream on multi-host replicas too: partitions of 3 shards
    over 2 hosts, so the hosts finish each partition at different steps and commit it when
    they agree; the bytes equal one process's."""
    ref = _run(model_dir, tmp_path / "ref", packing, partition_rows=12)
    code, out = worker_procs.run_worker(["--run", ref, "--batch-size", "4"], devices=2)
    assert code == 0, out
    run = worker_procs.copy_token_store(ref, str(tmp_path / "run"))
    for code, out in worker_procs.run_replica(run, hosts=2, devices_per_host=1,
                                              extra=["--batch-size", "4",
                                                     "--stop-check-steps", "3"]):
        assert code == 0, out
    worker_procs.assert_same_activations(run, ref)
    markers = _markers(run)
    assert sorted(markers) == sorted(_markers(ref))
    for pid, marker in markers.items():
        assert marker.checksums == _markers(ref)[pid].checksums
        assert marker.hosts == ("r0h0", "r0h1")


def _probe_events(path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


def _stealing_replica(run: str, tmp_path, **env: str) -> tuple[list, list]:
    """Replica 0 of 2, two hosts, stealing, under tests/stream_probe_worker.py: each host's
    (exit code, output) and its probe file."""
    probes = [tmp_path / f"probe{i}.txt" for i in range(2)]
    results = worker_procs.run_replica(
        run, hosts=2, devices_per_host=1,
        extra=["--batch-size", "4", "--stop-check-steps", "3", "--replicas", "2",
               "--replica", "0", "--steal", "--job", "j1"],
        module="tests.stream_probe_worker",
        # Replica 1 never starts: its partitions are taken at once, not after the
        # start-up grace a replica that has not beaten keeps them for.
        host_env=lambda i: {"ACTX_STREAM_PROBE": str(probes[i]), "ACTX_START_GRACE_S": "0",
                            **env})
    return results, probes


@pytest.mark.parametrize("slices", ["even", "uneven"])
def test_two_host_replica_that_steals_streams_and_follows_its_leaders_claims(model_dir,
                                                                            tmp_path, slices):
    """A stealing multi-host replica streams too: its leader chooses (and claims) partitions
    as the stream goes, and the other host takes the same ones from jax.distributed's
    key-value store. Replica 1 of 2 never runs, but another attempt of the job claimed one
    of its partitions: replica 0's two hosts extract and commit every other partition, its
    own and stolen, with one process's bytes, and leave the claimed one alone. The hosts
    agree on what they finished over a window of one partition, so the others finish
    beyond it and commit as it moves.

    even: partitions of 2 objects, one a host, so neither host runs out of rows before the
    other, and neither drains at a partition boundary. uneven: partitions of 3 objects (2
    on the leader, 1 on the other host) and a leader that chooses nothing ahead, so the
    other host finds the next partition not yet chosen and pads until it is."""
    ref = _run(model_dir, tmp_path / "ref", "continue",
               partition_rows=8 if slices == "even" else 12)
    code, out = worker_procs.run_worker(["--run", ref, "--batch-size", "4"], devices=2)
    assert code == 0, out
    run = worker_procs.copy_token_store(ref, str(tmp_path / "run"))
    s = store.open_store(run)
    partitions = manifest.read_manifest(s).partitions
    assert len(partitions) >= 4
    claimed = partitions[-1].id if partitions[-1].id % 2 else partitions[-2].id  # replica 1's
    assert schedule.try_claim(s, "j1", claimed, "another-attempt")
    env = {"ACTX_AGREEMENT_WINDOW": "1"}
    if slices == "uneven":
        env["ACTX_LEADER_LOOKAHEAD"] = "0"
    results, probes = _stealing_replica(run, tmp_path, **env)
    for code, out in results:
        assert code == 0, out
    # No drain at a partition boundary: the next partition's first rows were dispatched
    # before the previous partition's commit was submitted (on the host with fewer rows
    # of each partition, only while it had the leader's next choice).
    partition_of = {row: p.id for p in partitions
                    for row in range(p.row_start, p.row_start + p.row_count)}
    for host, probe in enumerate(probes):
        events = _probe_events(probe)
        first_dispatch, commit_at = {}, {}
        for i, event in enumerate(events):
            if event[0] == "dispatch":
                first_dispatch.setdefault(partition_of[int(event[1])], i)
            elif event[0] == "commit":
                commit_at[int(event[1])] = i
        order = sorted(first_dispatch, key=first_dispatch.get)
        assert sorted(order) == sorted(p.id for p in partitions if p.id != claimed)
        assert sorted(commit_at) == sorted(order)
        if slices == "even" or host == 0:
            for before, after in zip(order, order[1:]):
                assert first_dispatch[after] < commit_at[before], (probe.name, before, after)
    # The leader's choice is told the rows it has in hand still to write (what a slow
    # replica counts before it takes another partition): none at its first choice, some
    # while it chooses ahead, never more than the partitions chosen and not yet committed
    # hold on it (2 objects of 4 rows of each partition, uneven: 1 of 4 on the other host).
    leader_rows = 4 if slices == "even" else 8
    chosen, committed, in_hand = [], set(), []
    for event in _probe_events(probes[0]):
        if event[0] == "commit":
            committed.add(int(event[1]))
        elif event[0] == "choose":
            idle, rows, pid = map(int, event[1:])
            assert rows <= leader_rows * len(set(chosen) - committed), event
            assert not (idle and rows), event
            in_hand.append(rows)
            chosen += [pid] if pid >= 0 else []
    assert in_hand[0] == 0 and max(in_hand) > 0, in_hand
    assert sorted(chosen) == sorted(order)
    waits = [sum(e == ["not-yet"] for e in _probe_events(p)) for p in probes]
    assert waits[0] == 0  # the leader never waits for itself
    if slices == "uneven":
        assert waits[1] > 0
    ref_markers, markers = _markers(ref), _markers(run)
    assert sorted(markers) == sorted(p.id for p in partitions if p.id != claimed)
    for pid, marker in markers.items():
        assert marker.checksums == ref_markers[pid].checksums
        assert marker.hosts == ("r0h0", "r0h1")
        assert s.exists(layout.claim_key("j1", pid))
    objects, ref_objects = worker_procs.stored_objects(run), worker_procs.stored_objects(ref)
    objects.pop("activations/actx.json")
    part = next(p for p in partitions if p.id == claimed)
    rows_per_object = 4  # token_runs.write_long_document_run's layout
    skipped = {layout.activation_shard_key(hook, row // rows_per_object)
               for hook in ref_markers[claimed].checksums
               for row in range(part.row_start, part.row_start + part.row_count)}
    assert objects and all(objects[k] == ref_objects[k] for k in objects)
    assert set(ref_objects) - set(objects) == {"activations/actx.json"} | skipped


def test_a_stealing_leader_whose_choice_fails_stops_its_replica_without_commits_after(
        model_dir, tmp_path):
    """The leader's third partition choice raises (its claims store unreachable): the
    leader fails with that error and the other host fails too, rather than wait for a
    choice that never comes: it reads the leader's error where the choice would be, or,
    when it is already in a step the leader never joins, it loses its replica. What is
    committed is whole and the reference's."""
    ref = _run(model_dir, tmp_path / "ref", "continue", partition_rows=8)
    code, out = worker_procs.run_worker(["--run", ref, "--batch-size", "4"], devices=2)
    assert code == 0, out
    run = worker_procs.copy_token_store(ref, str(tmp_path / "run"))
    results, _ = _stealing_replica(run, tmp_path, ACTX_CHOICE_FAILS_AFTER="2",
                                   ACTX_LEADER_LOOKAHEAD="0")
    (code0, out0), (code1, out1) = results
    assert code0 != 0 and "claims store unreachable (test)" in out0, out0
    assert code1 != 0, out1
    assert ("leader (process 0) failed to choose the next partition: OSError: claims store "
            "unreachable (test)" in out1 or "leaving its replica" in out1), out1
    ref_markers = _markers(ref)
    for pid, marker in _markers(run).items():
        assert marker.checksums == ref_markers[pid].checksums


@pytest.mark.parametrize("crash_at", ["step:5", "write:4", "before_commit:2"])
def test_truncated_rows_sigkill_then_rerun_is_byte_identical(model_dir, tmp_path, crash_at):
    """A worker killed with steps in flight and partitions in hand commits nothing partial;
    the rerun completes the same bytes and keeps the markers that stood."""
    ref = _run(model_dir, tmp_path / "ref", "truncate", partition_rows=12)
    code, out = worker_procs.run_worker(["--run", ref, "--batch-size", "4"], devices=2)
    assert code == 0, out
    run = worker_procs.copy_token_store(ref, str(tmp_path / "run"))
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4",
                                         "--steps-in-flight", "3"], devices=2,
                                        ACTX_CRASH_AT=crash_at)
    assert code == -9, out
    before = _markers(run)
    assert len(before) < len(_markers(ref))
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"], devices=2)
    assert code == 0, out
    after = _markers(run)
    for pid, marker in before.items():
        assert after[pid] == marker
    worker_procs.assert_same_activations(run, ref)
    assert {p: m.checksums for p, m in after.items()} == {
        p: m.checksums for p, m in _markers(ref).items()}


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_sigterm_on_one_host_of_a_stealing_replica_waiting_for_work_stops_the_replica(
        model_dir, tmp_path, stopped):
    """Both hosts of replica 0 of 2 wait for their first partition (another attempt holds
    every partition of theirs; replica 1 has not started, so its own are kept for it): a
    SIGTERM on one host, the leader or the other, stops both as preempted (exit 143,
    heartbeats `preempted`), where the leader's stop was the others' failure and the other
    host's was not looked at until a partition came (each waited alone)."""
    import json
    import os
    import signal
    import time

    run = _run(model_dir, tmp_path / "run", "continue", partition_rows=8)
    s = store.open_store(run)
    for part in manifest.read_manifest(s).partitions:
        if part.id % 2 == 0:
            assert schedule.try_claim(s, "j1", part.id, "another-attempt")
    coordinator = f"127.0.0.1:{worker_procs.free_port()}"
    procs = [worker_procs.start_worker(
        ["--run", run, "--coordinator", coordinator, "--num-processes", "2",
         "--process-id", str(i), "--batch-size", "4", "--replicas", "2", "--replica", "0",
         "--steal", "--job", "j1"], devices=1) for i in range(2)]
    try:
        def states():  # each host's, in process order
            found = []
            for name in sorted(os.listdir(os.path.join(run, "workers"))):
                try:
                    with open(os.path.join(run, "workers", name)) as f:
                        found.append(json.load(f)["state"])
                except (OSError, ValueError):
                    found.append(None)
            return found

        os.makedirs(os.path.join(run, "workers"), exist_ok=True)
        deadline = time.monotonic() + 40  # within the 60 s replica 1's partitions are kept
        while states()[:1] != ["idle"] and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [worker_procs.finish(p) for p in procs]
            time.sleep(0.5)
        assert states()[:1] == ["idle"], states()
        time.sleep(1)  # the other host is in its wait too
        procs[stopped].send_signal(signal.SIGTERM)
        results = [worker_procs.finish(p, timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for code, out in results:
        assert code == 143, out
        assert "stopped while waiting for work (nothing was in hand)" in out, out
    assert states() == ["preempted", "preempted"]
    # Stopped in the wait, not once replica 1's partitions came free (after 60 s): the
    # replica took nothing.
    assert not commit_lib.committed_partitions(s)
    assert sorted(os.listdir(os.path.join(run, "claims", "j1"))) == [
        f"{layout.partition_name(p.id)}.json"
        for p in manifest.read_manifest(s).partitions if p.id % 2 == 0]
