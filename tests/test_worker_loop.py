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
