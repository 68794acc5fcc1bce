"""One run, one job at a time (schemas.job_lease): a second `actx rerun` on a run whose
workers are extracting is refused with exit 2, naming the job, its hosts and how to stop
it, unless it asks to `--join` (then its hosts get their own names and logs); the lease is
a create-only object in the run directory, so it works on gs:// (the GCS emulator) as on
local disk, renewed by its launcher and kept by its hosts' heartbeats, and taken over only
once expired, by exactly one of two takers; a SIGTERM to `actx rerun` stops its workers
and gives the lease back. Real worker processes on a tiny random Qwen2.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import job_lease, layout, object_store, store
from tests import hf_models, token_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["local", "gs"])
def run_store(request, tmp_path):
    if request.param == "local":
        return store.open_store(str(tmp_path / "run"))
    return store.open_store(request.getfixturevalue("gcs_bucket") + "/runs/r")


def _gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_lease_refuses_a_second_job_until_it_expires(run_store):
    now = time.time()
    first = job_lease.new("a", ["local-r0h0"], "local", "Ctrl-C", now=now)
    job_lease.acquire(run_store, first, now=now)
    with pytest.raises(job_lease.LeaseHeld) as held:
        job_lease.acquire(run_store, job_lease.new("b", [], "local", "-", now=now), now=now)
    assert held.value.lease.job == "a" and held.value.lease.hosts == ("local-r0h0",)
    # The same job again (its launcher, later) renews instead.
    again = job_lease.new("a", ["local-r0h0"], "local", "Ctrl-C", now=now + 5)
    assert job_lease.acquire(run_store, again, now=now + 5).expires_at > first.expires_at
    assert job_lease.read(run_store).started_at == first.started_at

    # Expired, its launcher gone: still held while a host of its job beats ...
    expired = job_lease.read(run_store)
    run_store.write(layout.JOB_LEASE_KEY, store.dumps(
        {**_as_dict(expired), "pid": _gone_pid(), "expires_at": now - 1}))
    beat = heartbeat_lib.Heartbeat(host="local-r0h0", replica=0, process_index=0,
                                   state="working", attempt="x", updated_at=time.time(),
                                   machine=heartbeat_lib.this_machine(), pid=os.getpid(),
                                   job="a")
    heartbeat_lib.HeartbeatWriter(run_store, "local-r0h0").beat(beat, force=True)
    with pytest.raises(job_lease.LeaseHeld):
        job_lease.acquire(run_store, job_lease.new("b", [], "local", "-"))
    # ... and taken over once that host is done, by exactly one of two takers.
    heartbeat_lib.HeartbeatWriter(run_store, "local-r0h0").beat(
        heartbeat_lib.Heartbeat(**{**_as_dict(beat), "state": "done", "history": ()}),
        force=True)
    b = job_lease.acquire(run_store, job_lease.new("b", [], "local", "-"))
    with pytest.raises(job_lease.LeaseHeld) as held:
        job_lease.acquire(run_store, job_lease.new("c", [], "local", "-"))
    assert held.value.lease.job == "b" == job_lease.read(run_store).job
    job_lease.release(run_store, b)
    assert job_lease.read(run_store) is None


def _beat(job: str, state: str = "working", age_s: float = 0.0, pid: int | None = None,
          now: float | None = None) -> heartbeat_lib.Heartbeat:
    return heartbeat_lib.Heartbeat(
        host="pod1-w0", replica=0, process_index=0, state=state, attempt="x",
        updated_at=(time.time() if now is None else now) - age_s,
        machine=heartbeat_lib.this_machine(), pid=os.getpid() if pid is None else pid,
        job=job)


def test_a_detached_lease_holds_by_its_hosts_heartbeats_not_its_launcher():
    now = time.time()
    lease = job_lease.new("t", ["pod1-w0", "pod1-w1"], "tpu-vm", "actx down", now=now,
                          detached=True)
    lease = job_lease.JobLease(**{**_as_dict(lease), "pid": _gone_pid()})  # launcher exited
    assert lease.expires_at == now + job_lease.DETACHED_START_GRACE_S
    # No host of its job has reported: the start grace holds it (another job's do not count).
    assert lease.live([], now + 600) and lease.live([_beat("old")], now + 600)
    assert not lease.live([_beat("old")], now + job_lease.DETACHED_START_GRACE_S + 1)
    # Once its hosts report, exactly while one of them beats, grace or not.
    late = now + 2 * job_lease.DETACHED_START_GRACE_S
    assert lease.live([_beat("t", "done", now=late), _beat("t", now=late)], late)
    assert not lease.live([_beat("t", "done", now=now)], now + 1)
    assert not lease.live([_beat("t", pid=_gone_pid(), now=now)], now + 1)  # process gone
    assert not lease.live([_beat("t", age_s=job_lease.DEFAULT_TTL_S + 1, now=now)], now)
    # A local (attached) lease with its launcher gone holds by heartbeats only, as before.
    attached = job_lease.JobLease(**{**_as_dict(lease), "detached": False})
    assert not attached.live([], now + 1) and attached.live([_beat("t", now=now)], now + 1)


def test_detached_leases_on_the_store_read_old_files_and_are_dropped_by_job(run_store):
    now = time.time()
    old = job_lease.new("a", ["local-r0h0"], "local", "Ctrl-C", now=now)
    fields = {k: v for k, v in _as_dict(old).items() if k != "detached"}
    run_store.write(layout.JOB_LEASE_KEY, store.dumps(fields))  # written before `detached`
    assert job_lease.read(run_store).detached is False
    run_store.delete(layout.JOB_LEASE_KEY)
    lease = job_lease.new("t", ["pod1-w0"], "tpu-vm", "actx down", now=now, detached=True)
    job_lease.acquire(run_store, lease, now=now)
    # Its launcher again (the same job) keeps the start grace, not the short ttl.
    again = job_lease.acquire(run_store, job_lease.new("t", ["pod1-w0"], "tpu-vm", "-",
                                                       now=now + 5, detached=True), now=now + 5)
    assert again.expires_at == now + 5 + job_lease.DETACHED_START_GRACE_S
    with pytest.raises(job_lease.LeaseHeld):
        job_lease.acquire(run_store, job_lease.new("b", [], "local", "-"))
    assert not job_lease.drop(run_store, "other") and job_lease.read(run_store).job == "t"
    assert job_lease.drop(run_store, "t") and job_lease.read(run_store) is None


def test_a_jobs_hosts_of_a_named_extraction_hold_its_lease(run_store):
    """Workers of a named extraction beat under extractions/<name>/workers/: those beats
    keep a detached lease past its start grace, and once they stop the run is taken over."""
    from actx.schemas import extraction_store

    now = time.time()
    run_store.write(layout.extraction_name_key("chat"), b"{}")
    job_lease.acquire(run_store, job_lease.new("t", ["pod1-w0"], "tpu-vm", "actx down",
                                               now=now, detached=True), now=now)
    late = now + job_lease.DETACHED_START_GRACE_S + 60
    beats = extraction_store.view(run_store, "chat")
    beats.write(layout.heartbeat_key("pod1-w0"),
                store.dumps(_as_dict(_beat("t", now=late))))
    with pytest.raises(job_lease.LeaseHeld):
        job_lease.acquire(run_store, job_lease.new("b", [], "local", "-", now=late), now=late)
    beats.write(layout.heartbeat_key("pod1-w0"),
                store.dumps(_as_dict(_beat("t", "done", now=late))))
    assert job_lease.acquire(run_store, job_lease.new("b", [], "local", "-", now=late),
                             now=late).job == "b"


def _as_dict(obj) -> dict:
    import dataclasses

    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _rerun(run: str, job: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "actx.deploy.cli", "rerun", run, "--hosts", "1", "--batch-size",
         "8", "--job", job, *flags], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
        text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_second_rerun_is_refused_unless_it_joins(tmp_path):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=3072, seq_len=128,
                               partition_rows=32, rows_per_shard=8)
    s = store.open_store(run)
    first = _rerun(run, "first")
    deadline = time.monotonic() + 180
    while not s.list(layout.COMMITS_PREFIX):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)

    second = subprocess.run(
        [sys.executable, "-m", "actx.deploy.cli", "rerun", run, "--job", "second"], cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120)
    said = second.stdout + second.stderr
    assert second.returncode == 2, said
    [line] = [x for x in said.splitlines() if x.startswith("actx rerun: error:")]
    assert "another job is extracting this run: job first (local; hosts local-r0h0;" in line
    assert f"`kill -TERM {first.pid}`" in line and "--join" in line, line
    assert not os.path.exists(os.path.join(run, "logs", "second"))

    # --join runs beside it; a SIGTERM then stops the first (its workers at a step
    # boundary) and gives the lease back, and the joined job finishes the run.
    joined = _rerun(run, "joined", "--join")
    while not os.path.exists(os.path.join(run, layout.heartbeat_key("local-joined-r0h0"))):
        assert joined.poll() is None and time.monotonic() < deadline, joined.communicate()
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 143, out
    [line] = [x for x in out.splitlines() if "interrupted" in x]
    assert line.startswith("actx rerun: interrupted by SIGTERM; the workers stopped; "
                           "partitions without a commit marker stay uncommitted: "
                           f"`actx rerun {run} --hosts 1 --batch-size 8 --job first` again "
                           "finishes them"), line
    assert job_lease.read(s) is None  # given back
    out, _ = joined.communicate(timeout=300)
    assert joined.returncode == 0, out
    assert "rerun: " in out and "nothing to do" not in out, out
    assert os.path.exists(os.path.join(run, "logs", "joined", "local-joined-r0h0.log"))
    assert s.read_json(layout.heartbeat_key("local-joined-r0h0"))["job"] == "joined"
    assert len(s.list(layout.COMMITS_PREFIX)) == 3072 // 32
    verify = subprocess.run([sys.executable, "-m", "actx.deploy.cli", "verify", run], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, capture_output=True,
                            text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_preempted_slices_lease_is_taken_over_at_once():
    """A tpu-vm job's detached lease whose hosts beat moments ago from machines this one
    cannot look into: held while gcloud says its slice is READY (the refusal names a job
    that runs), taken over at once when the slice is PREEMPTED, deleted or being created
    again; never for another slice, nor before the job's hosts reported (its launcher may
    still be creating the slice)."""
    import io

    from actx.deploy import config as deploy_config
    from actx.deploy import targets
    from actx.deploy.targets.tpu_vm import lease as tpu_lease

    s = store.open_store("memory://lease-preempted")
    target = deploy_config.TargetConfig(kind="tpu-vm", tpu=deploy_config.TpuConfig(
        name="pod1", zone="z", project="p", accelerator_type="v4-16"))
    hosts = tpu_lease.host_names(target.tpu)
    assert hosts == ["pod1-w0", "pod1-w1"]

    def held_by(job: str, hosts, reported: bool = True) -> None:
        s.delete(layout.JOB_LEASE_KEY)
        for key in s.list("workers/"):
            s.delete(key)
        job_lease.acquire(s, job_lease.new(job, hosts, "tpu-vm", "actx down", detached=True))
        if reported:
            for host in hosts:
                beat = dataclasses.replace(_beat(job), host=host, pid=12345,
                                           machine="t1v-n-elsewhere/boot")
                heartbeat_lib.HeartbeatWriter(s, host).beat(beat, force=True)

    def take(state: str):
        out = io.StringIO()
        taken = tpu_lease.take(s, target, "rerun-1", "pod.yaml", out,
                               slice_state=lambda tpu: state)
        return taken, out.getvalue()

    held_by("j1", hosts)
    with pytest.raises(targets.UsageError, match="job j1 .*stop it with actx down"):
        take("READY")
    for state in ("PREEMPTED", "NOT_FOUND", "DELETING", "CREATING"):
        held_by("j1", hosts)
        (_, lease), said = take(state)
        assert lease.job == "rerun-1" and job_lease.read(s).job == "rerun-1"
        assert f"job j1 held the run, but its slice pod1 is {state}" in said
    held_by("j1", ["pod2-w0", "pod2-w1"])  # another slice's job: its slice is not ours
    with pytest.raises(targets.UsageError, match="job j1"):
        take("NOT_FOUND")
    held_by("j1", hosts, reported=False)  # still being created by its launcher
    with pytest.raises(targets.UsageError, match="job j1"):
        take("NOT_FOUND")


def test_a_job_of_the_same_name_from_another_live_launcher_is_refused(run_store):
    """A fault audit started two `actx submit`s of one config in the same second: their
    jobs had one name (local-<time>), and the second launcher's lease was taken for the
    first's renewal: both prepared at once, or both launched workers under one name.
    The same name is the same job only from its own launcher (or one that is gone, or a
    detached job's, whose hosts hold it)."""
    now = time.time()
    first = job_lease.new("local-20261207-142301", ["local-r0h0"], "local", "Ctrl-C", now=now)
    job_lease.acquire(run_store, first, now=now)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # another live launcher on this machine, the same job name
        other = dataclasses.replace(first, pid=helper.pid)
        with pytest.raises(job_lease.LeaseHeld) as held:
            job_lease.acquire(run_store, other, now=now + 1)
        assert held.value.lease.pid == os.getpid()
        assert job_lease.read(run_store).pid == os.getpid()
        # Its own launcher again renews, as before.
        assert job_lease.acquire(run_store, dataclasses.replace(first, renewed_at=now + 2),
                                 now=now + 2).expires_at > first.expires_at
    finally:
        helper.kill()
        helper.wait()
    # The launcher that holds it gone (a later launcher of that job): renewed for it.
    run_store.write(layout.JOB_LEASE_KEY, store.dumps(
        {**_as_dict(job_lease.read(run_store)), "pid": _gone_pid()}))
    again = job_lease.acquire(run_store, other, now=now + 3)
    assert job_lease.read(run_store).pid == helper.pid and again.started_at == now


def test_a_killed_launchers_job_is_stopped_by_its_workers_pids(run_store):
    """A fault audit killed `actx submit` with SIGKILL while its workers extracted: the
    next submit was refused with `kill -TERM <the dead launcher's pid>`, which stops
    nothing. The refusal names the workers that still run instead; followed as printed,
    the next launcher takes the run over."""
    now = time.time()
    launcher = job_lease.new("local-20261207-170000", ["local-r0h0"], "local",
                             f"Ctrl-C in its terminal, or `kill -TERM {_gone_pid()}`", now=now)
    run_store.create(layout.JOB_LEASE_KEY, store.dumps(
        {**_as_dict(launcher), "pid": _gone_pid()}))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        heartbeat_lib.HeartbeatWriter(run_store, "local-r0h0").beat(
            _beat(launcher.job, pid=worker.pid), force=True)
        with pytest.raises(job_lease.LeaseHeld) as held:
            job_lease.acquire(run_store, job_lease.new("local-next", [], "local", "-"))
        said = job_lease.refusal(run_store.location, held.value.lease, time.time(),
                                 held.value.beats)
        assert f"which is gone, but its workers still run as pid(s) {worker.pid})" in said
        [command] = re.findall(r"`([^`]*)`", said)
        assert command == f"kill -TERM {worker.pid}", said
        subprocess.run(["bash", "-c", command], check=True)
        assert worker.wait(timeout=30) == -signal.SIGTERM
    finally:
        worker.kill()
        worker.wait()
    taken = job_lease.acquire(run_store, job_lease.new("local-next", [], "local", "-"))
    assert job_lease.read(run_store).job == taken.job == "local-next"


def test_a_damaged_lease_is_taken_over_once_no_host_works(run_store):
    """A lease that is not JSON (cut short by hand or by a disk) stopped every launcher
    with "rewrite it or delete it", and deleting it by hand would let a job start beside
    a live one. While a host of the run works the launcher is refused, naming it; once
    none does, the damaged lease is taken over, by one of two takers."""
    run_store.write(layout.JOB_LEASE_KEY, b'{"job": "local-20261207-1')
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        heartbeat_lib.HeartbeatWriter(run_store, "pod1-w0").beat(
            _beat("local-20261207-1", pid=worker.pid), force=True)
        with pytest.raises(job_lease.DamagedLeaseHeld,
                           match=r"job_lease\.json: not valid JSON .* still work: pod1-w0 "
                                 r"\(job local-20261207-1\)"):
            job_lease.acquire(run_store, job_lease.new("b", [], "local", "-"))
    finally:
        worker.kill()
        worker.wait()
    taken = job_lease.acquire(run_store, job_lease.new("b", [], "local", "-"))
    assert job_lease.read(run_store).job == taken.job == "b"
    # A second taker that read the same damaged bytes loses to the first.
    damaged = b'{"job": "local-20261207-1'
    run_store.write(layout.JOB_LEASE_KEY, damaged)
    with pytest.raises(job_lease.LeaseHeld):
        job_lease._over_a_damaged_lease(run_store, job_lease.new("c", [], "local", "-"),
                                        object_store.DamagedObjectError("", what="damaged"),
                                        time.time(), job_lease.DEFAULT_TTL_S)
