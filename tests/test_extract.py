"""Extraction workers end to end: HF parity of stored activations, multi-host and
multi-replica runs byte-identical to one process, crash safety and exactly-once commits.

Workers run as real processes (CPU devices forced per process); tiny random Qwen2 models
come from transformers' own classes. The reference run is one process with 4 devices and
batch 8; every other topology keeps 2 rows per device, so numerics are identical.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from actx.schemas import commit, layout, store
from tests import hf_models, token_runs, worker_procs

HOOKS = "embed,layers.*.resid_post,layers.1.attn_out,layers.1.mlp_out,final_norm"
N_ROWS = 48
PARTITION_ROWS = 16  # 3 partitions of 2 steps (batch 8); shards of 4 rows
N_PARTS = N_ROWS // PARTITION_ROWS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def reference_run(model_dir, tmp_path_factory):
    """Prepared (synthetic tokens) and extracted by one process: the reference bytes."""
    run = str(tmp_path_factory.mktemp("ref") / "run")
    token_runs.write_token_run(run, str(model_dir), n_rows=N_ROWS, hooks=HOOKS,
                              partition_rows=PARTITION_ROWS)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"])
    assert code == 0, out
    return run


_fresh_copy_of_tokens = worker_procs.copy_token_store


def _markers(run: str) -> dict[int, commit.CommitMarker]:
    s = store.open_store(run)
    return {p: commit.read_marker(s, p) for p in commit.committed_partitions(s)}


def _assert_same_as_reference(run: str, reference: str) -> None:
    assert sorted(_markers(run)) == list(range(N_PARTS))
    worker_procs.assert_same_activations(run, reference)
    for pid, marker in _markers(run).items():
        assert marker.checksums == _markers(reference)[pid].checksums


def test_activations_match_hf_each_document_alone(reference_run, model_dir):
    hf = hf_models.load_hf_model(model_dir)
    ids = token_runs.read_tokens(reference_run, "input_ids")
    seg = token_runs.read_tokens(reference_run, "segment_ids")
    stored = {h: token_runs.read_activation(reference_run, h)
              for h in ("embed", "layers.0.resid_post", "layers.2.resid_post",
                        "layers.1.attn_out", "layers.1.mlp_out", "final_norm")}
    checked = 0
    for row in (0, 13, 27, 47):  # rows from several partitions and shards
        for s in range(1, int(seg[row].max()) + 1):
            cols = np.flatnonzero(seg[row] == s)
            reference = hf_models.hf_hooks(hf, ids[row, cols][None])
            for hook, acts in stored.items():
                worker_procs.assert_close(acts[row, cols], reference[hook][0], 1e-5,
                                          f"row {row} segment {s} {hook}")
            checked += 1
    assert checked >= 8
    # Markers' checksums are those of the stored values.
    marker = _markers(reference_run)[1]
    block = stored["final_norm"][16:20]
    assert marker.checksums["final_norm"][0] == commit.checksum(np.ascontiguousarray(block).tobytes())


def test_extract_to_gcs_emulator_matches_local(reference_run, model_dir, gcs_bucket):
    run = f"{gcs_bucket}/runs/t"
    token_runs.write_token_run(run, str(model_dir), n_rows=N_ROWS, hooks=HOOKS,
                              partition_rows=PARTITION_ROWS)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"])
    assert code == 0, out
    s = store.open_store(run)
    assert commit.committed_partitions(s) == set(range(N_PARTS))
    for hook in ("layers.2.resid_post", "final_norm"):
        np.testing.assert_array_equal(token_runs.read_activation(run, hook),
                                      token_runs.read_activation(reference_run, hook))
    assert any(k.startswith("workers/") for k in s.list("workers/"))


def test_two_hosts_one_replica_byte_identical(reference_run, tmp_path):
    run = _fresh_copy_of_tokens(reference_run, str(tmp_path / "run"))
    log = tmp_path / "writes.log"
    results = worker_procs.run_replica(run, hosts=2, devices_per_host=2,
                                       extra=["--batch-size", "8"], ACTX_WRITE_LOG=str(log))
    for code, out in results:
        assert code == 0, out
    _assert_same_as_reference(run, reference_run)
    _assert_one_writer_per_object(log, run, expected_writers=2)
    assert _markers(run)[0].hosts == ("r0h0", "r0h1")


def test_two_independent_replicas_byte_identical(reference_run, tmp_path):
    run = _fresh_copy_of_tokens(reference_run, str(tmp_path / "run"))
    log = tmp_path / "writes.log"
    procs = [worker_procs.start_worker(["--run", run, "--batch-size", "8", "--replicas", "2",
                                        "--replica", str(r)], devices=4, ACTX_WRITE_LOG=str(log))
             for r in range(2)]
    for p in procs:
        code, out = worker_procs.finish(p)
        assert code == 0, out
    _assert_same_as_reference(run, reference_run)
    _assert_one_writer_per_object(log, run, expected_writers=2)
    # Partition p belongs to replica p mod 2.
    assert {m.hosts for m in _markers(run).values()} == {("r0h0",), ("r1h0",)}


def _assert_one_writer_per_object(log, run: str, expected_writers: int) -> None:
    writers: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        pid, key = line.split()
        writers.setdefault(key, set()).add(pid)
    shared = {k: v for k, v in writers.items() if len(v) > 1}
    assert not shared, f"objects written by several processes: {shared}"
    assert len({p for v in writers.values() for p in v}) == expected_writers
    # The logged keys are exactly the data objects the store holds: nothing else was written.
    stored = {k for k in worker_procs.stored_objects(run) if "/c/" in k}
    assert stored == set(writers)


@pytest.mark.parametrize("crash_at", ["step:3", "write:6", "before_commit:2"])
def test_sigkill_then_rerun_is_byte_identical(reference_run, tmp_path, crash_at):
    run = _fresh_copy_of_tokens(reference_run, str(tmp_path / "run"))
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"],
                                        ACTX_CRASH_AT=crash_at)
    assert code == -9, f"worker was not killed at {crash_at}: {out}"
    before = _markers(run)
    assert len(before) < N_PARTS, "the crash came after everything was committed"
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"])
    assert code == 0, out
    after = _markers(run)
    for pid, marker in before.items():  # never committed twice: first markers stand
        assert after[pid] == marker
    _assert_same_as_reference(run, reference_run)


def test_concurrent_attempts_commit_once(reference_run, tmp_path):
    run = _fresh_copy_of_tokens(reference_run, str(tmp_path / "run"))
    procs = [worker_procs.start_worker(["--run", run, "--batch-size", "8", "--only", "2"],
                                       devices=4) for _ in range(2)]
    results = [worker_procs.finish(p) for p in procs]
    assert all(code == 0 for code, _ in results), results
    keys = store.open_store(run).list(layout.COMMITS_PREFIX)
    assert keys == [layout.commit_key(2)]
    marker = _markers(run)[2]
    assert marker.checksums == _markers(reference_run)[2].checksums


def test_sigterm_stops_without_committing_partial_partition(reference_run, tmp_path):
    run = _fresh_copy_of_tokens(reference_run, str(tmp_path / "run"))
    # SIGTERM arrives during the 3rd step: partition 1 (steps 3-4) is in hand.
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8", "--heartbeat-s", "1"],
                                        ACTX_CRASH_AT="step:3:TERM")
    assert code == 143, out
    assert "preempted" in out
    assert sorted(_markers(run)) == [0]
    beat = json.loads(open(os.path.join(run, "workers", os.listdir(os.path.join(run, "workers"))[0])).read())
    assert beat["state"] == "preempted"


def test_a_worker_aborted_in_native_code_leaves_its_threads_stacks(reference_run, tmp_path):
    """An abort (as JAX's coordination service ends a host it stopped hearing from) kills
    the worker with nothing of the partition in hand committed, and its output holds
    every thread's Python stack: where the host was when it ended."""
    run = _fresh_copy_of_tokens(reference_run, str(tmp_path / "run"))
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"],
                                        ACTX_CRASH_AT="step:3:ABRT")
    assert code == -6, out
    assert "Fatal Python error: Aborted" in out, out
    assert "Current thread" in out and "workers/loop/faults.py" in out, out
    assert "actx-commit" in out or "Thread 0x" in out, out  # the other threads too
    assert 1 not in _markers(run)


