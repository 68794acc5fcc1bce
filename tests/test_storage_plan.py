"""`actx submit --dry-run --estimate`'s storage lines (deploy.storage_plan) on a multi-host
TPU slice, and the plan's rules against figures worked by hand: GCS's ramp, the point where
data writes meet a new bucket's capacity, the price. What it predicts against a counted
real run is tests/test_request_bench.py."""

from __future__ import annotations

import dataclasses
import io
import math
import re

import pytest
import yaml

from actx.deploy import cli
from actx.deploy import storage_plan
from bench import requests as bench_requests


@pytest.fixture(scope="module")
def tpu_config(tmp_path_factory, qwen_tokenizer_dir):
    tmp = tmp_path_factory.mktemp("storage-plan")
    args = bench_requests.parse_args(["--step-time", "1", "--arc-tasks", "4",
                                      "--fineweb-docs", "8"])
    job = bench_requests.inputs(str(tmp), args, tokenizer=qwen_tokenizer_dir)
    path = bench_requests.config(job, "gs://b/runs/plan", str(tmp / "c.yaml"), 1, args)
    data = yaml.safe_load(open(path))
    data["target"] = {"kind": "tpu-vm", "batch_size": 16,
                      "tpu": {"name": "t", "zone": "z", "project": "p",
                              "accelerator_type": "v5litepod-16"}}
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path, args


def _said(argv) -> str:
    out = io.StringIO()
    assert cli.main(argv, out=out) == 0, out.getvalue()
    return out.getvalue()


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def test_a_slice_gets_its_hosts_requests_and_price(tpu_config):
    path, args = tpu_config
    said = _said(["submit", path, "--dry-run", "--estimate"])
    rows = _int(re.search(r"tokens: [\d,]+ in ([\d,]+) rows", said).group(1))
    partitions = _int(re.search(r"\(([\d,]+) partitions;", said).group(1))
    # A v5litepod-16 is 4 hosts of 4 chips (Cloud TPU's v5e slice shapes), one replica.
    assert "for 4 host(s) in 1 replica(s)" in said, said
    # Two hooks (2 layers), one object per rows_per_shard rows each, written once; one
    # marker per partition; a replica alone takes no claims.
    shards = 2 * math.ceil(rows / args.rows_per_shard)
    assert f"#   shards: {shards:,} writes" in said, said
    assert re.search(rf"#   markers: [\d,]+ reads, {partitions:,} writes", said), said
    assert "claims:" not in said
    got = re.search(r"requests: ([\d,]+) Class A \(writes, listings\) \+ ([\d,]+) Class B "
                    r"\(reads\) = \$([\d.]+);", said)
    a, b = _int(got.group(1)), _int(got.group(2))
    # + the metadata, written once by process 0 of replica 0: actx.json and 2 zarr.json
    assert a >= shards + partitions + 1 + 2
    assert float(got.group(3)) == pytest.approx(a / 1e4 * 0.05 + b / 1e4 * 0.004, abs=0.006)
    assert "at list prices (GCS list prices, Standard storage in a region, " \
           "cloud.google.com/storage/pricing" in said
    assert re.search(r"write rate at [\d,]+ tokens/s: ", said), said
    assert re.search(r"bound by (storage|compute)\b.*: objects of 4 rows", said), said

    # Prices are the config's: 10,000 Class A operations at $1,000 make each one $0.10.
    said = _said(["submit", path, "--dry-run", "--estimate", "--set",
                  "prices.class_a_per_10k=1000", "--set", "prices.class_b_per_10k=0",
                  "--set", "prices.source=our contract"])
    got = re.search(r"Class A \(writes, listings\) \+ [\d,]+ Class B \(reads\) = \$([\d,.]+);",
                    said)
    assert float(got.group(1).replace(",", "")) == pytest.approx(a * 0.1, abs=0.01)
    assert "at list prices (our contract;" in said


