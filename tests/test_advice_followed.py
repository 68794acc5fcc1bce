"""The advice actx prints after a failure, followed exactly as printed, finishes the run:
every command that `actx status`, the live page's data and the launcher name is parsed
from their output and run through the CLI's entry point; then the run is complete, and no
failure banner or rerun advice remains. Cases: a dead worker of a job whose replicas
share work (it had claimed partitions ahead, which read as pending), and a verify that
fails. (A Ctrl-C is followed in tests/test_terminal_story.py; a SIGKILLed worker under a
real launcher in tests/test_ops_dead_worker.py.) Real worker processes on a tiny random
Qwen2; the dead worker's traces are written as a killed worker leaves them."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from actx.deploy import cli, local
from actx.deploy.page import data as ui_data
from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.deploy.targets import local as local_target
from actx.schemas import commit, config as config_lib, heartbeat, layout, store
from actx.schemas import run_dir
from tests import hf_models, token_runs

COMMAND = re.compile(r"`(actx [^`]*)`")
DEAD_JOB, DEAD_HOST = "local-20260101-000000", "local-r1h0"


def _advice(text: str) -> set[str]:
    """The commands a text tells its reader to type, as they are written."""
    return set(COMMAND.findall(text))


def _follow(command: str) -> tuple[int, str]:
    """Runs a printed command exactly (its argv after `actx`) through the CLI."""
    out = io.StringIO()
    argv = shlex.split(command)
    assert argv[0] == "actx", command
    return cli.main(argv[1:], out=out), out.getvalue()


def _everything_said(run: str) -> tuple[str, dict]:
    """`actx status` as text and the page's data, of the run as it stands."""
    out = io.StringIO()
    assert cli.main(["status", run], out=out) == 0
    return out.getvalue(), ui_data.page_data(runstate.compute_status(run_dir.open_run(run)))


def _gone_pid() -> int:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid


@pytest.fixture
def run(tmp_path) -> str:
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    path = str(tmp_path / "run")
    token_runs.write_token_run(path, str(model), n_rows=32, seq_len=16, partition_rows=8,
                               rows_per_shard=4)  # 4 partitions
    return path


def _kill_a_stealing_worker(run: str) -> None:
    """What a SIGKILLed replica of a two-replica job leaves: its heartbeat still says
    working on p-00001 (its process gone) and holding p-00002, claimed ahead (it would
    have been next), and its launcher's record of the death (local.mark_dead)."""
    s = store.open_store(run)
    attempt = f"{DEAD_HOST}-{_gone_pid()}-dead0001"
    beat = heartbeat.Heartbeat(host=DEAD_HOST, replica=1, process_index=0, state="working",
                               attempt=attempt, updated_at=time.time(), partition=1, step=1,
                               steps=2, tokens_done=40, tokens_per_s=400.0, held=(1, 2),
                               machine=heartbeat.this_machine(),
                               pid=int(attempt.split("-")[-2]), job=DEAD_JOB)
    s.write_json(layout.heartbeat_key(DEAD_HOST), config_lib.to_dict(beat))
    for p in (1, 2):
        assert s.create_json(layout.claim_key(DEAD_JOB, p), {"attempt": attempt, "at": 0})
    assert local.mark_dead(run, DEAD_HOST, -9, None)


def test_a_dead_worker_with_claims_ahead_is_finished_by_what_every_view_advises(run):
    _kill_a_stealing_worker(run)
    status = runstate.compute_status(run_dir.open_run(run))
    assert status.phase == "failed"
    # What it held, the partition in hand and the one claimed ahead, is stale at once.
    assert status.partitions.named() == {"p-00000": "pending", "p-00001": "stale",
                                         "p-00002": "stale", "p-00003": "pending"}
    launcher = io.StringIO()
    assert local_target._rerun_hint(run_dir.open_run(run), status, None, launcher)
    text, page = _everything_said(run)
    [host] = page["hosts"]
    assert host["dead"] and "killed by SIGKILL" in host["message"]
    advised = (_advice(launcher.getvalue()) | _advice(text) | _advice(host["message"])
               | {c for c in page["commands"].values() if c.startswith("actx rerun")})
    # One command everywhere, and not `--only stale`: that would leave p-00000 and p-00003
    # pending and answer "nothing to do" on the next try.
    advised.discard(f"actx verify {run}")  # status's "verify: not run yet" line
    assert advised == {f"actx rerun {run}"}, advised

    code, said = _follow(f"actx rerun {run}")
    assert code == 0, said
    s = store.open_store(run)
    assert sorted(commit.committed_partitions(s, 4)) == [0, 1, 2, 3]

    # Finished: no failure banner, no advice to rerun, in status, --json or the page; the
    # dead host's record stays (what happened), without its command.
    text, page = _everything_said(run)
    assert "phase:      finished" in text and "actx rerun" not in text, text
    assert page["phase"] == "finished" and "rerun_all" not in page["commands"]
    assert not any(h["dead"] for h in page["hosts"])
    dead = next(h for h in page["hosts"] if h["host"] == DEAD_HOST)
    assert "killed by SIGKILL" in dead["message"] and "actx rerun" not in dead["message"]
    out = io.StringIO()
    assert cli.main(["status", run, "--json"], out=out) == 0
    assert "actx rerun" not in out.getvalue()


