"""A gs:// bucket that refuses writes (403 permission denied, a used-up storage quota,
507 insufficient storage), answered by the fault proxy (tests/fault_proxy.py) in front of
the GCS emulator, for both GCS clients (tensorstore and google-cloud-storage): prepare,
extract (through `actx rerun`) and verify each end with one line naming the gs:// path and
what to do, no traceback, nothing committed; with the bucket writable again the same
command finishes. Real `actx` processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actx.schemas import layout, store
from tests import fault_proxy, hf_models, worker_procs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITES = ("POST", "PUT", "PATCH", "DELETE")
REFUSALS = {"403": "permission denied on bucket", "403-quota": "has no room for it",
            "507": "has no room for it"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, qwen_tokenizer_dir) -> dict:
    t = tmp_path_factory.mktemp("refusals")
    model = hf_models.make_tiny_checkpoint(t / "m", "qwen2", vocab_size=151936,
                                           num_hidden_layers=1)
    texts = t / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"document {i} " * 10}) + "\n"
                             for i in range(12)))
    return {"model": str(model), "tokenizer": qwen_tokenizer_dir, "texts": str(texts)}


@pytest.fixture
def proxy(gcs_emulator_server):
    proxy = fault_proxy.FaultProxy(gcs_emulator_server.url).start()
    yield proxy
    proxy.stop()


def _actx(proxy, *args, timeout=300) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": REPO, "STORAGE_EMULATOR_HOST": proxy.url,
           "TENSORSTORE_GCS_HTTP_URL": proxy.url, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": worker_procs.xla_flags(1)}
    proc = subprocess.run([sys.executable, "-m", "actx.deploy.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _prepare_args(inputs, run) -> list[str]:
    return ["prepare", "--out", run, "--tokenizer", inputs["tokenizer"], "--model",
            inputs["model"], "--text", inputs["texts"], "--seq-len", "16",
            "--partition-rows", "4", "--rows-per-shard", "2", "--runner=FnApiRunner"]


def _refuse_writes(proxy, kind: str) -> None:
    proxy.add_rule(kind, lambda r: r.method in WRITES, times=None)


def _one_clear_line(code: int, said: str, run: str, kind: str) -> str:
    assert code == 2, said
    assert "Traceback" not in said, said
    lines = [x for x in said.splitlines() if REFUSALS[kind] in x]
    assert lines, said
    assert f"{run}/" in lines[0] and "then run the same command again" in lines[0] or (
        "grant this account" in lines[0]), lines[0]
    return lines[0]


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_prepare_into_a_bucket_that_refuses_writes(kind, inputs, proxy, gcs_bucket):
    run = gcs_bucket + "/runs/p"
    _refuse_writes(proxy, kind)
    code, said = _actx(proxy, *_prepare_args(inputs, run))
    _one_clear_line(code, said, run, kind)
    assert not store.open_store(run).exists(layout.MANIFEST_KEY)


@pytest.fixture(scope="module")
def prepared_once(inputs, gcs_emulator_server) -> str:
    run = gcs_emulator_server.create_bucket("actx-refusals-prepared") + "/runs/x"
    proxy = fault_proxy.FaultProxy(gcs_emulator_server.url).start()
    try:
        code, said = _actx(proxy, *_prepare_args(inputs, run))
    finally:
        proxy.stop()
    assert code == 0, said
    return run


@pytest.fixture
def prepared(prepared_once, gcs_bucket) -> str:
    """A copy of the prepared run in a fresh bucket."""
    src, run = store.open_store(prepared_once), gcs_bucket + "/runs/x"
    dest = store.open_store(run)
    for key in src.list(""):
        dest.write(key, src.read(key))
    return run


@pytest.mark.parametrize("kind", ["403", "507"])  # the quota's 403: prepare, the shard test
def test_extract_rerun_and_verify_on_a_bucket_that_refuses_writes(kind, prepared, proxy):
    run = prepared
    _refuse_writes(proxy, kind)
    # rerun: refused before any worker starts (its job lease cannot be written).
    code, said = _actx(proxy, "rerun", run, "--hosts", "1", "--batch-size", "2",
                       "--job", "refused")
    line = _one_clear_line(code, said, run, kind)
    assert line.startswith(f"actx rerun: error: {run}/{layout.JOB_LEASE_KEY}: "), line
    # extract (a worker alone): the first refused write ends it, in one line.
    code, said = _actx(proxy, "extract", "--run", run, "--batch-size", "2")
    line = _one_clear_line(code, said, run, kind)
    assert line.startswith(f"actx extract: error: {run}/"), line
    assert not store.open_store(run).list(layout.COMMITS_PREFIX)  # nothing committed

    # verify prints its report, then says in one line it could not record it.
    code, said = _actx(proxy, "verify", run, "--committed-only")
    assert code == 0 and "Traceback" not in said, said
    [line] = [x for x in said.splitlines() if "was not recorded" in x]
    assert f"{run}/{layout.VERIFY_RECORD_KEY}" in line and REFUSALS[kind] in line, line

    proxy.configure(rules=False)  # the bucket takes writes again: the same command finishes
    code, said = _actx(proxy, "rerun", run, "--hosts", "1", "--batch-size", "2")
    assert code == 0, said
    assert _actx(proxy, "verify", run)[0] == 0


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_a_shard_write_refused_names_the_object(kind, gcs_bucket, proxy, monkeypatch):
    """tensorstore's side of the same refusals (activation shards), in process: the
    writer's error is the one line google-cloud-storage's refusal gives."""
    import numpy as np

    from actx.schemas import runspec, store_errors, ts_context, uri
    from actx.workers.write import writer

    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.url)  # read at every open
    ts_context.configure(4, 1)
    try:
        arrays = writer.ActivationArrays(
            uri.parse(gcs_bucket + "/runs/w"), {"h": 8}, total_rows=8, seq_len=4,
            dtype="float32", layout=runspec.LayoutSpec(rows_per_shard=4, partition_rows=8,
                                                       chunk_rows=2))
        proxy.add_rule(kind, lambda r: r.agent == "tensorstore" and r.method in WRITES, None)
        part = writer.PartitionWriter(arrays, (0, 8), writer.WriterPool(1, 1 << 20))
        part.add(0, {"h": np.ones((8, 4, 8), np.float32)})
        with pytest.raises(store_errors.StoreError) as raised:
            part.finish()
    finally:
        ts_context.configure()
    said = str(raised.value)
    assert said.startswith(f"{gcs_bucket}/runs/w/activations/h/") and REFUSALS[kind] in said
    assert "\n" not in said and ("then run the same command again" in said
                                  or "grant this account" in said), said
