"""`actx submit` on the local target: the embedded demo config on 2 simulated hosts (what
README's first command runs), a 2-host replica joined by jax.distributed, and a failing
worker named with the tail of its log."""

from __future__ import annotations

import io
import re
import os
import shutil

import pytest
import yaml

from actx.deploy import cli
from actx.schemas import commit, store
from tests import hf_models, token_runs


@pytest.fixture(scope="module")
def tiny_qwen2_model(tmp_path_factory) -> str:
    return str(hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "qwen2",
                                              "qwen2", num_hidden_layers=2))


def test_demo_submit_two_hosts(tmp_path, monkeypatch, qwen_tokenizer_dir):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copytree(qwen_tokenizer_dir, cache / "qwen2-tokenizer")  # skip re-converting
    monkeypatch.setenv("ACTX_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    assert cli.main(["submit", "--job", "demo1"], out=out) == 0, out.getvalue()
    text = out.getvalue()
    run = str(tmp_path / "runs" / "demo")
    assert "a tiny Qwen2 with RANDOM weights" in text
    # Each phase named as it happens, and no noise: prepare's progress and its summary,
    # the workers' start-up, the finished run; no "0 of 0", no warning of an absent extra.
    assert "tokens tokenized" in text and "prepare: done: " in text
    assert "starting: " in text and "phase:      finished" in text
    assert "0 of 0 stored tokens" not in text and "apitools" not in text
    for line in text.splitlines():  # the README's transcript reads the same way
        assert not line.startswith(("WARNING", "INFO", "DEBUG", "E1", "W1", "I1")), line
    assert "2 worker process(es) (2 replica(s) x 1 host(s)" in text
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert f"partitions: {n} total | {n} committed" in text
    assert f"activations: {run}/activations/<hook>" in text
    # The final status says how many stored tokens saw their whole document, counted here
    # from the token store itself.
    context_start = token_runs.read_tokens(run, "context_start")
    whole, stored = int((context_start == 0).sum()), int((context_start >= 0).sum())
    assert f"{whole:,} of {stored:,} stored tokens" in text and whole > 0
    assert sorted(os.listdir(f"{run}/logs/demo1")) == ["local-r0h0.log", "local-r1h0.log"]
    assert {s.read_json(k)["host"] for k in s.list("workers/")} == {"local-r0h0", "local-r1h0"}
    manifest = s.read_json("manifest.json")
    assert set(manifest["sources"]) == {"arc", "fineweb"} and manifest["arc_tasks"]
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    # Submitting again finds it prepared and committed, and does nothing.
    out = io.StringIO()
    assert cli.main(["demo"], out=out) == 0
    assert "already prepared" in out.getvalue() and "nothing to do" in out.getvalue()


def _token_run(tmp_path, model: str) -> str:
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model, n_rows=16, seq_len=16, partition_rows=8,
                               rows_per_shard=4)
    return run


def test_rerun_local_two_host_replica(tmp_path, tiny_qwen2_model):
    run = _token_run(tmp_path, tiny_qwen2_model)
    s = store.open_store(run)
    out = io.StringIO()
    # One row per device in both attempts: reruns must share the run's numerics key.
    assert cli.main(["rerun", run, "--only", "1", "--job", "one", "--batch-size", "1"],
                    out=out) == 0, out.getvalue()
    assert commit.committed_partitions(s) == {1}  # only what was asked; exit 0 all the same
    out = io.StringIO()
    code = cli.main(["rerun", run, "--hosts", "2", "--hosts-per-replica", "2",
                     "--devices-per-host", "2", "--batch-size", "4", "--job", "mh"], out=out)
    assert code == 0, out.getvalue()
    assert "rerun: 1 partition(s) on local: p-00000" in out.getvalue()
    assert "(1 replica(s) x 2 host(s), 2 CPU device(s) each)" in out.getvalue()
    assert commit.committed_partitions(s) == {0, 1}
    assert commit.read_marker(s, 0).hosts == ("r0h0", "r0h1")
    assert cli.main(["verify", run], out=io.StringIO()) == 0


def test_failing_worker_is_named_with_its_log(tmp_path):
    # A model directory the worker cannot load (there, but empty: one that is gone is
    # refused before any worker starts).
    (tmp_path / "no-such-model").mkdir()
    run = _token_run(tmp_path, str(tmp_path / "no-such-model"))
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"hosts": 1}}))
    out = io.StringIO()
    assert cli.main(["rerun", run, "--config", str(cfg), "--job", "bad"], out=out) == 1
    text = out.getvalue()
    assert re.search(r"worker local-r0h0 \(pid \d+\) failed \(exit code \d+\)", text), text
    assert "no-such-model" in text  # the tail of its log says why
    assert "0/2 committed" in text