def test_a_failed_verify_is_finished_by_the_commands_it_prints(run):
    assert _follow(f"actx rerun {run}")[0] == 0
    # One stored chunk of p-00002's rows damaged on disk, as a bad disk would.
    chunk = _a_chunk_of(run, row_start=16)
    with open(chunk, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)
    code, said = _follow(f"actx verify {run}")
    assert code == 1 and "FAILED" in said
    text, page = _everything_said(run)
    assert "failed the latest `actx verify`" in text
    # verify -> verify --repair -> rerun -> verify: each printed by the one before.
    assert _advice(said) == {f"actx verify {run} --repair", f"actx rerun {run}"}, said
    repair = f"actx verify {run} --repair"
    code, said = _follow(repair)
    assert code == 1 and "REPAIRED: 1 partition(s)" in said, said
    [rerun] = [c for c in _advice(said) if c.startswith("actx rerun")]
    assert rerun == f"actx rerun {run}"
    text, _ = _everything_said(run)
    assert rerun in text  # status says the same now that p-00002 is pending
    assert _follow(rerun)[0] == 0
    code, said = _follow(f"actx verify {run}")
    assert code == 0 and "OK: every committed block matches its checksum" in said, said
    text, page = _everything_said(run)
    assert "phase:      finished" in text and "actx rerun" not in text
    assert page["verification"]["ok"] and "rerun_all" not in page["commands"]


def _a_chunk_of(run: str, row_start: int) -> str:
    """The file of the first hook's chunk that starts at `row_start`."""
    root = os.path.join(run, layout.ACTIVATIONS_GROUP)
    hook = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))[0]
    info = store.open_store(run).read_json(f"{layout.ACTIVATIONS_GROUP}/{hook}/zarr.json")
    chunk_rows = info["chunk_grid"]["configuration"]["chunk_shape"][0]
    path = os.path.join(root, hook, "c", str(row_start // chunk_rows), "0", "0")
    assert os.path.isfile(path), sorted(os.listdir(os.path.join(root, hook)))
    return path


def test_a_stop_signal_reads_as_stopped_not_failed(run):
    """A worker's loop ended by a stop signal records a stop (also a second signal that
    raises at once); a launcher's record after Ctrl-C turns an older worker's "failed ...
    Stopped: SIGTERM" into stopped too; status and the page then say stopped."""
    import signal

    from actx.schemas import stop_signals
    from actx.workers.loop import runner

    assert runner.ended_by(stop_signals.Stopped(signal.SIGTERM)) == {
        "state": "preempted", "message": "stopped by SIGTERM; nothing partial was committed"}
    assert runner.ended_by(KeyboardInterrupt())["state"] == "preempted"
    assert runner.ended_by(ValueError("x")) == {"state": "failed", "message": "ValueError: x"}

    s = store.open_store(run)
    old = heartbeat.Heartbeat(host="local-r0h0", replica=0, process_index=0, state="failed",
                              attempt="a", updated_at=time.time(), partition=0,
                              message="Stopped: SIGTERM", job="j")
    s.write_json(layout.heartbeat_key("local-r0h0"), config_lib.to_dict(old))
    assert local.mark_dead(run, "local-r0h0", -15, stopped_by_user=True)
    text, page = _everything_said(run)
    assert "phase:      stopped" in text and "failed" not in text.split("hosts")[1]
    assert [h["state"] for h in page["hosts"]] == ["stopped"]
    assert page["phase"] == "stopped" and not page["hosts"][0]["dead"]
    assert f"`actx rerun {run}` finishes" in text
    # A real failure stays a failure.
    s.write_json(layout.heartbeat_key("local-r0h0"), config_lib.to_dict(
        dataclasses.replace(old, message="RuntimeError: out of memory")))
    assert not local.mark_dead(run, "local-r0h0", -15, stopped_by_user=True)
    assert runstate.compute_status(run_dir.open_run(run)).phase == "failed"


def test_status_line_of_a_finished_run_keeps_no_advice(run):
    """Every partition committed (markers only): a failed host's advice is gone from the
    hosts' messages, the phase note and the page's commands."""
    _kill_a_stealing_worker(run)
    s = store.open_store(run)
    # What the workers write before any data; without it the markers would vouch for
    # activations that are gone (status then says failed, tests/test_run_removed.py).
    from actx.schemas import activations_info
    spec = run_dir.open_run(run).spec
    activations_info.create_info(s, activations_info.ActivationsInfo(
        spec.fingerprint, spec.capture.dtype, {"layers.0.resid_post": 8}))
    for p in range(4):
        s.create_json(layout.commit_key(p), {"partition": p})
    status = runstate.compute_status(run_dir.open_run(run))
    assert status.phase == "finished"
    [h] = status.hosts
    assert "killed by SIGKILL" in h.message and "actx rerun" not in h.message
    assert "actx rerun" not in status_text.render(status)
