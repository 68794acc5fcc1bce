"""bench/requests.py's count of storage requests, checked against the bucket itself, and
the dry run's storage estimate (deploy.storage_plan) checked against that count.

A small real `actx submit` (2 local hosts, the GCS emulator behind the counting proxy) is
counted by the bench's classification; the objects the emulator holds afterwards, listed
straight from it (not through the proxy) and sorted by the run-directory prefixes that
docs/run-directory.md names, are the independent count: every shard, commit marker,
claim and heartbeat object in the bucket was written, and counted in its class, exactly
as often as a fault-free run writes it. The estimate of the same job (its counts from the
run's manifest, its duration the hosts' measured one) predicts those counts.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request

import pytest

from actx.schemas import storage_requests as sr
from bench import requests as bench_requests
from tests import counting_proxy, gcs_emulator


@pytest.fixture(scope="module")
def proxy(gcs_emulator_server):
    proxy = counting_proxy.CountingProxy(gcs_emulator_server.url).start()
    with gcs_emulator.routed_through(proxy.url):
        yield proxy
        proxy.stop()


@pytest.fixture(scope="module")
def measured(tmp_path_factory, gcs_emulator_server, proxy, qwen_tokenizer_dir):
    """(the bench's count of a small 2-host job, the bench's arguments, what the proxy saw,
    the job's submit config)."""
    tmp = tmp_path_factory.mktemp("requests")
    args = bench_requests.parse_args(["--step-time", "0.5", "--arc-tasks", "4",
                                      "--fineweb-docs", "8", "--hosts", "2"])
    job = bench_requests.inputs(str(tmp), args, tokenizer=qwen_tokenizer_dir)
    m = bench_requests.measure(proxy, gcs_emulator_server, job, str(tmp), 2, args)
    return m, args, list(proxy.seen), str(tmp / "h2.yaml")


def bucket_objects(emulator_url: str, run: str) -> list[str]:
    """The names of the run's objects, from the emulator's JSON API (every page)."""
    bucket, prefix = run[len("gs://"):].split("/", 1)
    names, token = [], ""
    while True:
        query = urllib.parse.urlencode({"prefix": prefix + "/", "maxResults": 1000,
                                        **({"pageToken": token} if token else {})})
        with urllib.request.urlopen(f"{emulator_url}/storage/v1/b/{bucket}/o?{query}") as r:
            page = json.load(r)
        names += [item["name"][len(prefix) + 1:] for item in page.get("items", [])]
        token = page.get("nextPageToken", "")
        if not token:
            return names


def test_the_bench_counts_what_the_bucket_holds(measured, gcs_emulator_server):
    m, args, seen, _ = measured
    objects = bucket_objects(gcs_emulator_server.url, m.run)
    shards = [k for k in objects if re.fullmatch(r"activations/[^/]+/c/\d+/0/0", k)]
    markers = [k for k in objects if re.fullmatch(r"commits/p-\d{5}\.json", k)]
    claims = [k for k in objects if re.fullmatch(r"claims/[^/]+/p-\d{5}\.json", k)]
    beats = [k for k in objects if re.fullmatch(r"workers/[^/]+\.json", k)]
    hooks = {k.split("/")[1] for k in shards}
    assert len(markers) == m.partitions > 2 and len(beats) == 2 and len(hooks) == 2
    # 2 hooks of partitions of 8 rows in objects of 4 rows: 4 shard objects a partition
    # but the last, which holds what is left.
    assert 4 * (m.partitions - 1) < len(shards) <= 4 * m.partitions

    def ok(cls: str, op: str) -> int:
        return sum(n for (c, o, status), n in m.statuses.items()
                   if (c, o) == (cls, op) and 200 <= status < 300)

    assert ok("shards", "write") == len(shards)  # each shard object written once
    assert ok("markers", "write") == len(markers)  # create-only, one each
    assert ok("claims", "write") == len(claims)
    assert ok("heartbeats", "write") >= len(beats)
    # Every request the proxy forwarded for the run is in one class, the workers' in a
    # named one (nothing left as "other").
    assert not [k for k in m.counts if k[0] == "workers" and k[1] == "other"]
    counted = sum(m.counts.values())
    of_the_run = sum(1 for s in seen
                     if sr.run_key(s.prefix if s.is_listing else s.name, "runs/h2")
                     is not None)
    assert counted == of_the_run > 0
    # The report and the extrapolation print; the formula is in the output.
    import io

    table = io.StringIO()
    bench_requests.growth([m, m], table)  # one pod against itself: nothing grows
    rows = [line for line in table.getvalue().splitlines()
            if line.startswith(("| shards | write", "| heartbeats | write"))]
    assert len(rows) == 2 and all(line.endswith("| 1.00 |") for line in rows), table.getvalue()
    rates = bench_requests.extrapolate(m, 0.5, args.batch, args.partition_rows)
    assert set(rates) == {64, 256, 1024}
    assert rates[1024]["data_writes"] == pytest.approx(16 * rates[64]["data_writes"])


def test_the_estimate_predicts_what_was_counted(measured):
    """The dry run's storage estimate of the measured job, given its manifest's counts and
    the hosts' measured time, against the bench's count of the same job.

    Bounds, and why: the data writes follow the write layout and are exact (one write per
    shard object, one marker and one claim per partition, counted as the writes that
    succeeded: a replica that loses a race for a partition tries a claim that is refused).
    A marker is read before each claim tried: once a partition, again for each race lost,
    within 50%. Heartbeats are written every
    heartbeat_s and besides at start, end and on state changes: within 40%. Reads of the
    token store (storage_plan.token_reads): a shard's index and each inner chunk once a
    process, plus the earlier rows a long document's warm-up reads from other partitions
    (this job's FineWeb documents run over several partitions of 8 rows of 64 tokens): at
    most 1.5 x the estimate (a replica that plans partitions it then loses reads their
    rows too), and at least 0.8 x (was 0.5 x to 2 x before the warm-up was counted: the
    estimate was 1.5 x under). Listings follow the
    chooser's refresh, at most once a partition taken and in the tail every refresh until
    the last partition is committed, about one partition's time: at least one of each, at
    most 1.5 x the estimate (a loaded machine's last partition takes longer than the
    average the estimate uses). Class A (writes and listings) within 25%, Class B within a factor 2."""
    from actx.deploy import config as config_lib
    from actx.deploy import dry_run, storage_plan

    m, args, _, config_path = measured
    cfg = config_lib.load_submit_config(config_path)
    counted = dry_run.counts(cfg.spec, m.run)
    assert counted[0] is not None and counted[0].source == "from the run's manifest"
    job = dry_run.storage_job(cfg.spec, counted[0], cfg.target, m.host_seconds / m.hosts,
                              counted[0].tokens / (m.host_seconds / m.hosts))
    plan = storage_plan.plan(job)

    def got(cls, op):
        return m.worker(cls, op) + m.counts[("launcher", cls, op)]

    def ok(cls, op):
        return sum(n for (c, o, status), n in m.statuses.items()
                   if (c, o) == (cls, op) and 200 <= status < 300)

    for cls in ("shards", "markers", "claims"):
        assert plan.requests[(cls, "write")] == ok(cls, "write"), cls
    markers = plan.requests[("markers", "read")]
    assert markers <= got("markers", "read") <= 1.5 * markers
    assert got("heartbeats", "write") == pytest.approx(plan.requests[("heartbeats", "write")],
                                                       rel=0.4)
    inputs = plan.requests[("inputs", "read")]
    assert 0.8 * inputs <= m.worker("inputs", "read") <= 1.5 * inputs
    for cls in ("markers", "claims", "heartbeats"):
        assert 1 <= m.worker(cls, "list") <= 1.5 * plan.requests[(cls, "list")], cls
    workers_a = sum(n for (who, _, op), n in m.counts.items()
                    if who == "workers" and sr.GCS_CLASS[op] == "A")
    workers_b = sum(n for (who, _, op), n in m.counts.items()
                    if who == "workers" and sr.GCS_CLASS[op] == "B")
    logs = plan.requests[("logs", "write")]  # the launcher's copies, at the end
    print(f"\nestimate against count: Class A {plan.gcs('A') - logs:.0f} / {workers_a}, "
          f"Class B {plan.gcs('B'):.0f} / {workers_b}, heartbeats "
          f"{plan.requests[('heartbeats', 'write')]:.0f} / {got('heartbeats', 'write')}, "
          f"token store reads {inputs:.0f} / {m.worker('inputs', 'read')}")
    assert workers_a == pytest.approx(plan.gcs("A") - logs, rel=0.25)
    assert plan.gcs("B") / 2 <= workers_b <= 2 * plan.gcs("B")


@pytest.mark.parametrize("key, cls", [
    ("activations/layers.0.resid_post/c/12/0/0", "shards"),
    ("activations/layers.0.resid_post/zarr.json", "metadata"),
    ("activations/actx.json", "metadata"),
    ("commits/p-00003.json", "markers"),
    ("claims/job-1/p-00003.json", "claims"),
    ("workers/local-h2-r0h0.json", "heartbeats"),
    ("logs/job-1/local-h2-r0h0.log", "logs"),
    ("tokens/input_ids/c/3/0", "inputs"),
    ("manifest.json", "inputs"),
    ("job_lease.json", "lease"),
])
def test_object_classes_by_name(key, cls):
    from actx.schemas import layout

    assert sr.object_class(sr.run_key(f"runs/x/{key}", "runs/x")) == cls
    # A named extraction's own keys (docs/run-directory.md) are classed as the default's.
    if layout.extraction_key("chat", key) != key:
        named = sr.run_key(f"runs/x/{layout.extraction_key('chat', key)}", "runs/x")
        assert sr.object_class(named) == cls
    assert sr.run_key(f"runs/y/{key}", "runs/x") is None  # another run's


def test_the_bench_runs_small_as_its_docstring_says():
    """`SMALL=1 python bench/requests.py --step-time 0.5`, with fewer inputs still: its own
    emulator and proxy, the tables and the formula."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "SMALL": "1"}
    done = subprocess.run(
        [sys.executable, "bench/requests.py", "--step-time", "0.5", "--arc-tasks", "2",
         "--fineweb-docs", "4"], cwd=repo, env=env, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "## 2 hosts:" in out and "## 4 hosts:" not in out, out
    assert re.search(r"\| shards \| write \| A \| \d+ \|", out), out
    assert "rate(H) = H x (sum over control classes" in out
    assert re.search(r"\| 1,024 \| [\d,]+ \| [\d,]+ \| [\d,]+ \| [\d,]+ \|", out), out
