"""The live page in real headless Chromium: its numbers, its partition map (read back from
the canvas pixels) and its hosts against `actx status --json`, on a run in progress with a
dead host, a served page that refreshes, a gs:// run, and 150k partitions.

Screenshots are saved under each test's tmp_path.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from actx.deploy import cli
from actx.schemas import layout, store, ts_context
from tests import browser, page_checks, reader_fixtures, status_runs

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


_status_json, _check_page = page_checks.status_json, page_checks.check_page


@pytest.fixture
def run_with_dead_host(tmp_path) -> str:
    return status_runs.write_local(str(tmp_path / "run"), n_partitions=40, n_hosts=4,
                                   committed=17, dead_hosts=1, now=time.time())


def test_html_page_of_a_run_with_a_dead_host(run_with_dead_host, tmp_path):
    run = run_with_dead_host
    page_path = str(tmp_path / "page.html")
    assert cli.main(["status", run, "--html", page_path], out=io.StringIO()) == 0
    st = _status_json(run)
    assert st["counts"]["stale"] == 1 and st["eta_s"] is not None  # the dead host's partition
    manifest_obj = json.load(open(os.path.join(run, "manifest.json")))
    page = _check_page(browser.dump_dom(f"file://{page_path}"), st, manifest_obj)
    dead = [h for h in st["hosts"] if not h["live"]]
    assert [h["host"] for h in dead] == ["host-003"]
    assert "stale" in page.text("data-host=host-003")
    # Charts drawn from the heartbeats' history: as many points as the series has.
    assert int(page.attr("chart-tokens", "data-points")) > 10
    # Commands to act on what the page shows.
    # Every uncommitted partition (`--only stale` would leave the pending ones).
    assert f"actx rerun {run}" in page.text("commands")
    assert "--only stale" not in page.text("commands")
    assert f"actx verify {run}" in page.text("commands")
    shot = browser.screenshot(f"file://{page_path}", str(tmp_path / "page.png"))
    assert os.path.getsize(shot) > 20_000


def test_served_page_refreshes_from_the_store(run_with_dead_host, tmp_path):
    run = run_with_dead_host
    proc = subprocess.Popen([sys.executable, "-m", "actx.deploy.cli", "status", run, "--serve", "0",
                             "--refresh", "1"], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        st = _status_json(run)
        manifest_obj = json.load(open(os.path.join(run, "manifest.json")))
        dom = browser.dump_dom(url, budget_ms=2500)
        page = _check_page(dom, st, manifest_obj)
        assert int(page.attr("page", "data-polls") or 0) >= 1  # data.json was fetched
        # A new marker shows up in the data the page polls.
        s = store.open_store(run)
        assert s.create_json(layout.commit_key(30), {"partition": 30})
        time.sleep(1.1)  # the server recomputes at most once per refresh interval
        data = json.load(urllib.request.urlopen(url + "data.json", timeout=30))
        after = _status_json(run)
        assert data["counts"] == after["counts"]
        assert after["counts"]["committed"] == st["counts"]["committed"] + 1
        assert data["map"][30] == "C"
        browser.screenshot(url, str(tmp_path / "served.png"))
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "nothing-here", timeout=30)
        assert e.value.code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_page_of_a_gcs_run(gcs_bucket, tmp_path):
    run = status_runs.write_store(f"{gcs_bucket}/runs/page", n_partitions=12, n_hosts=3,
                                  committed=5, dead_hosts=1, now=time.time())
    page_path = str(tmp_path / "gcs.html")
    assert cli.main(["status", run, "--html", page_path], out=io.StringIO()) == 0
    st = _status_json(run)
    manifest_obj = store.open_store(run).read_json("manifest.json")
    _check_page(browser.dump_dom(f"file://{page_path}"), st, manifest_obj)


def test_page_at_150k_partitions(tmp_path):
    browser.require_chromium()  # before spending seconds on the run
    run = status_runs.write_local(str(tmp_path / "big"), n_partitions=150_000, n_hosts=512,
                                  committed=30_000, dead_hosts=8, now=time.time(),
                                  history_samples=64)
    page_path = str(tmp_path / "big.html")
    assert cli.main(["status", run, "--html", page_path], out=io.StringIO()) == 0
    assert os.path.getsize(page_path) < 3_000_000
    st = _status_json(run)
    manifest_obj = json.load(open(os.path.join(run, "manifest.json")))
    page = _check_page(browser.dump_dom(f"file://{page_path}", budget_ms=5000), st,
                       manifest_obj)
    assert st["counts"] == {"committed": 30_000, "in_progress": 504, "stale": 8,
                            "pending": 150_000 - 30_512}
    assert int(page.attr("map", "data-cell")) >= 2  # one cell per partition, visible
    browser.screenshot(f"file://{page_path}", str(tmp_path / "big.png"), height=1600)


def test_serve_and_html_refuse_json_and_a_busy_port(run_with_dead_host, capsys):
    assert cli.main(["status", run_with_dead_host, "--html", "x.html", "--json"],
                    out=io.StringIO()) == 2
    assert "drop --json" in capsys.readouterr().err
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["status", run_with_dead_host, "--serve", str(port)],
                        out=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert f"cannot listen on 127.0.0.1:{port}" in err and "choose another port" in err



def test_partitions_that_failed_verify_are_marked(tmp_path):
    """A real run's activations damaged after commit: `actx verify` records the partition,
    status names it and the page draws it as failed verification."""
    truth = reader_fixtures.build_run(str(tmp_path / "run"), num_partitions=4,
                                      committed=(0, 1, 2))
    run, hook = truth.uri, truth.hooks[0]
    arr = ts_context.open_array({"driver": "zarr3", "kvstore": {
        "driver": "file", "path": os.path.join(run, "activations", hook) + "/"}})
    rows = slice(truth.partition_rows, truth.partition_rows + 2)  # inside partition 1
    original = arr[rows].read().result()
    arr[rows].write(np.full(arr[rows].shape, 3.0, np.float32)).result()
    out = io.StringIO()
    assert cli.main(["verify", run], out=out) == 1
    record = json.load(open(os.path.join(run, "verify", "latest.json")))
    assert record["failed"] == [1] and "p-00001" in record["problems"][0]
    st = _status_json(run)
    assert st["failed_verification"] == ["p-00001"] and st["counts"]["committed"] == 3
    text = io.StringIO()
    cli.main(["status", run], out=text)
    assert "1 committed partition(s) failed the latest `actx verify`: p-00001" in text.getvalue()
    page_path = str(tmp_path / "page.html")
    assert cli.main(["status", run, "--html", page_path], out=io.StringIO()) == 0
    manifest_obj = json.load(open(os.path.join(run, "manifest.json")))
    page = _check_page(browser.dump_dom(f"file://{page_path}"), st, manifest_obj)
    assert json.loads(page.attr("map", "data-drawn"))["F"] == 1
    # Verifying that partition again after a rewrite of its data clears it.
    arr[rows].write(original).result()
    assert cli.main(["verify", run, "--only", "1"], out=io.StringIO()) == 0
    assert _status_json(run)["failed_verification"] == []

