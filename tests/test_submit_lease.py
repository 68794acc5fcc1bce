"""One job writes a run (schemas.job_lease): `actx submit` on the local target takes the
run's job lease before prepare, so a second submit started while the first prepares is
refused (exit 2, naming the job) before it writes anything; `--join` waits for nothing
and prepares nothing: refused while the run is being prepared, it runs beside the job
once the run is prepared. Real prepare (Beam's in-process runner) and real worker
processes on a tiny random Qwen2."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from actx.deploy import cli
from actx.schemas import job_lease, layout, store
from tests import hf_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen2", "qwen2",
                                              vocab_size=151936, num_hidden_layers=1))


def _config(tmp_path, model: str, tokenizer: str, run: str, docs: int = 80) -> str:
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"document {i} " * 12}) + "\n"
                             for i in range(docs)))
    path = tmp_path / "submit.yaml"
    path.write_text(yaml.safe_dump({
        "run": run,
        "spec": {"name": "lease", "model": {"path": model}, "tokenizer": {"path": tokenizer},
                 "sources": [{"kind": "text", "paths": [str(texts)]}],
                 "packing": {"seq_len": 32},
                 "layout": {"rows_per_shard": 2, "partition_rows": 4},
                 "capture": {"hooks": "layers.0.resid_post"}},
        "target": {"kind": "local", "hosts": 1, "batch_size": 4, "heartbeat_s": 1}}))
    return str(path)


def _submit(*argv) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stderr
    sys.stderr = err
    try:
        code = cli.main(["submit", *argv], out=out)
    finally:
        sys.stderr = saved
    return code, out.getvalue() + err.getvalue()


def _files(run: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), run)
                  for d, _, fs in os.walk(run) for f in fs)


def test_a_submit_is_refused_before_writing_while_another_job_holds_the_run(
        tmp_path, model, qwen_tokenizer_dir):
    """The other job's launcher is alive (this process), so its lease holds."""
    run = str(tmp_path / "run")
    config = _config(tmp_path, model, qwen_tokenizer_dir, run)
    s = store.open_store(run)
    job_lease.acquire(s, job_lease.new("first", ["local-r0h0"], "local", "Ctrl-C"))
    before = _files(run)
    code, said = _submit(config, "--job", "second")
    assert code == 2, said
    assert "another job is extracting this run: job first (local; hosts local-r0h0;" in said
    assert "prepare:" not in said
    assert _files(run) == before == [layout.JOB_LEASE_KEY]
    # --join does not prepare beside a job that has not prepared the run yet.
    code, said = _submit(config, "--job", "joiner", "--join")
    assert code == 2 and "job first is preparing this run" in said, said
    assert _files(run) == before
    # The lease given back, the same submit prepares and extracts.
    job_lease.release(s, job_lease.read(s))
    code, said = _submit(config, "--job", "second")
    assert code == 0, said
    assert job_lease.read(s) is None  # given back at the end


def test_two_submits_at_once_the_second_is_refused_during_the_first_ones_prepare(
        tmp_path, model, qwen_tokenizer_dir):
    run = str(tmp_path / "run")
    config = _config(tmp_path, model, qwen_tokenizer_dir, run, docs=400)
    first = subprocess.Popen([sys.executable, "-m", "actx.deploy.cli", "submit", config,
                              "--job", "first"], cwd=REPO, text=True,
                             env={**os.environ, "PYTHONPATH": REPO},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    attempt = os.path.join(run, layout.PREPARE_ATTEMPT_KEY)
    deadline = time.monotonic() + 180
    while not os.path.exists(attempt):  # its prepare has begun
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    code, said = _submit(config, "--job", "second")
    assert code == 2, said
    assert "another job is extracting this run: job first" in said, said
    assert "prepare:" not in said and "removed" not in said
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    assert "removed" not in out  # nobody cleared the live prepare's objects
    # Prepared now: --join runs beside whatever holds it (here: nothing left to do).
    code, said = _submit(config, "--job", "joiner", "--join")
    assert code == 0 and "is already prepared" in said, said
    verify = io.StringIO()
    assert cli.main(["verify", run], out=verify) == 0, verify.getvalue()


def test_named_extractions_are_recorded_only_under_the_lease(
        tmp_path, model, qwen_tokenizer_dir):
    """A config with named extractions writes their specs (extractions/<name>/run.json)
    only once it holds the run's job lease: refused by another job's lease, it writes
    nothing, so it cannot replace an extraction the other job is extracting."""
    run = str(tmp_path / "run")
    config = _config(tmp_path, model, qwen_tokenizer_dir, run)
    with open(config) as f:
        data = yaml.safe_load(f)
    data["extractions"] = {"chat": {"model": {"path": model},
                                    "capture": {"hooks": "layers.0.mlp_out"}}}
    with open(config, "w") as f:
        yaml.safe_dump(data, f)
    s = store.open_store(run)
    job_lease.acquire(s, job_lease.new("first", ["local-r0h0"], "local", "Ctrl-C"))
    code, said = _submit(config, "--job", "second")
    assert code == 2 and "another job is extracting this run: job first" in said, said
    assert _files(run) == [layout.JOB_LEASE_KEY]