def test_steal_finishes_other_replicas_partitions(reference_run, tmp_path):
    run = _fresh_copy_of_tokens(reference_run, str(tmp_path / "run"))
    # Replica 1 of 2 never starts; replica 0 steals its partitions once the start-up grace
    # is over (2 s here through the probe wrapper, not choice_policy's 60 s: the policy
    # around the grace is tests/test_schedule_sim.py's).
    code, out = worker_procs.finish(worker_procs.start_worker(
        ["--run", run, "--batch-size", "8", "--replicas", "2", "--replica", "0", "--steal",
         "--job", "j1"], module="tests.stream_probe_worker",
        ACTX_STREAM_PROBE=str(tmp_path / "probe"), ACTX_START_GRACE_S="2"))
    assert code == 0, out
    _assert_same_as_reference(run, reference_run)


def test_a_commit_that_fails_in_the_background_ends_a_host_waiting_for_work(model_dir,
                                                                           tmp_path):
    """Found with the run on a full disk: each of 2 replicas' commit of its one partition
    fails on the commit thread, then it has nothing left to take (the other's partition is
    held by a live host) and waited for work for ever, the failure unsaid. Each now stops
    with it at once, nothing committed, and a rerun finishes the run."""
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model_dir), n_rows=32, hooks="layers.2.resid_post",
                               partition_rows=16)
    procs = [worker_procs.start_worker(
        ["--run", run, "--batch-size", "8", "--replicas", "2", "--replica", str(r), "--steal",
         "--job", "j", "--heartbeat-s", "0.5"], devices=4,
        ACTX_CRASH_AT="before_commit:1:RAISE") for r in range(2)]
    results = [worker_procs.finish(p, timeout=180) for p in procs]
    for code, out in results:
        assert code == 1 and "injected failure at before_commit" in out, out[-2000:]
    assert _markers(run) == {}
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"])
    assert code == 0, out
    assert sorted(_markers(run)) == [0, 1]


