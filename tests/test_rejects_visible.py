"""Rejects are always visible (issue 66, item 3): one malformed line and one without its
text field among 200 give, in prepare's summary, the count, the reasons with their counts
and the rejects path; `actx status` says the same, and `--json` has it. The reference is
the rejects/ files prepare wrote (one record per reject, each with its reason). Real
prepare (Beam's in-process runner) with the real Qwen2.5 tokenizer."""

from __future__ import annotations

import collections
import io
import json
import os
import subprocess
import sys

from actx.deploy import cli
from actx.schemas import layout, store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(tmp_path) -> str:
    lines = [json.dumps({"text": f"document number {i} says something"}) for i in range(198)]
    lines.insert(17, '{"text": "a line cut short')
    lines.insert(90, json.dumps({"body": "no text field here"}))
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _rejects_on_disk(run: str) -> collections.Counter:
    s = store.open_store(run)
    found = collections.Counter()
    for key in s.list(layout.REJECTS_PREFIX):
        for line in s.read(key).splitlines():
            found[layout.reject_kind(json.loads(line)["reason"])] += 1
    return found


def test_prepare_and_status_name_count_reasons_and_path(tmp_path, qwen_tokenizer_dir):
    run = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "actx.pipeline.main", "--out", run, "--tokenizer",
         qwen_tokenizer_dir, "--text", _inputs(tmp_path), "--seq-len", "32",
         "--max-reject-fraction", "0.05", "--runner=FnApiRunner"], cwd=REPO, text=True,
        capture_output=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    reasons = _rejects_on_disk(run)
    assert sum(reasons.values()) == 2 and len(reasons) == 2, reasons
    path = os.path.join(run, "rejects")  # the directory of rejects/ files
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("rejects: ")]
    assert line.startswith("rejects: 2 input(s) rejected (") and line.endswith(
        f"each with its reason in {path}"), line
    for kind, n in reasons.items():
        assert f"{kind} {n}" in line, (kind, line)

    out = io.StringIO()
    assert cli.main(["status", run], out=out) == 0
    [status_line] = [x for x in out.getvalue().splitlines() if x.startswith("rejects:")]
    assert status_line == "rejects:    " + line.removeprefix("rejects: ")

    out = io.StringIO()
    assert cli.main(["status", run, "--json"], out=out) == 0
    rejects = json.loads(out.getvalue())["rejects"]
    assert rejects["count"] == 2 and rejects["path"] == path
    assert collections.Counter({k: n for per in rejects["reasons"].values()
                                for k, n in per.items()}) == reasons
