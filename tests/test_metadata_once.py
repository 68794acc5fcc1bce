"""Issue 63 with real parts: a 2-host `actx submit` on the GCS emulator, every request seen
by a loopback proxy (tests/fault_proxy.py, injecting nothing). The run's metadata
(activations/actx.json, each hook's zarr.json) is written by one process, process 0 of
replica 0, and read by the other; heartbeats carry their interval, and status judges a
host dead by it."""

from __future__ import annotations

import collections
import io
import os
import time

import pytest
import yaml

from actx.deploy import cli
from actx.deploy.status import runstate
from actx.pipeline import sample_data
from actx.schemas import config as schemas_config
from actx.schemas import heartbeat, layout, request_budget, run_dir, store
from tests import fault_proxy, gcs_emulator, hf_models


@pytest.fixture
def proxy(gcs_emulator_server):
    """Both GCS clients of this process and of the workers it starts go through the proxy."""
    proxy = fault_proxy.FaultProxy(gcs_emulator_server.url, seed=5).start()
    with gcs_emulator.routed_through(proxy.url):
        yield proxy
        proxy.stop()


def _config(tmp, run: str, tokenizer: str) -> str:
    model = hf_models.make_tiny_checkpoint(tmp / "model", "qwen2", num_hidden_layers=2,
                                           vocab_size=151936)
    fineweb = sample_data.make_fineweb_parquet(str(tmp / "fw" / "000.parquet"), 8, seed=3)
    cfg = {
        "run": run,
        "spec": {
            "name": "once",
            "model": {"path": str(model), "dtype": "float32"},
            "tokenizer": {"path": tokenizer},
            "sources": [{"kind": "fineweb", "name": "fw", "paths": [fineweb]}],
            "packing": {"mode": "segmented", "seq_len": 64},
            "capture": {"hooks": "layers.*.resid_post", "dtype": "bfloat16"},
            "layout": {"rows_per_shard": 4, "partition_rows": 8},
        },
        "target": {"kind": "local", "hosts": 2, "batch_size": 4, "heartbeat_s": 1},
    }
    path = tmp / "once.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_one_process_writes_the_metadata_and_status_judges_by_the_interval(
        tmp_path, qwen_tokenizer_dir, gcs_emulator_server, proxy):
    run = gcs_emulator_server.create_bucket("actx-metadata-once") + "/runs/job"
    writes: collections.Counter = collections.Counter()  # (client, object) -> uploads
    reads: collections.Counter = collections.Counter()

    def record(req: fault_proxy.Request) -> bool:
        name = req.object_name
        if "/activations/" in name and name.endswith((".json",)):
            (writes if req.method in ("POST", "PUT", "PATCH") else reads)[
                (req.client, name.split("runs/job/", 1)[-1])] += 1
        return False  # recorded, never failed

    proxy.add_rule("503", record, times=None)
    out = io.StringIO()
    code = cli.main(["submit", _config(tmp_path, run, qwen_tokenizer_dir), "--job", "once"],
                    out=out)
    assert code == 0, out.getvalue()
    s = store.open_store(run)
    hooks = sorted(s.read_json(layout.ACTIVATIONS_INFO_KEY)["hooks"])
    metadata = {layout.ACTIVATIONS_INFO_KEY,
                *(f"{layout.ACTIVATIONS_GROUP}/{hook}/zarr.json" for hook in hooks)}
    assert len(hooks) == 2 and all(s.exists(key) for key in metadata)
    # Only process 0 of replica 0 wrote them, each once; the other host read them.
    assert {client for client, _ in writes} == {"local-r0h0"}, writes
    assert {name for _, name in writes} == metadata, writes
    assert all(n == 1 for n in writes.values()), writes
    assert {name for client, name in reads if client == "local-r1h0"} == metadata, reads

    # Each host's heartbeat says its interval; status judges it by max(--stale-after,
    # 3 intervals): a host of a 1,024-host pod beats every 20.5 s and is dead after 61.5 s.
    beats = heartbeat.read_heartbeats(s)
    assert {hb.interval_s for hb in beats} == {1.0}
    pod_interval = request_budget.heartbeat_interval_s(1.0, 1024)
    assert pod_interval == pytest.approx(20.48)
    r1 = next(hb for hb in beats if hb.host == "local-r1h0")
    now = time.time()
    for age, live in ((61.0, True), (62.0, False)):
        heartbeat.HeartbeatWriter(s, r1.host).beat(heartbeat.Heartbeat(
            **{**vars(r1), "state": "working", "updated_at": now - age,
               "interval_s": pod_interval, "history": (),
               "machine": "", "pid": 0}), force=True)  # a host status cannot look at
        status = runstate.compute_status(run_dir.open_run(run), stale_after_s=60.0, now=now)
        host = next(h for h in status.hosts if h.host == r1.host)
        assert host.live is live, (age, host)
        assert host.state == ("working" if live else "working (stale)"), host


