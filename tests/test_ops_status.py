"""`actx status` from markers and heartbeats alone: committed / in progress / stale /
pending, ETA unknown without a live worker, bad run locations, and no jax or Beam."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest

from actx.deploy import cli
from actx.schemas import config as config_lib
from actx.schemas import heartbeat, layout, store
from tests import token_runs


@pytest.fixture
def run(tmp_path) -> str:
    path = str(tmp_path / "run")
    token_runs.write_token_run(path, "unused-model", n_rows=40, seq_len=16, partition_rows=8,
                               rows_per_shard=4)  # 5 partitions
    return path


def _beat(run: str, host: str, state: str, partition, age_s: float, tokens_per_s: float):
    hb = heartbeat.Heartbeat(host=host, replica=0, process_index=0, state=state,
                             attempt=f"{host}-1", updated_at=time.time() - age_s,
                             partition=partition, tokens_per_s=tokens_per_s)
    store.open_store(run).write_json(layout.heartbeat_key(host), config_lib.to_dict(hb))


def _status_json(*argv) -> dict:
    out = io.StringIO()
    assert cli.main(["status", *argv, "--json"], out=out) == 0
    return json.loads(out.getvalue())


def test_stale_heartbeat_is_stale_and_eta_unknown(run):
    s = store.open_store(run)
    s.create_json(layout.commit_key(0), {"partition": 0})
    _beat(run, "old-host", "working", 1, age_s=600, tokens_per_s=5000.0)
    st = _status_json(run)
    assert st["partitions"] == {"p-00000": "committed", "p-00001": "stale",
                                "p-00002": "pending", "p-00003": "pending",
                                "p-00004": "pending"}
    assert st["counts"] == {"committed": 1, "in_progress": 0, "stale": 1, "pending": 3}
    assert st["eta"] == "unknown" and st["eta_s"] is None
    assert st["tokens_per_s"] == 0
    assert st["map"] == ["CS..."]
    [host] = st["hosts"]
    assert host["host"] == "old-host" and not host["live"] and host["age_s"] >= 600
    text = io.StringIO()
    cli.main(["status", run], out=text)
    assert "ETA: unknown (no live worker)" in text.getvalue()
    assert "working (stale)" in text.getvalue()
    # A shorter threshold is the user's call.
    assert _status_json(run, "--stale-after", "1000")["partitions"]["p-00001"] == "in_progress"


def test_a_silent_host_shows_how_long_and_the_last_line_of_its_copied_log(run):
    """A TPU VM that is preempted dies with its worker, which never says why: status and
    the page's data say the host stopped beating and show the last line of the log its
    host copied into the run (deploy.host_run), not just "stale"."""
    s = store.open_store(run)
    hb = heartbeat.Heartbeat(host="tpu-w-1", replica=0, process_index=1, state="working",
                             attempt="a", updated_at=time.time() - 700, partition=2,
                             job="j7", message="extracting p-00002")
    s.write_json(layout.heartbeat_key("tpu-w-1"), config_lib.to_dict(hb))
    s.write(layout.log_key("j7", "tpu-w-1"),
            b"step 3 of 8\nMaintenance event: instance preempted (spot)\n"
            b"[actx: log copied]\n\n")
    _beat(run, "no-log-host", "working", 3, age_s=900, tokens_per_s=1.0)  # no job, no log
    hosts = {h["host"]: h for h in _status_json(run)["hosts"]}
    message = hosts["tpu-w-1"]["message"]
    assert message.startswith("extracting p-00002; stopped beating (preempted, or its host "
                              "is gone); ")
    assert message.endswith("its log (logs/j7/tpu-w-1.log) ends: Maintenance event: "
                            "instance preempted (spot)")
    assert hosts["no-log-host"]["message"] == "stopped beating (preempted, or its host is gone)"
    assert "its log" not in hosts["no-log-host"]["message"]
    text = io.StringIO()
    cli.main(["status", run], out=text)
    assert "instance preempted (spot)" in text.getvalue()
    # A live host's message is its own.
    assert _status_json(run, "--stale-after", "10000")["hosts"][1]["message"] == \
        "extracting p-00002"


def test_live_worker_gives_in_progress_and_an_eta(run):
    _beat(run, "h0", "working", 2, age_s=1, tokens_per_s=100.0)
    _beat(run, "h1", "preempted", 3, age_s=1, tokens_per_s=100.0)
    st = _status_json(run)
    assert st["partitions"]["p-00002"] == "in_progress"
    assert st["partitions"]["p-00003"] == "stale"  # its worker was preempted
    manifest = json.load(open(f"{run}/manifest.json"))
    assert st["tokens_total"] == manifest["total_tokens"] and st["tokens_done"] == 0
    assert st["tokens_per_s"] == 100.0
    assert st["eta_s"] == pytest.approx(manifest["total_tokens"] / 100.0)
    assert st["bytes_total"] is None  # no worker has written activations/actx.json yet


def test_partitions_a_process_holds_go_stale_with_it(run):
    """A heartbeat names every partition given to its process (`held`: a Beam bundle's,
    before its model loads); they are in progress while it beats, and stale once its
    heartbeat is older than the stale interval, all of them, not just the one in hand."""
    s = store.open_store(run)
    s.create_json(layout.commit_key(3), {"partition": 3})
    hb = heartbeat.Heartbeat(host="beam-m-7", replica=0, process_index=0, state="starting",
                             attempt="beam-m-7-7-setup", updated_at=time.time() - 30,
                             held=(1, 2, 3), job="j")
    s.write_json(layout.heartbeat_key("beam-m-7"), config_lib.to_dict(hb))
    parts = _status_json(run, "--stale-after", "60")["partitions"]
    assert [parts[f"p-0000{i}"] for i in range(5)] == [
        "pending", "in_progress", "in_progress", "committed", "pending"]
    parts = _status_json(run, "--stale-after", "10")["partitions"]
    assert [parts[f"p-0000{i}"] for i in range(5)] == [
        "pending", "stale", "stale", "committed", "pending"]


def test_bytes_from_activation_info(run):
    s = store.open_store(run)
    s.write_json(layout.ACTIVATIONS_INFO_KEY, {"dtype": "bfloat16", "fingerprint": "x",
                                                 "hooks": {"layers.0.resid_post": 64,
                                                           "layers.1.resid_post": 64}})
    s.create_json(layout.commit_key(4), {"partition": 4})
    st = _status_json(run)
    assert st["bytes_total"] == 40 * 16 * 2 * 128
    assert st["bytes_done"] == 8 * 16 * 2 * 128


def test_not_an_actx_run(tmp_path, capsys):
    for argv in (["status", str(tmp_path / "missing")], ["status", str(tmp_path)],
                 ["verify", str(tmp_path)], ["rerun", str(tmp_path / "missing")],
                 ["status", "ftp://x/y"]):
        assert cli.main(argv, out=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert "not an actx run" in err or "unsupported URI scheme" in err, err
        assert "Traceback" not in err


def test_a_config_file_given_for_its_run_names_the_run(tmp_path, monkeypatch, capsys):
    """`actx status my-run.yaml` (the config, not its run): said so, with the run
    directory its `run:` names, taken from the config's directory as submit takes it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my-run.yaml").write_text("run: runs/mine\nspec: {}\n")
    (tmp_path / "notes.txt").write_text("x\n")
    for command in ("status", "verify", "rerun"):
        assert cli.main([command, "sub/my-run.yaml"], out=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert "sub/my-run.yaml: a submit config, not a run directory; its run is " \
               "sub/runs/mine" in err and "`actx status sub/runs/mine`" in err, err
    assert cli.main(["status", "notes.txt"], out=io.StringIO()) == 2
    assert "notes.txt: a file, not an actx run directory" in capsys.readouterr().err


def test_not_an_actx_run_on_gcs(gcs_bucket, capsys):
    assert cli.main(["status", f"{gcs_bucket}/runs/none"], out=io.StringIO()) == 2
    assert "not an actx run (no run.json)" in capsys.readouterr().err
    assert cli.main(["status", "gs://no-such-bucket-actx/r"], out=io.StringIO()) == 2
    assert "bucket no-such-bucket-actx does not exist" in capsys.readouterr().err


def test_rerun_with_everything_committed_does_nothing(run):
    s = store.open_store(run)
    for p in range(5):
        s.create_json(layout.commit_key(p), {"partition": p})
    out = io.StringIO()
    assert cli.main(["rerun", run], out=out) == 0
    assert "all 5 partitions" in out.getvalue() and "nothing to do" in out.getvalue()
    assert not s.list("logs/")  # no worker was started
    out = io.StringIO()
    assert cli.main(["status", run, "--watch", "0.1"], out=out) == 0  # complete: one frame


def test_rerun_only_stale_with_none_stale(run):
    out = io.StringIO()
    assert cli.main(["rerun", run, "--only", "stale"], out=out) == 0
    assert "no partition is stale" in out.getvalue()


def test_ops_commands_import_neither_jax_nor_beam(run):
    code = ("import sys, io; from actx.deploy import cli; "
            f"cli.main(['status', {run!r}], out=io.StringIO()); "
            f"cli.main(['status', {run!r}, '--html', {run + '/page.html'!r}], out=io.StringIO()); "
            f"cli.main(['verify', {run!r}], out=io.StringIO()); "
            f"cli.main(['rerun', {run!r}, '--only', 'stale'], out=io.StringIO()); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'apache_beam', "
            "'torch', 'transformers')]; print(bad); assert not bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
