"""bench/requests.py's count of storage requests, checked against the bucket itself.

A small real `actx submit` (2 local hosts, the GCS emulator behind the counting proxy) is
counted by the bench's classification; the objects the emulator holds afterwards, listed
straight from it (not through the proxy) and sorted by the run-directory prefixes that
docs/run-directory.md names, are the independent count: every shard, commit marker,
claim and heartbeat object in the bucket was written, and counted in its class, exactly
as often as a fault-free run writes it.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request

import pytest

from actx.schemas import gcs_store
from actx.schemas import storage_requests as sr
from bench import requests as bench_requests
from tests import counting_proxy


@pytest.fixture
def proxy(gcs_emulator_server, monkeypatch):
    proxy = counting_proxy.CountingProxy(gcs_emulator_server.url).start()
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.url)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    gcs_store.reset_gcs_client()
    yield proxy
    proxy.stop()
    monkeypatch.undo()
    gcs_store.reset_gcs_client()


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


def small_job(tmp_path, gcs_emulator_server, proxy, qwen_tokenizer_dir, hosts=2):
    args = bench_requests.parse_args(["--step-time", "0.5", "--arc-tasks", "2",
                                      "--fineweb-docs", "6", "--hosts", str(hosts)])
    job = bench_requests.inputs(str(tmp_path), args, tokenizer=qwen_tokenizer_dir)
    return bench_requests.measure(proxy, gcs_emulator_server, job, str(tmp_path), hosts,
                                  args), args


def test_the_bench_counts_what_the_bucket_holds(tmp_path, gcs_emulator_server, proxy,
                                                 qwen_tokenizer_dir):
    m, args = small_job(tmp_path, gcs_emulator_server, proxy, qwen_tokenizer_dir)
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
    of_the_run = sum(1 for s in proxy.seen
                     if sr.run_key(s.prefix if s.is_listing else s.name, "runs/h2")
                     is not None)
    assert counted == of_the_run > 0
    # The report and the extrapolation print; the formula is in the output.
    rates = bench_requests.extrapolate(m, 0.5, args.batch, args.partition_rows)
    assert set(rates) == {64, 256, 1024}
    assert rates[1024]["data_writes"] == pytest.approx(16 * rates[64]["data_writes"])


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
    assert sr.object_class(key) == cls
    assert sr.object_class(sr.run_key(f"runs/x/extractions/chat/{key}", "runs/x")) == cls \
        or key.startswith(("tokens/", "manifest", "job_lease", "logs/"))