def test_a_wait_for_metadata_is_bounded_and_says_what_to_do():
    """A process that does not write the metadata polls from 1 s, doubling to 10 s, and
    gives up after its bound, or at once when the writer's heartbeat says it will not
    write, naming the object and the commands that help."""
    from actx.workers.write import metadata

    clock = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        clock[0] += s

    with pytest.raises(metadata.MetadataNotWritten) as e:
        metadata.wait_for(lambda: None, "gs://b/r/activations/actx.json", "gs://b/r",
                          wait_s=60.0, sleep=sleep, clock=lambda: clock[0])
    assert 0.75 <= slept[0] <= 1.0 and max(slept) <= 10.0 and clock[0] == pytest.approx(60.0)
    assert str(e.value).startswith("gs://b/r/activations/actx.json: not written after 60s")
    assert "`actx status gs://b/r`" in str(e.value) and "`actx rerun gs://b/r`" in str(e.value)
    looks = iter([None, b"{}"])
    assert metadata.wait_for(lambda: next(looks), "k", "r", sleep=sleep) == b"{}"
    with pytest.raises(metadata.MetadataNotWritten, match="r-r0h0 is failed: boom"):
        metadata.wait_for(lambda: None, "k", "r", writer_gone=lambda: "r-r0h0 is failed: boom",
                          sleep=sleep)
    # A launcher's record of the death ends with the rerun already: said once, not twice.
    with pytest.raises(metadata.MetadataNotWritten) as e:
        metadata.wait_for(lambda: None, "k", "r", sleep=sleep, writer_gone=lambda: (
            "r-r0h0 is failed: process killed by SIGKILL; fix that, then `actx rerun r`"))
    assert str(e.value).count("actx rerun r") == 1 and str(e.value).endswith("rerun r`")


def test_the_writer_is_gone_only_by_its_own_jobs_heartbeats_since_the_wait(tmp_path):
    from actx.workers.write import metadata

    s = store.open_store(str(tmp_path))
    now = time.time()

    def beat(host, replica, state, at, job="j", process_index=0):
        heartbeat.HeartbeatWriter(s, host).beat(heartbeat.Heartbeat(
            host=host, replica=replica, process_index=process_index, state=state,
            attempt=f"{host}-a", updated_at=at, job=job), force=True)

    beat("old-r0h0", 0, "failed", now - 100)  # an earlier attempt's
    beat("other-r0h0", 0, "failed", now, job="k")  # another job's
    beat("w-r1h0", 1, "failed", now)  # not the writer
    beat("w-r0h1", 0, "failed", now, process_index=1)  # not the writer
    assert metadata.writer_gone(s, "j", since=now - 10) is None
    beat("w-r0h0", 0, "working", now - 5)
    assert metadata.writer_gone(s, "j", since=now - 10) is None
    beat("w-r0h0", 0, "working", now - 9.5)
    assert metadata.writer_gone(s, "j", since=now - 70) is None  # 9.5 s: not stale
    beat("w-r0h0", 0, "working", now - 65)
    assert metadata.writer_gone(s, "j", since=now - 70) == "w-r0h0 stopped beating 65s ago"
    beat("w-r0h0", 0, "refused", now)
    assert metadata.writer_gone(s, "j", since=now - 10).startswith("w-r0h0 is refused")


