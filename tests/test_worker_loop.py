"""The worker loop in-process: one compilation for the whole job, heartbeats, scheduling."""

from __future__ import annotations

import pytest

from actx.schemas import commit, heartbeat, manifest, store, worker_options
from tests import hf_models, token_runs
from actx.workers.loop import runner, schedule


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen2", "qwen2"))


def test_whole_job_compiles_once_and_reports_done(model_dir, tmp_path):
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model_dir, n_rows=30, partition_rows=8)  # short last part
    worker = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8, heartbeat_s=1))
    assert worker.run() == 0
    assert worker.loaded.fn.trace_count == 1
    assert worker.loaded.fn.compile_count() == 1
    s = store.open_store(run)
    assert commit.committed_partitions(s) == {0, 1, 2, 3}
    assert commit.read_marker(s, 3).row_count == 6
    (beat,) = heartbeat.read_heartbeats(s)
    assert beat.state == "done" and beat.partitions_done == 4
    assert beat.tokens_done == manifest.read_manifest(s).total_tokens


def test_plan_steps_pads_short_host_slices_to_equal_step_counts():
    part = manifest.Partition(id=1, row_start=16, row_count=12, tokens=0, docs=0)
    plans = [schedule.plan_steps(part, schedule.Topology(hosts_per_replica=2, host_index=h),
                                 rows_per_shard=4, local_batch=3) for h in range(2)]
    assert [len(p) for p in plans] == [3, 3]
    real = [r for p in plans for s in p for r in s.rows[:s.valid]]
    assert real == list(range(16, 28))
    # Host 1 owns one shard (4 rows): steps of 3 and 1 real rows, then an all-padding step.
    assert [s.valid for s in plans[1]] == [3, 1, 0]
    assert all(len(s.rows) == 3 for s in plans[1])


def test_partition_assignment_and_steal_order():
    parts = tuple(manifest.Partition(i, i * 8, 8, 1, 1) for i in range(6))
    m = manifest.Manifest("f", 4, 48, 6, parts, {}, 10)
    assert schedule.own_partitions(m, schedule.Topology(replicas=3, replica=1)) == [1, 4]
    assert schedule.steal_order(m, schedule.Topology(replicas=3, replica=1)) == [3, 5, 0, 2]


def test_rows_of_a_partition_taken_over_are_not_counted_as_extracted():
    """After a silence, the rows of a partition another attempt took over are neither
    written nor counted in the host's tokens (its heartbeat's tokens_done, the rate): the
    taker writes and counts them. Those of a partition still this host's are both."""
    import types

    import numpy as np

    from actx.workers.loop import outputs, partition_stream, prefetch
    from actx.workers.loop import progress as progress_lib

    class Host:  # partition_stream.StreamHost, as far as on_output asks
        topo = types.SimpleNamespace(hosts_per_replica=1)
        progress = progress_lib.Progress()
        timings = outputs.HostTimings()

        def taken_over(self, pids):
            return {pid for pid in pids if pid == 3}

    class Writer:  # what outputs.add_rows hands the rows to
        finished = False

        def __init__(self):
            self.rows = []

        def add_slots(self, rows, write, pieces, tokens):
            self.rows += [r for r, w in zip(rows, write) if w]

    host = Host()
    host.progress.silent_after_s = 1.0
    host.progress.wrote_beat(0.0)
    host.progress.wrote_beat(5.0)  # a beat 5 s after the last: a silence
    stream = partition_stream.PartitionStream(host, types.SimpleNamespace(wait_s=0.0),
                                              committer=None, tried=set())
    writers = {3: Writer(), 4: Writer()}
    for pid, w in writers.items():
        stream._in_hand[pid] = [None, w, 100, 0.0, -1]  # rows left: none finishes here
        stream._fence.opened(pid, w)
    segment_ids = np.array([[1, 1, 1, 0], [2, 2, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.int32)
    step = schedule.Step(rows=(10, 11, 20, 21), write=(True, True, True, False),
                         continues=(False,) * 4, partitions=(3, 3, 4, 4))
    stream.on_output(prefetch.Batch(step, 0, segment_ids, segment_ids, segment_ids), {})
    assert writers[3].rows == [] and writers[4].rows == [20]
    assert host.progress.tokens_done == 4  # row 20's; rows 10 and 11 are the taker's
