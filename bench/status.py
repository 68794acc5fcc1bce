"""`actx status` at pod scale: 1k, 10k and 150k partitions with 512 heartbeats, on local disk
and on the GCS emulator (fake-gcs-server on loopback), against a minimal baseline.

The baseline does the I/O with nothing else: read run.json, manifest.json and
activations/actx.json, list commits/ and workers/ (names only), read every heartbeat (in
parallel on GCS), and parse nothing. On GCS the listing baseline does only what status
now does there (heartbeats from the workers/ listing's summaries, not a read each).
`status` is `actx status RUN` in process (median of --iters after one warm-up); `--json` prints every partition's state; `command` is one
`python -m actx.deploy.cli status RUN` subprocess (interpreter start and imports included).

  python bench/status.py                       # 1k, 10k, 150k; local and gs://
  python bench/status.py --partitions 1000 --no-gcs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests import gcs_emulator, status_runs  # noqa: E402

BUCKET = "actx-bench"


def _median(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def baseline_local(run: str) -> None:
    for key in ("run.json", "manifest.json", "activations/actx.json"):
        with open(os.path.join(run, key), "rb") as f:
            f.read()
    with os.scandir(os.path.join(run, "commits")) as it:
        sorted(e.name for e in it)
    with os.scandir(os.path.join(run, "workers")) as it:
        names = sorted(e.name for e in it)
    for name in names:
        with open(os.path.join(run, "workers", name), "rb") as f:
            f.read()


def baseline_gcs(prefix: str) -> None:
    from actx.schemas import store

    bucket = store._gcs_client().bucket(BUCKET)
    for key in ("run.json", "manifest.json", "activations/actx.json"):
        bucket.blob(f"{prefix}/{key}").download_as_bytes()
    fields = "items(name),nextPageToken"
    [b.name for b in bucket.client.list_blobs(bucket, prefix=f"{prefix}/commits/",
                                              fields=fields, page_size=1000)]
    names = [b.name for b in bucket.client.list_blobs(bucket, prefix=f"{prefix}/workers/",
                                                      fields=fields, page_size=1000)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda n: bucket.blob(n).download_as_bytes(), names))


def baseline_gcs_summaries(prefix: str) -> None:
    """The I/O status does on GCS now: heartbeats come from the workers/ listing with each
    object's summary (custom metadata), not one read each."""
    from actx.schemas import store

    bucket = store._gcs_client().bucket(BUCKET)
    for key in ("run.json", "manifest.json", "activations/actx.json"):
        bucket.blob(f"{prefix}/{key}").download_as_bytes()
    [b.name for b in bucket.client.list_blobs(bucket, prefix=f"{prefix}/commits/",
                                              fields="items(name),nextPageToken",
                                              page_size=1000)]
    [b.metadata for b in bucket.client.list_blobs(bucket, prefix=f"{prefix}/workers/",
                                                  fields="items(name,metadata),nextPageToken",
                                                  page_size=1000)]


def time_status(run: str, iters: int, baseline, baseline2=None) -> dict:
    from actx.deploy import cli

    def status(*flags):
        out = io.StringIO()
        assert cli.main(["status", run, *flags], out=out) == 0
        return out.getvalue()

    status()
    row = {"baseline": _median(baseline, iters), "status": _median(status, iters),
           "baseline2": _median(baseline2, iters) if baseline2 else None,
           "json": _median(lambda: status("--json"), iters)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "actx.deploy.cli", "status", run], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, env=os.environ.copy())
    row["command"] = time.perf_counter() - start
    return row


def print_row(where: str, n: int, markers: int, row: dict) -> None:
    b = row["baseline"]
    print(f"| {where} | {n:,} | {markers:,} | {b:.3f} | {row['status']:.3f} | "
          f"{row['status'] / b:.1f} | "
          f"{row['json']:.3f} | {row['json'] / b:.1f} | {row['command']:.3f} | "
          + (f"{row['baseline2']:.3f} | {row['status'] / row['baseline2']:.1f} |"
             if row["baseline2"] else "- | - |"), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--partitions", default="1000,10000,150000")
    p.add_argument("--hosts", type=int, default=512)
    p.add_argument("--committed", type=float, default=0.6, help="fraction committed")
    p.add_argument("--gcs-max-markers", type=int, default=15000,
                   help="fewer markers on the emulator: it keeps a bucket's objects in one "
                        "list, so loading N objects takes O(N^2) (20k uploads: 4 minutes)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-gcs", action="store_true")
    p.add_argument("--no-local", action="store_true")
    args = p.parse_args()
    sizes = [int(x) for x in args.partitions.split(",")]
    tmp = tempfile.mkdtemp(prefix="actx-bench-status-")
    kwargs = lambda n, markers: dict(n_partitions=n, n_hosts=args.hosts,  # noqa: E731
                                     committed=markers, dead_hosts=8, now=time.time())
    print(f"{args.hosts} heartbeats (8 silent); seconds, median of {args.iters}; "
          f"ratio = status / baseline", flush=True)
    print("| store | partitions | markers | baseline | status | ratio | status --json | ratio | "
          "command | listing baseline | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    try:
        for n in [] if args.no_local else sizes:
            markers = int(n * args.committed)
            run = status_runs.write_local(os.path.join(tmp, f"local-{n}"), **kwargs(n, markers))
            print_row("local", n, markers,
                      time_status(run, args.iters, lambda: baseline_local(run)))
            shutil.rmtree(run)
        for n in [] if args.no_gcs else sizes:
            # One emulator per run: a request's cost grows with the objects in the bucket.
            markers = min(int(n * args.committed), args.gcs_max_markers)
            data_dir = os.path.join(tmp, f"gcs-{n}")
            run_kwargs = kwargs(n, markers)
            # Heartbeats go through the API (with their summaries, as workers write them);
            # everything else is loaded from files at the emulator's start.
            status_runs.write_local(os.path.join(data_dir, BUCKET, "runs", f"s{n}"),
                                    exclude_prefix="workers/", **run_kwargs)
            gcs_emulator.reserve_endpoint()
            started = time.perf_counter()
            server = gcs_emulator.Emulator(os.environ["ACTX_TEST_GCS_URL"], data_dir).start()
            status_runs.write_store(f"gs://{BUCKET}/runs/s{n}", only_prefix="workers/",
                                    **run_kwargs)
            print(f"(emulator loaded {markers + args.hosts + 6} objects in "
                  f"{time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            try:
                row = time_status(f"gs://{BUCKET}/runs/s{n}", args.iters,
                                  lambda: baseline_gcs(f"runs/s{n}"),
                                  lambda: baseline_gcs_summaries(f"runs/s{n}"))
                print_row("gs:// emulator", n, markers, row)
            finally:
                server.stop()
                shutil.rmtree(data_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