def test_a_float8_run_counts_its_scale_arrays_objects_and_bytes(tpu_config):
    """The same job captured as float8_e4m3: each hook's values at one byte a value, plus
    its `<hook>.scale` array (float32, one a token) as objects and bytes of their own, as
    schemas.quantised stores them."""
    path, args = tpu_config
    base = _said(["submit", path, "--dry-run", "--estimate"])
    said = _said(["submit", path, "--dry-run", "--estimate", "--set",
                  "spec.capture.dtype=float8_e4m3"])
    rows = _int(re.search(r"tokens: [\d,]+ in ([\d,]+) rows", said).group(1))
    seq_len = _int(re.search(r"tokens: [\d,]+ in [\d,]+ rows of ([\d,]+)", said).group(1))
    arrays = {name: (width, dtype) for name, width, dtype
              in re.findall(r"#   (\S+): \[[\d,]+, [\d,]+, (\d+)\] (\w+) = ", said)}
    hooks = [h for h in arrays if not h.endswith(".scale")]
    assert len(hooks) == 2 and sorted(arrays) == sorted(hooks + [h + ".scale" for h in hooks])
    for h in hooks:
        assert arrays[h][1] == "float8_e4m3fn" and arrays[h + ".scale"] == ("1", "float32")
    shards = math.ceil(rows / args.rows_per_shard)
    # Four arrays (2 hooks' values, 2 scale arrays): one object per shard each, written once.
    assert f"#   shards: {4 * shards:,} writes" in said, said
    assert f"#   shards: {2 * shards:,} writes" in base, base

    def storage(text: str) -> tuple[int, str]:
        got = re.search(r"# storage: ([\d,]+) objects, (.+?) of activations uncompressed", text)
        return _int(got.group(1)), got.group(2)

    objects, size = storage(said)
    base_objects, _ = storage(base)
    # Each scale array adds its shards and its zarr.json (the metadata written once).
    assert objects == base_objects + 2 * (shards + 1)
    values = rows * seq_len * sum(int(arrays[h][0]) for h in hooks)  # one byte a value
    scales = 2 * rows * seq_len * 4  # one float32 a token and hook
    number, unit = size.split()
    scale = 1000 ** ["B", "KB", "MB", "GB", "TB"].index(unit)
    assert abs(float(number.replace(",", "")) * scale - (values + scales)) <= 0.05 * scale

    def metadata_writes(text: str) -> int:
        return _int(re.search(r"#   metadata: [\d,]+ reads, ([\d,]+) writes", text).group(1))

    # Process 0 of replica 0 writes each array's zarr.json once: 2 more arrays.
    assert metadata_writes(said) == metadata_writes(base) + 2


def test_named_extractions_are_each_costed_with_their_own_hooks(tpu_config, tmp_path):
    """With `extractions`, the workers extract each named one (its model, its hooks) and
    not the spec's own capture: the dry run costs each, with its arrays, objects and
    requests (before, it costed the spec's capture alone: a third of the shard writes a
    measured run made)."""
    path, args = tpu_config
    data = yaml.safe_load(open(path))
    model = data["spec"]["model"]
    data["spec"]["capture"] = {"hooks": "layers.0.resid_post", "dtype": "bfloat16"}
    data["extractions"] = {
        "base": {"model": model, "capture": {"hooks": "layers.*.resid_post",
                                              "dtype": "float32"}},
        "chat": {"model": model}}
    config = tmp_path / "extractions.yaml"
    config.write_text(yaml.safe_dump(data))
    said = _said(["submit", str(config), "--dry-run", "--estimate"])
    rows = _int(re.search(r"tokens: [\d,]+ in ([\d,]+) rows", said).group(1))
    shards = math.ceil(rows / args.rows_per_shard)
    blocks = said.split("# cost of extraction ")[1:]
    assert [b.split(" ", 1)[0] for b in blocks] == ["'base'", "'chat'"], said
    base, chat = blocks
    assert re.findall(r"#   (\S+): \[[\d,]+, [\d,]+, \d+\] (\w+) = ", base) == [
        ("layers.0.resid_post", "float32"), ("layers.1.resid_post", "float32")]
    assert re.findall(r"#   (\S+): \[[\d,]+, [\d,]+, \d+\] (\w+) = ", chat) == [
        ("layers.0.resid_post", "bfloat16")]
    assert f"#   shards: {2 * shards:,} writes" in base, base
    assert f"#   shards: {shards:,} writes" in chat, chat
    assert said.count("# storage: ") == 2


def _job(**changes) -> storage_plan.Job:
    base = dict(rows=1_000_000, partitions=10_000, seq_len=1024,
                hook_bytes_per_row={"h0": 1024 * 896 * 2}, rows_per_shard=8,
                partition_rows=100, hosts=64, replicas=64, steal=True, heartbeat_s=2.0,
                log_every_s=10.0, step_inputs=("input_ids", "positions", "segment_ids"),
                refresh_s=2.0, seconds=1000.0, tokens_per_s=1e9 / 1000)
    return storage_plan.Job(**{**base, **changes})