def test_a_writer_its_launcher_saw_die_before_it_beat_here_is_gone(tmp_path):
    """Several extractions, one after another in each process: process 0 of replica 0 died
    during the first, so it never beat in the next one; its launcher records it failed
    there (deploy.local.mark_dead) with its job, replica and process index, and a host
    waiting for that extraction's metadata takes that as the writer's end (before: the
    record had no job and replica 0 for any host, and was skipped: a 900 s wait). Another
    launch's record under the same job name, older than the waiting process, is not."""
    from actx.deploy import local
    from actx.workers.write import metadata

    run = run_dir.RunDir.at(str(tmp_path / "run"))
    s = run.store
    s.write_json("extractions/names/llama.json", {})  # a named extraction's view
    view = run.extraction("llama").store
    process_started = time.time()
    assert local.mark_dead(run, "local-r1h0", -9, extraction="llama", job="j", replica=1,
                           process_index=0)
    assert metadata.writer_gone(view, "j", since=process_started) is None  # not the writer
    assert local.mark_dead(run, "local-r0h0", -9, extraction="llama", job="j", replica=0,
                           process_index=0)
    recorded = {hb.host: hb for hb in heartbeat.read_heartbeats(view, history=False)}
    assert (recorded["local-r1h0"].job, recorded["local-r1h0"].replica) == ("j", 1)
    gone = metadata.writer_gone(view, "j", since=process_started)
    assert gone.startswith("local-r0h0 is failed: process killed by SIGKILL before its "
                           "first heartbeat"), gone
    assert metadata.writer_gone(view, "j", since=time.time() + 1) is None
    assert metadata.writer_gone(view, "another job", since=process_started) is None


@pytest.mark.parametrize("earlier", ["failed", "preempted", "done", "working"])
def test_a_rerun_whose_writer_died_before_it_beat_is_gone_over_an_earlier_jobs_record(
        tmp_path, earlier):
    """Found on a real Slurm (two extractions, a rerun's process 0 killed during the
    first): the earlier job had left that host's record in the second extraction (its
    launcher's "failed", or the worker's own "preempted" or "done"). The rerun's launcher
    appended an exit code to it (or wrote nothing), keeping the earlier job's name and
    time, so the rerun's waiting hosts read no death of theirs and waited 900 s. A record
    of another job is replaced by this job's death."""
    from actx.deploy import local
    from actx.workers.write import metadata

    run = run_dir.RunDir.at(str(tmp_path / "run"))
    run.store.write_json("extractions/names/chat.json", {})
    view = run.extraction("chat").store
    old = heartbeat.Heartbeat(host="h-r0h0", replica=0, process_index=0, state=earlier,
                              attempt="h-r0h0-1-1", updated_at=time.time() - 600, job="k1",
                              message="process killed by SIGKILL" if earlier == "failed" else "")
    view.write_json("workers/h-r0h0.json", schemas_config.to_dict(old))
    started = time.time()
    assert local.mark_dead(run, "h-r0h0", -9, extraction="chat", job="k2", replica=0,
                           process_index=0)
    gone = metadata.writer_gone(view, "k2", since=started)
    assert gone and gone.startswith("h-r0h0 is failed: process killed by SIGKILL before its "
                                    "first heartbeat"), gone
    [hb] = heartbeat.read_heartbeats(view, history=False)
    assert (hb.job, hb.replica, hb.process_index) == ("k2", 0, 0)
    assert "exited with code" not in hb.message
    # The same job's own failure record is still kept, its exit code added.
    assert local.mark_dead(run, "h-r0h0", 1, extraction="chat", job="k2")
    assert heartbeat.read_heartbeats(view, history=False)[0].message.endswith(
        "(process exited with code 1)")


