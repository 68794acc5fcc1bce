"""The live page of a run in each phase, in real headless Chromium (all pages of this
module from one Chromium start): running (with a host still loading its weights), starting,
failed at start-up (a real worker process that died before its first heartbeat), finished,
and verified. Every figure against `actx status --json`; the run's settings, the latest
verify, rejects by reason, and chart axes with ticks.

ACTX_PAGE_SCREENSHOTS=DIR also writes each page's screenshot there (docs/ holds them).
"""

from __future__ import annotations

import io
import json
import os
import time

import pytest

from actx.deploy import cli
from actx.deploy import config as deploy_config
from actx.deploy import local
from actx.schemas import config as config_lib
from actx.schemas import heartbeat, layout, store
from tests import browser, page_checks, reader_fixtures, status_runs, token_runs

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _beat(run: str, host: str, message: str, now: float) -> None:
    """A live host that has processed no token yet: loading weights or compiling."""
    hb = heartbeat.Heartbeat(host=host, replica=9, process_index=0, state="starting",
                             attempt=f"{host}-1", updated_at=now - 1, message=message,
                             history=((round(now - 6, 1), 0), (round(now - 1, 1), 0)))
    store.open_store(run).write_json(layout.heartbeat_key(host), config_lib.to_dict(hb))


def _done_beats(run: str, now: float) -> None:
    """What two workers leave behind: "done", with their tokens over a minute of work after
    ten seconds of start-up."""
    total = store.open_store(run).read_json(layout.MANIFEST_KEY)["total_tokens"]
    for i, host in enumerate(("host-a", "host-b")):
        mine = total // 2 + (total % 2 if i else 0)
        t0 = now - 120
        history = tuple((round(t0 + 10 * k, 1), 0 if k < 2 else mine * (k - 1) // 6)
                        for k in range(8))
        hb = heartbeat.Heartbeat(host=host, replica=i, process_index=0, state="done",
                                 attempt=f"{host}-1", updated_at=history[-1][0],
                                 tokens_done=mine, partitions_done=1, history=history)
        store.open_store(run).write_json(layout.heartbeat_key(host), config_lib.to_dict(hb))


def _running(root: str, now: float) -> str:
    run = status_runs.write_local(os.path.join(root, "running"), n_partitions=24, n_hosts=3,
                                  committed=9, dead_hosts=1, now=now)
    _beat(run, "host-loading", "loading weights: /models/qwen (1,234.5 MB)", now)
    return run


def _starting(root: str, now: float) -> str:
    run = status_runs.write_local(os.path.join(root, "starting"), n_partitions=8, n_hosts=0,
                                  committed=0, now=now)
    _beat(run, "host-a", "loading weights: /models/qwen (1,234.5 MB)", now)
    _beat(run, "host-b", "compiling the step (its first call)", now)
    return run


def _failed_at_startup(root: str) -> tuple[str, str]:
    """A real worker process, launched as `actx submit` launches it, that stops before
    its first heartbeat (it refuses the run: another fingerprint)."""
    run = os.path.join(root, "failed")
    token_runs.write_token_run(run, "unused-model", n_rows=16, seq_len=16, partition_rows=8,
                               rows_per_shard=4)
    target = deploy_config.TargetConfig(hosts=1, batch_size=8)
    assert local.run_workers(run, target, "0" * 16, "job1", out=io.StringIO()) == 1
    log = open(os.path.join(run, "logs", "job1", "local-r0h0.log")).read()
    return run, [line for line in log.splitlines() if line.strip()][-1]


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict:
    """name -> (run, status --json, manifest.json, page DOM)."""
    browser.require_chromium()
    root = str(tmp_path_factory.mktemp("phases"))
    now = time.time()
    runs = {"running": _running(root, now), "starting": _starting(root, now)}
    runs["failed"], failed_line = _failed_at_startup(root)
    truth = reader_fixtures.build_run(os.path.join(root, "done"), num_partitions=2,
                                      committed=(0, 1))
    _done_beats(truth.uri, now)
    runs["finished"] = truth.uri
    out, docs = {}, {}
    for name in ("running", "starting", "failed", "finished", "verified"):
        run = runs.get(name, truth.uri)
        if name == "verified":
            assert cli.main(["verify", run], out=io.StringIO()) == 0
        path = os.path.join(root, f"{name}.html")
        assert cli.main(["status", run, "--html", path], out=io.StringIO()) == 0
        docs[name] = path
        out[name] = [run, page_checks.status_json(run),
                     store.open_store(run).read_json(layout.MANIFEST_KEY)]
    for name, dom in zip(docs, browser.dump_doms(list(docs.values()))):
        out[name].append(dom)
    shots = os.environ.get("ACTX_PAGE_SCREENSHOTS")
    if shots:
        for name, path in docs.items():
            browser.screenshot(f"file://{path}", os.path.join(shots, f"page-{name}.png"),
                               height=1250)
    out["failed_log_line"] = failed_line
    return out


def _checked(pages, name) -> tuple[dict, browser.Elements]:
    run, st, manifest_obj, dom = pages[name]
    return st, page_checks.check_page(dom, st, manifest_obj)


def test_running_run_shows_a_host_loading_rejects_by_reason_and_axes(pages):
    st, page = _checked(pages, "running")
    assert st["phase"] == "running"
    loading = next(h for h in st["hosts"] if h["host"] == "host-loading")
    assert loading["live"] and "loading weights" in loading["message"]
    assert page.text("data-host=host-loading").split()[1] == "starting"
    # Rejects by source and reason: status_runs writes "empty text" for 2 of each 3 rejects
    # and "not valid JSON: line 1" for the others (37 of fineweb, 2 of arc).
    expected = {("fineweb", "empty text"): 24, ("fineweb", "not valid JSON"): 13,
                ("arc", "empty text"): 1, ("arc", "not valid JSON"): 1}
    for (source, reason), n in expected.items():
        row = page.text(f"data-reject={source}|{reason}")
        assert row.startswith(f"{source} {reason} {n}"), row
        assert f"{source}.jsonl:" in row  # one sample, with its file and line
    rows = [k for k in page.by_key if k.startswith("data-reject=")]
    assert len(rows) == len(expected)
    # Axes: ticks in tokens and tokens/s, and time since the first heartbeat.
    xticks, _ = page_checks.check_axes(page, "chart-tokens")
    assert xticks[1] == "10m"  # 50 minutes of history, a tick every 10 minutes
    page_checks.check_axes(page, "chart-rate")
    assert page.attr("verify", "data-state") == "none"


def test_starting_run_says_what_each_host_is_doing(pages):
    st, page = _checked(pages, "starting")
    assert st["phase"] == "starting" and st["tokens_done"] == 0
    assert "loading weights: /models/qwen (1,234.5 MB)" in page.text("data-host=host-a")
    assert "compiling the step" in page.text("data-host=host-b")
    assert float(page.attr("chart-tokens", "data-startup-s")) > 0  # drawn as start-up
    out = io.StringIO()
    assert cli.main(["status", pages["starting"][0]], out=out) == 0
    assert "phase:      starting" in out.getvalue()
    assert "saw their whole document" not in out.getvalue()  # no "0 of 0"


def test_worker_that_died_before_its_first_heartbeat_shows_why(pages):
    st, page = _checked(pages, "failed")
    assert st["phase"] == "failed"
    [host] = st["hosts"]
    assert host["state"] == "failed" and not host["live"]
    assert "exited with code 2 before its first heartbeat" in host["message"]
    assert pages["failed_log_line"] in host["message"]  # the log's last line
    assert "fingerprint" in pages["failed_log_line"]
    assert "exited with code 2" in page.text("data-failed-host=local-r0h0")
    assert "rerun" in page.text("commands")


def test_finished_run_reads_as_finished(pages):
    st, page = _checked(pages, "finished")
    assert st["phase"] == "finished" and st["verification"] is None
    assert page.text("phase").startswith("finished: every partition is committed")
    assert "read" in [k.split("=", 1)[1] for k in page.by_key if k.startswith("data-command=")]
    assert st["elapsed_s"] == 70.0 and page.text("eta") == "1m10s"  # first beat to last
    assert page.text("hosts-done") == "2"
    # Shaded as start-up: up to the first point of the job's series (120 points over the
    # 70 s) after the last sample with no token (10 s).
    assert 10.0 < float(page.attr("chart-tokens", "data-startup-s")) <= 10.0 + 70 / 119 + 0.05


def test_verified_run_shows_the_verify_result(pages):
    st, page = _checked(pages, "verified")
    assert st["verification"]["ok"] and st["verification"]["checked"] == 2
    assert page.text("verify").startswith("passed at ")
    assert "2 partitions checked" in page.text("verify")