def test_the_ramp_doubles_every_twenty_minutes():
    assert storage_plan.ramp_s(900, 1000) == 0
    assert storage_plan.ramp_s(4000, 1000) == pytest.approx(40 * 60)
    assert storage_plan.ramp_s(1000 * 2 ** 5, 1000) == pytest.approx(100 * 60)
    # At 2,000 writes/s the bucket gets there in 20 min, having taken 1,000 x 1,200 / ln 2
    # = 1.73M writes; 10M writes more take 5,000 s at compute's 2,000 a second.
    taken = 1000 * 1200 / math.log(2)
    assert storage_plan.writing_s(taken + 10e6, 2000) == pytest.approx(1200 + 5000)
    assert storage_plan.writing_s(1000, 500) == pytest.approx(2.0)  # within capacity


def test_writes_over_the_buckets_capacity_are_a_storage_bound_with_the_balance():
    # 125,000 shard objects + 10,000 markers + 10,000 claims in 1,000 s: 145 writes/s.
    job = _job()
    p = storage_plan.plan(job)
    assert p.requests[("shards", "write")] == 125_000
    said = "\n".join(storage_plan.lines(job, _prices()))
    assert "145 data writes/s" in said and "bound by compute" in said, said
    # Ten times as fast: 1,450 writes/s, over the bucket's 1,000: GCS ramps for
    # 20 min x log2(1.45) = 10.7 min, and 1.45 x 8 = 11.6 rows an object, or 64 / 1.45 =
    # 44 hosts, balance it.
    fast = _job(seconds=100.0, tokens_per_s=1e9 / 100)
    said = "\n".join(storage_plan.lines(fast, _prices()))
    assert "1,450 data writes/s" in said and "bound by storage" in said, said
    assert "about 11 min of sustained load" in said, said
    assert "at 11.6 rows an object" in said and "or at 44 host(s)" in said, said
    # The bucket takes 1,000 x 1,200 / ln 2 x (2^(t / 1,200) - 1) writes by t: 145,000 by
    # t = 1,200 x log2(1 + 145,000 ln 2 / 1.2e6) = 139 s, not the 100 s compute needs.
    assert "about 2.3 min instead of 1.7 min at compute's pace, the job ending before" in said
    # Reads: a marker a partition, the holder of a claim, 3 token arrays x (an index + 13
    # chunks of 8 rows) + run.json and actx.json a partition, and at start each host's
    # run.json, manifest, the 4 token arrays' zarr.json (context_start's checked too),
    # actx.json and the hook's zarr.json: 10,000 x 46 + 64 x 8 = 460,512, plus listings of
    # commits, claims (5 pages each) and heartbeats (1 page).
    p = storage_plan.plan(fast)
    reads = 10_000 * 46 + 64 * 8
    assert sum(n for (_, op), n in p.requests.items() if op == "read") == reads
    listings = sum(n for (_, op), n in p.requests.items() if op == "list")
    # A look every 2 s (64 replicas x 11 pages stay under 2,000 pages/s), shortened by
    # up to a quarter at random: 1.75 s on average.
    look_s = 0.875 * 2
    refreshes = 64 * (min(100 / look_s, 10_000 / 64 + 1) + (100 * 64 / 10_000) / look_s)
    assert listings == pytest.approx(refreshes * 11 + 64 * 5)
    rate = (reads + listings) / 100
    assert f"read rate: {rate:,.0f} reads and listings/s against a new bucket's 5,000" in said