@pytest.mark.parametrize("slurm", [True, False], ids=["slurm-task", "tpu-host"])
def test_a_detached_hosts_supervisor_records_its_workers_death_in_each_extraction(
        tmp_path, monkeypatch, slurm):
    """A TPU host or a Slurm task runs its worker under deploy/detached/host_run.py, which
    records a death as the local launcher does: in every extraction the worker was to
    extract, with its job, replica and process index (its flags; a TPU host's index from
    ACTX_PROCESS_ID), so a host waiting on process 0 of replica 0 for the next
    extraction's metadata learns it at once (before: the default extraction alone, with
    no job: a 900 s wait in the next one)."""
    import sys

    from actx.deploy.detached import host_run
    from actx.workers.write import metadata

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run = run_dir.RunDir.at(str(tmp_path / "run"))
    run.store.write_json("extractions/names/llama.json", {})
    started = time.time()
    worker = [sys.executable, "-c", "import sys; sys.exit(3)", "--run", run.uri, "--job", "j",
              "--extraction", "default,llama"]
    env = dict(os.environ, ACTX_PROCESS_ID="1")
    if slurm:  # the step's own flags come last, as deploy/targets/slurm/step.py adds them
        worker += ["--replica=0", "--process-id=0", "--host-name=t-r0h0"]
        env["ACTX_PROCESS_ID"] = "5"  # a flag wins over the variable, as in the worker
    else:
        env["ACTX_PROCESS_ID"] = "0"
    assert host_run.supervise(run, "j", "t-r0h0", worker, log_every_s=1, env=env) == 3
    for name in ("", "llama"):
        view = run.extraction(name).store
        [hb] = heartbeat.read_heartbeats(view, history=False)
        assert (hb.host, hb.job, hb.replica, hb.process_index, hb.state) == (
            "t-r0h0", "j", 0, 0, "failed"), (name, hb)
        gone = metadata.writer_gone(view, "j", since=started)
        assert gone and gone.startswith("t-r0h0 is failed: process exited with code 3"), gone
    place = host_run.worker_place(worker[3:] + ["--replica", "2"], {"ACTX_PROCESS_ID": "3"})
    assert place == host_run.WorkerPlace(("", "llama"), 2, 0 if slurm else 3)


def test_the_launcher_stops_a_worker_that_stopped_beating_after_the_data_was_complete(
        tmp_path):
    """A fault audit froze one of two local workers (SIGSTOP): the other committed every
    partition, and `actx submit` waited for the frozen one for ever. Once every partition
    is committed, a worker still running whose heartbeat went stale is stopped (SIGTERM,
    SIGCONT, then SIGKILL); one that beats, or a run not complete, is left alone."""
    import signal
    import subprocess

    from actx.deploy import local
    from actx.deploy.status import job_progress
    from tests import status_runs

    def procs():
        return [local._Proc(f"host-{h:03d}", h, subprocess.Popen(["sleep", "600"]), "", None)
                for h in range(2)]

    complete = run_dir.RunDir.at(status_runs.write_local(
        str(tmp_path / "done"), n_partitions=4, n_hosts=2, committed=4, dead_hosts=1,
        now=time.time(), job="j"))  # host-001 silent for 10 minutes, host-000 beating
    running = procs()
    running[1].popen.send_signal(signal.SIGSTOP)
    try:
        progress = job_progress.JobProgress(complete, [""])
        assert local._stale_after_the_end(progress, running, None, "j") == [running[1]]
        assert local._stale_after_the_end(progress, running, None, "another job") == []
        local._end(running[1].popen, grace_s=2.0)
        assert running[1].popen.poll() is not None and running[0].popen.poll() is None
        behind = run_dir.RunDir.at(status_runs.write_local(
            str(tmp_path / "behind"), n_partitions=4, n_hosts=2, committed=3, dead_hosts=1,
            now=time.time(), job="j"))
        assert local._stale_after_the_end(job_progress.JobProgress(behind, [""]), running,
                                          None, "j") == []
    finally:
        for p in running:
            p.popen.kill()
            p.popen.wait()
