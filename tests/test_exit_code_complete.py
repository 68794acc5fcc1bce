"""The exit code says whether the data is complete (issue 66, item 2): one of two local
workers (replicas that share work) is SIGKILLed once it has started; the other commits
every partition; `actx rerun` exits 0, and the death is history (one line), not a failure
banner, in the launcher's output, in status text, `--json` and the page. Real worker
processes on a tiny random Qwen2."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

from actx.deploy import cli
from actx.deploy.page import data as ui_data
from actx.deploy.status import runstate
from actx.schemas import commit, layout, run_dir, store
from tests import hf_models, token_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VICTIM = "local-r1h0"


def _kill_when_started(run: str, proc: subprocess.Popen) -> int:
    """SIGKILLs replica 1's worker as soon as its heartbeat names its process; its pid."""
    s = store.open_store(run)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        beat = s.read_json(layout.heartbeat_key(VICTIM))
        if beat and beat.get("pid"):
            os.kill(beat["pid"], signal.SIGKILL)
            return beat["pid"]
        time.sleep(0.05)
    raise AssertionError(f"replica 1 never beat: {proc.communicate()}")


def test_a_worker_killed_while_the_other_finishes_is_history_and_exit_0(tmp_path):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=2)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=64, seq_len=32, partition_rows=8,
                               rows_per_shard=4)  # 8 partitions
    cfg = tmp_path / "t.yaml"
    cfg.write_text("target:\n  heartbeat_s: 1\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "actx.deploy.cli", "rerun", run, "--config", str(cfg),
         "--hosts", "2", "--batch-size", "8", "--job", "twohosts"], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pid = _kill_when_started(run, proc)
    said, _ = proc.communicate(timeout=300)
    s = store.open_store(run)
    assert sorted(commit.committed_partitions(s, 8)) == list(range(8)), said
    # Complete: exit 0, whatever failed on the way; the death is one line of history.
    assert proc.returncode == 0, said
    assert (f"extract: history: worker {VICTIM} (pid {pid}) ended early (killed by "
            f"SIGKILL" in said), said
    assert "failed (killed" not in said and "redoes them" not in said, said
    assert "phase:      finished" in said and f"history:    {VICTIM} ended failed" in said

    out = io.StringIO()
    assert cli.main(["status", run, "--check"], out=out) == 0
    text = out.getvalue()
    assert "phase:      finished" in text and "actx rerun" not in text, text
    [line] = [x for x in text.splitlines() if x.startswith(f"history:    {VICTIM}")]
    assert "killed by SIGKILL" in line and "the other hosts committed the rest" in line

    out = io.StringIO()
    assert cli.main(["status", run, "--json"], out=out) == 0
    st = json.loads(out.getvalue())
    assert st["complete"] and st["phase"] == "finished"
    # The dead host, then the partitions the survivor took over (its heartbeat's count).
    taken = sum(sum(h["stolen_from"].values()) for h in st["hosts"])
    assert taken > 0 and st["history"][1:] == [
        f"{taken} partition(s) were taken over from other hosts' lists"], st["history"]
    assert st["history"][0].startswith(f"{VICTIM} ended failed"), st["history"]

    page = ui_data.page_data(runstate.compute_status(run_dir.open_run(run)))
    assert page["phase"] == "finished" and page["history"] == st["history"]
    assert not any(h["dead"] for h in page["hosts"]) and "rerun_all" not in page["commands"]


def test_a_run_with_partitions_missing_exits_1_and_names_the_command_last(tmp_path):
    """The other side: a worker that fails with partitions left exits 1, and the last line
    is the command that finishes them (a model that cannot load: every host fails; its
    directory is there but empty, since a directory that is gone is refused before any
    worker starts)."""
    run = str(tmp_path / "run")
    (tmp_path / "no-such-model").mkdir()
    token_runs.write_token_run(run, str(tmp_path / "no-such-model"), n_rows=16, seq_len=16,
                               partition_rows=8, rows_per_shard=4)
    out = io.StringIO()
    code = cli.main(["rerun", run, "--hosts", "2", "--batch-size", "4"], out=out)
    said = out.getvalue().rstrip().splitlines()
    assert code == 1, said
    assert said[-1].endswith(f"`actx rerun {run}` redoes them"), said[-3:]