def test_reads_over_the_buckets_capacity_bound_a_job_whose_writes_are_within_it():
    """One hook: each object written is read about six times over (3 token arrays, an
    index and a chunk each, per host slice), so reads pass a new bucket's 5,000/s before
    writes pass its 1,000/s. The plan says storage (reads) bounds it, and the rows an
    object it names bring the reads within the bucket once planned."""
    def pod(rows_per_shard: int) -> storage_plan.Job:
        partition_rows = 64 * rows_per_shard  # every host of the 64 busy
        rows = 488_281
        return _job(rows=rows, partitions=-(-rows // partition_rows), seq_len=2048,
                    hook_bytes_per_row={"h0": 2048 * 896 * 2}, rows_per_shard=rows_per_shard,
                    partition_rows=partition_rows, replicas=1, seconds=68.0,
                    tokens_per_s=1e9 / 68)

    said = "\n".join(storage_plan.lines(pod(8), _prices()))
    assert "912 data writes/s" in said and "within it" in said, said
    assert "read rate: 5,437 reads and listings/s" in said, said
    assert "bound by storage (reads): about 1.2 min instead of 1.1 min" in said, said
    rows = float(re.search(r"initial writes and reads at ([\d.]+) rows an object", said)[1])
    assert 8 < rows < 9, said
    balanced = storage_plan.plan(pod(math.ceil(rows)))
    reads = sum(n for (_, op), n in balanced.requests.items() if op in ("read", "list"))
    assert reads / 68.0 < storage_plan.INITIAL_READS_PER_S
    assert "bound by compute" in "\n".join(storage_plan.lines(pod(math.ceil(rows)), _prices()))


def test_dollars_are_the_prices_times_the_operations():
    job = _job()
    p = storage_plan.plan(job)
    said = "\n".join(storage_plan.lines(job, _prices()))
    want = p.gcs("A") / 1e4 * 0.05 + p.gcs("B") / 1e4 * 0.004
    assert f"= ${want:,.2f};" in said, said


def _prices():
    from actx.deploy import config as config_lib

    return config_lib.StoragePrices()


def test_the_worked_plan_in_performance_md_is_what_the_plan_prints(capsys):
    """docs/performance.md's worked plan: its python block runs as written, and every
    number in a cell marked derived is in what it prints."""
    import pathlib

    from tests.test_readme import blocks, section

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "performance.md"
    text = section(page, "### A worked plan")
    [code] = blocks(text, "python")
    exec(compile(code, f"{page}:worked plan", "exec"), {"__name__": "docs"})
    printed = capsys.readouterr().out
    derived = [cell for line in text.splitlines() if line.startswith("| ")
               for cell in line.split("|") if "(derived)" in cell]
    assert len(derived) >= 16
    for cell in derived:
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", cell.split("(derived)")[0]):
            assert number in printed, (cell, number)


def test_a_generating_run_writes_a_sample_record_beside_each_marker():
    """A generating run's workers write generated/p-NNNNN.json before each partition's
    marker (workers.generate.worker): one more marker-class write and object a partition,
    and nothing else changes (measured: 11 partitions, 22 such writes)."""
    plain, generating = storage_plan.plan(_job()), storage_plan.plan(_job(generates=True))
    partitions = _job().partitions
    assert generating.requests[("markers", "write")] == 2 * partitions
    assert plain.requests[("markers", "write")] == partitions
    assert generating.objects == plain.objects + partitions
    assert {k: v for k, v in generating.requests.items() if k != ("markers", "write")} == \
        {k: v for k, v in plain.requests.items() if k != ("markers", "write")}


@pytest.mark.parametrize("changes, hosts", [
    (["target.kind=local", "target.extract=beam"], 1),  # the in-process FnApiRunner
    (["target.kind=local", "target.extract=beam",
      "target.beam_args=[--direct_num_workers=3, --direct_running_mode=multi_processing]"], 3),
    (["target.kind=dataflow", "target.extract=beam", "target.dataflow.max_num_workers=8",
      "target.dataflow.temp_location=gs://b/tmp"], 8),
])
def test_a_beam_extraction_is_planned_as_its_engine_runs_it(tpu_config, changes, hosts):
    """Extraction through Beam: each Beam worker process is a one-host replica and the
    engine schedules the partitions, so no claims (measured on a local Beam run: none
    written, read or listed), and the plan counts the engine's processes, not the target
    table's `hosts` (before: the table's 4 hosts stealing, or 1 for 8 Dataflow workers)."""
    from actx.deploy import config as config_lib
    from actx.deploy import dry_run

    path, _ = tpu_config
    cfg = config_lib.load_submit_config(path, ["target.hosts=4"] + changes)
    found = dry_run.Counts(tokens=64_000, rows=1_000, partitions=100, seq_len=64,
                           source="manifest")
    job = dry_run.storage_job(cfg.spec, found, cfg.target, 100.0, 640.0)
    assert (job.hosts, job.replicas, job.steal) == (hosts, hosts, False)
    planned = storage_plan.plan(job).requests
    assert not any(cls == "claims" for cls, _ in planned)
    if cfg.target.kind == "local":  # the same table with worker processes: 4 stealing
        workers = dry_run.storage_job(cfg.spec, found, dataclasses.replace(
            cfg.target, extract="workers"), 100.0, 640.0)
        assert (workers.hosts, workers.steal) == (4, True)
