"""`actx status` at pod scale: 1k, 10k and 150k partitions with 512 heartbeats, on local disk
and on the GCS emulator (fake-gcs-server on loopback), against a minimal baseline.

The baseline does the I/O with nothing else: read run.json, manifest.json and
activations/actx.json, list commits/ and workers/ (names only), read every heartbeat (in
parallel on GCS), and parse nothing. On GCS the listing baseline does only what status
now does there (heartbeats from the workers/ listing's summaries, not a read each).
`status` is `actx status RUN` in process (median of --iters after one warm-up); `--json` prints
every partition's state; `command` is one `python -m actx.deploy.cli status RUN --json`
subprocess (interpreter start and imports included: what users and their scripts run), the
best of 3. Two cases: hosts beating (8 of 512 silent) and every host silent, as a preempted
slice leaves them, each with its log in the run. The breakdown times each part alone: opening
the run, the commits/ listing, the heartbeats, the silent hosts' log lines (after the first
status, which reads them once and keeps them in the run), the whole computation (those reads
included), the JSON's encoding, and one request of the live page's data through its server.

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
    from actx.schemas import gcs_store

    bucket = gcs_store.gcs_client().bucket(BUCKET)
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
    from actx.schemas import gcs_store

    bucket = gcs_store.gcs_client().bucket(BUCKET)
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
    _command(run)  # writes the bytecode a later call reads
    row["command"] = min(_command(run) for _ in range(3))
    row.update(breakdown(run, iters))
    return row


def _command(run: str) -> float:
    """One `actx status RUN --json` process, as users and their scripts run it: with the
    modules' bytecode cached, as pip leaves an install (it compiles every module), even
    where the environment says PYTHONDONTWRITEBYTECODE (compiling actx's modules anew
    costs about 0.05 s a call)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "actx.deploy.cli", "status", run, "--json"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def breakdown(run: str, iters: int) -> dict:
    """Where `status --json`'s time goes, each part timed alone (median of `iters`):
    opening the run (run.json, manifest.json), the commits/ listing, the heartbeats, the
    silent hosts' log lines, the whole computation (those reads included) and the encoding
    of the JSON."""
    from actx.deploy.status import runstate
    from actx.deploy.status import text as status_text
    from actx.schemas import commit, heartbeat, run_dir

    handle = run_dir.open_run(run)
    n = len(handle.manifest.partitions)
    beats = heartbeat.read_heartbeats(handle.store, history=False)
    silent = [hb for hb in beats if time.time() - hb.updated_at > 60]
    status = runstate.compute_status(handle)
    return {
        "page": page_request(handle, iters),
        "open": _median(lambda: run_dir.open_run(run), iters),
        "listing": _median(lambda: commit.committed_partitions(handle.store, n), iters),
        "heartbeats": _median(lambda: heartbeat.read_heartbeats(handle.store, history=False),
                              iters),
        "logs": _median(lambda: runstate._silent_messages(handle.store, silent), iters),
        "compute": _median(lambda: runstate.compute_status(handle), iters),
        "encoding": _median(lambda: status_text.render_extractions({"": status}, as_json=True),
                            iters),
        "silent": len(silent),
    }


def page_request(handle, iters: int) -> float:
    """One request of the live page's data (`/data.json`) through its server, recomputed
    at every request (as a page open on the run asks every refresh interval)."""
    import threading
    import urllib.request

    from actx.deploy.page import server as ui_server

    source = ui_server.PageSource(handle, 60.0, min_interval_s=0.0)
    server = ui_server.make_server(source, 0, 5.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/data.json"
    try:
        return _median(lambda: urllib.request.urlopen(url, timeout=60).read(), iters)
    finally:
        server.shutdown()
        server.server_close()


def print_row(where: str, n: int, markers: int, row: dict) -> None:
    b = row["baseline"]
    print(f"| {where} | {n:,} | {markers:,} | {row['silent']} | {b:.3f} | {row['status']:.3f} | "
          f"{row['json']:.3f} | **{row['command']:.3f}** | "
          + (f"{row['baseline2']:.3f} | " if row["baseline2"] else "- | ")
          + " | ".join(f"{row[k]:.3f}" for k in ("open", "listing", "heartbeats", "logs",
                                                  "compute", "encoding", "page")) + " |",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--partitions", default="1000,10000,150000")
    p.add_argument("--hosts", type=int, default=512)
    p.add_argument("--committed", type=float, default=0.6, help="fraction committed")
    p.add_argument("--cases", default="beating,silent",
                   help="beating: 8 of the hosts silent; silent: every host silent, as a "
                        "preempted slice leaves them (each with its log in the run)")
    p.add_argument("--gcs-max-markers", type=int, default=15000,
                   help="fewer markers on the emulator: it keeps a bucket's objects in one "
                        "list, so loading N objects takes O(N^2) (20k uploads: 4 minutes)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-gcs", action="store_true")
    p.add_argument("--no-local", action="store_true")
    args = p.parse_args()
    sizes = [int(x) for x in args.partitions.split(",")]
    cases = {"beating": 8, "silent": args.hosts}
    tmp = tempfile.mkdtemp(prefix="actx-bench-status-")

    def kwargs(n, markers, dead):
        # Beating hosts' last beats are dated ahead (still fresh after the minutes a bench
        # takes); the silent ones are 70 s old either way, past the 60 s stale_after.
        ahead = 530.0 if dead < args.hosts else 0.0
        return dict(n_partitions=n, n_hosts=args.hosts, committed=markers, dead_hosts=dead,
                    now=time.time() + ahead, job="tpu-vm-bench")

    print(f"{args.hosts} heartbeats; seconds, median of {args.iters} (command: min of 3)",
          flush=True)
    print("| store | partitions | markers | silent hosts | baseline | status | status --json "
          "| command (--json) | listing baseline | open | listing | heartbeats | logs | "
          "compute | encoding | page request |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
          "--- | --- | --- |")
    try:
        for case in args.cases.split(","):
            dead = cases[case]
            for n in [] if args.no_local else sizes:
                markers = int(n * args.committed)
                run = status_runs.write_local(os.path.join(tmp, f"local-{n}"),
                                              **kwargs(n, markers, dead))
                print_row("local", n, markers,
                          time_status(run, args.iters, lambda: baseline_local(run)))
                shutil.rmtree(run)
            for n in [] if args.no_gcs else sizes:
                # One emulator per run: a request's cost grows with the objects in the bucket.
                markers = min(int(n * args.committed), args.gcs_max_markers)
                data_dir = os.path.join(tmp, f"gcs-{n}")
                run_kwargs = kwargs(n, markers, dead)
                # Heartbeats go through the API (with their summaries, as workers write
                # them); everything else is loaded from files at the emulator's start.
                status_runs.write_local(os.path.join(data_dir, BUCKET, "runs", f"s{n}"),
                                        exclude_prefix="workers/", **run_kwargs)
                gcs_emulator.reserve_endpoint()
                started = time.perf_counter()
                server = gcs_emulator.Emulator(os.environ["ACTX_TEST_GCS_URL"], data_dir).start()
                status_runs.write_store(f"gs://{BUCKET}/runs/s{n}", only_prefix="workers/",
                                        **kwargs(n, markers, dead))  # dated after loading
                print(f"(emulator loaded {markers + 2 * args.hosts + 6} objects in "
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
