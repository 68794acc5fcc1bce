"""What goes wrong on the way to a TPU slice, against the simulated cloud: a queued resource
that ends FAILED or SUSPENDED or never comes, a create refused, a target that cannot be
(refused before anything is created), and a submitter that goes away while the workers
run (they finish anyway, their logs readable in the run directory meanwhile, the run
theirs: a second job is refused unless it joins, until `actx down` gives it back)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from actx.deploy import cli
from actx.schemas import heartbeat, job_lease, store
from tests import hf_models
from tests.fake_gcloud_fixtures import fake_cloud, pod_config  # noqa: F401 (fixture)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(argv) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(argv, out=out)
    return code, out.getvalue()


@pytest.fixture
def text_source(tmp_path) -> list[dict]:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(f'{{"text": "document {i} with a few words in it"}}\n'
                            for i in range(40)))
    return [{"kind": "text", "name": "docs", "paths": [str(path)]}]


@pytest.fixture
def small_model(tmp_path) -> str:
    return hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=2,
                                          vocab_size=151936)


@pytest.mark.parametrize("outcome", ["FAILED", "SUSPENDED"])
def test_queued_resource_failed_or_suspended_ends_the_wait(tmp_path, fake_cloud, gcs_bucket,
                                                           text_source, small_model,
                                                           qwen_tokenizer_dir, outcome):
    fake_cloud.control(qr_outcome=outcome, qr_waits=2)
    run = f"{gcs_bucket}/runs/qr"
    cfg = pod_config(tmp_path / "c.yaml", run, small_model, qwen_tokenizer_dir, text_source)
    code, out = _main(["submit", cfg, "--job", f"qr-{uuid.uuid4().hex[:6]}"])
    assert code == 1, out
    assert f"  ... {outcome}: the wait ends here; nothing more was started" in out
    assert "step 2 failed with exit code 1: wait until the queued resource is provisioned" in out
    assert (f"the queued resource pod1 did not become ACTIVE; nothing was prepared or started. "
            f"It stays until deleted: `actx down --config {cfg}`") in out
    assert store.open_store(run).list("") == []  # nothing prepared
    verbs = [c[4] for c in fake_cloud.calls()]
    assert verbs == ["create"] + ["describe"] * 3  # waiting, waiting, then the end state


def test_queued_resource_wait_times_out(tmp_path, fake_cloud, gcs_bucket, text_source,
                                        small_model, qwen_tokenizer_dir):
    fake_cloud.control(qr_waits=10 ** 6)  # never provisioned
    run = f"{gcs_bucket}/runs/slow"
    cfg = pod_config(tmp_path / "c.yaml", run, small_model, qwen_tokenizer_dir, text_source,
                     wait_timeout_s=1)
    t0 = time.monotonic()
    code, out = _main(["submit", cfg, "--job", f"slow-{uuid.uuid4().hex[:6]}"])
    assert code == 1 and time.monotonic() - t0 < 30, out
    assert "  ... still WAITING_FOR_RESOURCES after 1 s; giving up" in out
    assert store.open_store(run).list("") == []


def test_create_failure_is_shown_and_nothing_follows(tmp_path, fake_cloud, gcs_bucket,
                                                     text_source, small_model,
                                                     qwen_tokenizer_dir):
    fake_cloud.control(fail_create="RESOURCE_EXHAUSTED: no v4 capacity in us-central2-b")
    run = f"{gcs_bucket}/runs/nocap"
    cfg = pod_config(tmp_path / "c.yaml", run, small_model, qwen_tokenizer_dir, text_source)
    code, out = _main(["submit", cfg, "--job", f"nocap-{uuid.uuid4().hex[:6]}"])
    assert code == 1, out
    assert "RESOURCE_EXHAUSTED: no v4 capacity in us-central2-b" in out
    assert "step 1 failed with exit code 1: request the TPU slice pod1" in out
    assert f"`actx down --config {cfg}` deletes it" in out
    assert [c[4] for c in fake_cloud.calls()] == ["create"]
    assert store.open_store(run).list("") == []


@pytest.mark.parametrize("override, message", [
    ("target.tpu.accelerator_type=v4-33",
     "'v4-33': v4 slices come in sizes multiples of 8 from 8 to 8192"),
    ("target.tpu.accelerator_type=v9-8", "'v9-8' is not a Cloud TPU type"),
    ("target.batch_size=12",
     "target.batch_size: 12 rows per step do not split over the slice's 16 data-parallel "
     "devices (v4-32: 4 host(s) x 4 device(s), model_parallel 1); use a multiple of 16"),
    ("target.model_parallel=3", "target.model_parallel: 3 does not divide the 4 devices"),
    # Hooks and layers are pre-flight's (deploy/preflight.py), against the model's config.
    ("spec.capture.hooks=garbage!!", "garbage!!"),
    ("spec.capture.hooks=layers.99.resid_post", "99"),
])
def test_impossible_target_refused_before_anything_is_created(
        tmp_path, fake_cloud, gcs_bucket, text_source, small_model, qwen_tokenizer_dir, capsys,
        override, message):
    run = f"{gcs_bucket}/runs/bad"
    cfg = pod_config(tmp_path / "c.yaml", run, small_model, qwen_tokenizer_dir, text_source)
    for dry in ([], ["--dry-run"]):
        code, out = _main(["submit", cfg, "--set", override, "--job", "bad", *dry])
        assert code == 2, out
        err = capsys.readouterr().err
        assert message in err, err
    assert fake_cloud.calls() == [] and store.open_store(run).list("") == []


def test_every_problem_is_listed_at_once(tmp_path, fake_cloud, text_source, small_model,
                                         qwen_tokenizer_dir, capsys):
    cfg = pod_config(tmp_path / "c.yaml", str(tmp_path / "run"), small_model,
                     qwen_tokenizer_dir, text_source, name="")
    code, _ = _main(["submit", cfg, "--set", "target.batch_size=4", "--dry-run"])
    assert code == 2
    err = capsys.readouterr().err
    assert "3 problems" in err and fake_cloud.calls() == []
    assert "target.tpu: name required" in err and "need a gs:// run directory" in err
    assert "target.batch_size: 4 rows per step" in err


def test_workers_finish_when_the_submitter_dies_and_logs_show_while_they_run(
        tmp_path, fake_cloud, gcs_bucket, text_source, qwen_tokenizer_dir, small_model,
        capsys):
    run = f"{gcs_bucket}/runs/detached"
    # Two hosts (v4-16): enough for a multi-host replica, half the CPU of the journey.
    cfg = pod_config(tmp_path / "c.yaml", run, small_model, qwen_tokenizer_dir, text_source,
                     accelerator_type="v4-16", batch_size=8)
    job = f"det-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, PYTHONPATH=REPO)
    # The submitter follows the job (--wait) in its own session, like a laptop's terminal.
    submitter = subprocess.Popen(
        [sys.executable, "-m", "actx.deploy.cli", "submit", cfg, "--job", job, "--wait"],
        cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    lines = []
    for line in submitter.stdout:
        lines.append(line)
        if "workers are running on pod1" in line:
            break
    else:
        raise AssertionError("".join(lines))
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    # The laptop sleeps: the submitter and everything it started here die at once.
    os.killpg(submitter.pid, signal.SIGKILL)
    submitter.wait()
    assert fake_cloud.host_pids("pod1"), "the workers died with the submitter"

    # The run is theirs though their launcher is gone (a detached lease): a second job,
    # on the slice or here, is refused naming the job, its hosts and how to stop it ...
    rerun = ["rerun", run, "--config", cfg, "--job", "second"]
    for target in ("tpu-vm", "local"):
        capsys.readouterr()
        code, _ = _main(rerun + ["--target", target])
        said = capsys.readouterr().err  # the one-line error
        assert code == 2 and f"another job is extracting this run: job {job} (tpu-vm; hosts " \
            f"pod1-w0, pod1-w1;" in said and f"`actx down --config {cfg}`" in said, said
    assert "second" not in str(fake_cloud.calls())
    # ... unless it joins (here on another slice, which does not exist: the plan's first
    # step says so).
    code, out = _main(rerun + ["--target", "tpu-vm", "--join", "--set", "target.tpu.name=pod2"])
    assert code == 1 and "NOT_FOUND: TPU pod2 not found" in out, out
    assert job_lease.read(s).job == job

    # While the workers run, each host's log is readable in the run directory.
    seen_live_log = False
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        committed = len(s.list("commits/"))
        if committed == n:
            break
        logs = {k: s.read(k) for k in s.list(f"logs/{job}/")}
        if committed < n and sorted(logs) == [f"logs/{job}/pod1-w{i}.log" for i in range(2)] \
                and all(b"JAX distributed service on 127.0.0.1" in v for v in logs.values()):
            seen_live_log = seen_live_log or fake_cloud.host_pids("pod1") != []
        time.sleep(0.3)
    assert len(s.list("commits/")) == n, "the detached workers did not finish"
    assert seen_live_log, f"no log in the run directory while the workers ran: {logs}"
    # The hosts' supervisors end too, their last log copy saying how the worker ended.
    deadline = time.monotonic() + 60
    while fake_cloud.host_pids("pod1") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fake_cloud.host_pids("pod1") == []
    for i in range(2):
        assert s.read(f"logs/{job}/pod1-w{i}.log").endswith(
            b"[actx: worker exited with code 0]\n")
    code, out = _main(["verify", run])
    assert code == 0, out
    # Its hosts done, the lease holds no more; `actx down` gives it back with the slice.
    assert not job_lease.read(s).live(heartbeat.read_heartbeats(s), time.time())
    code, out = _main(["down", "--config", cfg])
    assert code == 0 and f"released the run's job lease of job {job}" in out, out
    assert job_lease.read(s) is None
