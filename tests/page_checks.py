"""What the live page must show, checked against `actx status --json` (and manifest.json,
parsed here): shared by the page tests."""

from __future__ import annotations

import io
import json
import math
import time

from actx.deploy import cli
from tests import browser


def status_json(run: str) -> dict:
    out = io.StringIO()
    assert cli.main(["status", run, "--json"], out=out) == 0
    return json.loads(out.getvalue())


def _duration(s: float) -> str:
    s = math.floor(s + 0.5)  # halves up, as JavaScript's Math.round and status's text
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def check_page(dom: str, st: dict, manifest_obj: dict) -> browser.Elements:
    """Every figure the page shows, against `status --json` and manifest.json parsed here."""
    page = browser.Elements(dom)
    assert int(page.attr("page", "data-rendered")) >= 1  # the scripts ran
    for state in ("committed", "in_progress", "stale", "pending"):
        assert page.text(f"n-{state}") == f"{st['counts'][state]:,}", state
    assert page.text("n-total") == f"{len(st['partitions']):,}"
    assert page.text("tokens-done") == f"{st['tokens_done']:,}"
    assert page.text("tokens-total") == f"{st['tokens_total']:,}"
    assert page.text("tokens-pct") == f"{100 * st['tokens_done'] / st['tokens_total']:.1f}%"
    assert page.attr("bytes-done", "data-value") == (
        "null" if st["bytes_done"] is None else str(st["bytes_done"]))
    finished = st["phase"] == "finished"
    assert (st["phase"] == "finished") == st["complete"]
    if finished:  # the average and how long it took; no ETA, no live-host count
        assert page.text("tokens-per-s") == f"{st['average_tokens_per_s'] or 0:,.1f}"
        assert page.text("eta-label") == "took"
        assert page.text("eta") == (_duration(st["elapsed_s"]) if st["elapsed_s"] is not None
                                    else "unknown")
        assert page.attr("card-hosts-live", "hidden") is not None
        assert page.attr("card-hosts-done", "hidden") is None
        assert page.text("hosts-done") == str(sum(h["state"] == "done" for h in st["hosts"]))
        assert "rerun" not in page.text("commands")
    else:
        assert page.text("tokens-per-s") == f"{st['tokens_per_s']:,.1f}"
        assert page.text("eta") == (st["eta"] if st["eta_s"] is None
                                    else _duration(st["eta_s"]))
        assert page.attr("card-hosts-done", "hidden") is not None
        live = [h for h in st["hosts"] if h["live"]]
        assert page.text("hosts-live") == f"{len(live):,}"
        assert page.text("hosts-total") == f"{len(st['hosts']):,}"
        assert f"actx rerun {st['run']}" in page.text("commands")
    # The phase, in words.
    assert page.attr("phase", "data-phase") == st["phase"]
    assert page.text("phase").startswith(f"{st['phase']}:")
    # The run's identity.
    ident = st["identity"]
    assert page.text("id-model").startswith(ident["model"])
    assert page.text("id-seq-len") == f"{ident['seq_len']:,}"
    assert page.text("id-stored-dtype") == ident["dtype"]
    assert page.text("id-packing").startswith(ident["packing"])
    assert page.text("id-activations") == ident["activations"]
    assert page.text("id-tokens").startswith(f"{ident['tokens']:,} in {ident['rows']:,} rows")
    if ident["hooks"]:
        for hook, width in ident["hooks"].items():
            assert f"{hook} ({width:,})" in page.text("id-hooks")
    if ident["max_context"]:
        assert page.text("id-max-context") == f"{ident['max_context']:,}"
    # The latest verify.
    v = st["verification"]
    state = "none" if v is None else ("passed" if v["ok"] else "failed")
    assert page.attr("verify", "data-state") == state
    if v is not None:
        assert _utc(v["at"]) in page.text("verify")
    # The map as drawn: the colour of every cell, read back from the canvas.
    drawn = json.loads(page.attr("map", "data-drawn"))
    failed = len(st["failed_verification"])
    expected = {"C": st["counts"]["committed"] - failed, "F": failed,
                "W": st["counts"]["in_progress"], "S": st["counts"]["stale"],
                ".": st["counts"]["pending"]}
    assert drawn == {k: v for k, v in expected.items() if v}
    flagged = [int(name[2:]) for name, s in sorted(st["partitions"].items())
               if s in ("in_progress", "stale") or name in st["failed_verification"]]
    assert json.loads(page.attr("map", "data-flagged")) == flagged[:50]
    # Hosts: live or not, state, and what it is doing or why it stopped.
    for h in st["hosts"]:
        key = f"data-host={h['host']}"
        assert page.attr(key, "data-live") == str(h["live"]).lower()
        starting = h["live"] and h["tokens_done"] == 0
        assert ("starting" if starting else h["state"]) in page.text(key)
        assert " ".join(h["message"].split()) in page.text(key)
        # A failure banner for a failed or lost host; none for a stopped one (Ctrl-C,
        # SIGTERM), and none at all once every partition is committed.
        if (not h["live"] and h["state"] not in ("done", "stopped") and h["message"]
                and not st["complete"]):
            assert " ".join(h["message"].split()) in page.text(f"data-failed-host={h['host']}")
    for source, counts in manifest_obj["sources"].items():
        row = page.text(f"data-source={source}")
        assert row == f"{source} {counts['rejected']:,} {counts['read']:,}", row
    return page


def check_axes(page: browser.Elements, chart: str) -> tuple[list[str], list[str]]:
    """A chart's tick labels: at least three per axis, y ascending from 0, x as time since
    the first heartbeat from 0s."""
    xticks = json.loads(page.attr(chart, "data-xticks"))
    yticks = json.loads(page.attr(chart, "data-yticks"))
    assert len(xticks) >= 3 and len(yticks) >= 3, (xticks, yticks)
    assert xticks[0] == "0s" and yticks[0] == "0"
    return xticks, yticks