def test_two_hosts_with_short_partition_and_padding_steps(model_dir, tmp_path):
    """30 rows: partitions of 16 and 14 rows; with batch 6 per host-pair (3 rows a host)
    hosts run padding steps and host 1's last slice is short; bytes equal one process."""
    ref = str(tmp_path / "ref")
    token_runs.write_token_run(ref, str(model_dir), n_rows=30, hooks="layers.2.resid_post",
                               partition_rows=16, seed=5)
    code, out = worker_procs.run_worker(["--run", ref, "--batch-size", "6"], devices=2)
    assert code == 0, out
    run = _fresh_copy_of_tokens(ref, str(tmp_path / "run"))
    log = tmp_path / "writes.log"
    for code, out in worker_procs.run_replica(run, hosts=2, devices_per_host=1,
                                              extra=["--batch-size", "6"],
                                              ACTX_WRITE_LOG=str(log)):
        assert code == 0, out
    assert sorted(_markers(run)) == [0, 1]
    assert _markers(run)[1].row_count == 14
    objects, ref_objects = worker_procs.stored_objects(run), worker_procs.stored_objects(ref)
    objects.pop("activations/actx.json"), ref_objects.pop("activations/actx.json")
    assert objects == ref_objects
    _assert_one_writer_per_object(log, run, expected_writers=2)


def test_a_failing_host_stops_its_replica_fast_and_rerun_completes(reference_run, tmp_path):
    """Host 1 raises in partition 1 (4 steps a partition): both hosts exit at once (no minutes-long shutdown
    barrier), nothing partial is committed, and a rerun gives the reference bytes. The hosts
    agree every 2 steps on what they finished, so partition 0 is committed by then."""
    run = _fresh_copy_of_tokens(reference_run, str(tmp_path / "run"))
    started = time.monotonic()
    results = worker_procs.run_replica(run, hosts=2, devices_per_host=1,
                                       extra=["--batch-size", "4", "--stop-check-steps", "2"],
                                       timeout=120,
                                       ACTX_CRASH_AT="step:6:RAISE", ACTX_CRASH_PROCESS="1")
    assert time.monotonic() - started < 60
    assert all(code == 1 for code, _ in results), results
    assert "injected failure" in results[1][1]
    assert sorted(_markers(run)) == [0]
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"])
    assert code == 0, out
    _assert_same_as_reference(run, reference_run)
