"""A worker killed under `actx`'s local target (SIGKILL: no last heartbeat) is shown dead
at once, its partition is stale without waiting for the heartbeat to age, the command
says what to type, that command, typed exactly, finishes the run (and then no advice is
left), and status reports elapsed time and throughput during and after the run. Real
worker processes on a tiny random Qwen2."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from actx.deploy import cli
from actx.deploy.page import data as ui_data
from actx.deploy.status import runstate
from actx.schemas import commit, layout, store
from actx.schemas import run_dir
from tests import hf_models, token_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "local-r0h0"


def _status(run, *flags):
    out = io.StringIO()
    code = cli.main(["status", run, *flags], out=out)
    return code, out.getvalue()


def _stop_in_partition(s, proc) -> tuple[int, int]:
    """SIGSTOPs the worker while its heartbeat holds a partition without a commit and the
    next one claimed (its prefetch reaches that in the partition's last steps); returns
    (worker pid, the partition in hand). The stopped process cannot commit it any more."""
    path = os.path.join(str(s.location), layout.heartbeat_key(HOST))
    seen = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:  # a new beat names the partition in hand as it is written: be quick
            stamp = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            stamp = None
        beat = s.read_json(layout.heartbeat_key(HOST)) if stamp != seen else None
        seen = stamp
        # Past its first tokens, so status has a throughput to show.
        if (beat and beat["state"] == "working" and beat["partition"] is not None
                and beat["tokens_done"] > 0 and len(beat["held"]) > 1):
            pid = int(beat["attempt"].split("-")[-2])  # "<host>-<pid>-<random>"
            os.kill(pid, signal.SIGSTOP)
            beat = s.read_json(layout.heartbeat_key(HOST))  # final: the process is frozen
            held = beat["partition"]
            if (held is not None and beat["tokens_done"] > 0
                    and not s.exists(layout.commit_key(held))
                    and len(beat["held"]) > 1):
                return pid, held
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)
    raise AssertionError(f"never caught the worker inside a partition: {proc.communicate()}")


def test_killed_worker_is_dead_at_once_and_its_partition_reruns(tmp_path):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=2)
    run = str(tmp_path / "run")
    # 24 partitions of 8k tokens: about 0.4 s each here (2 shared cores), so a beat,
    # seen within milliseconds, finds the worker well inside one.
    token_runs.write_token_run(run, str(model), n_rows=1536, seq_len=128, partition_rows=64,
                               rows_per_shard=8)
    s = store.open_store(run)
    cfg = tmp_path / "t.yaml"
    cfg.write_text("target:\n  heartbeat_s: 1\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "actx.deploy.cli", "rerun", run, "--config", str(cfg), "--hosts",
         "1", "--batch-size", "8", "--job", "killed"], cwd=REPO, text=True,
        env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    pid, held = _stop_in_partition(s, proc)
    during = _status(run, "--json")[1]
    os.kill(pid, signal.SIGKILL)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, text
    assert f"worker {HOST} (pid {pid}) failed (killed by SIGKILL)" in text
    assert f"`actx rerun {run}` redoes them" in text and "--only stale" not in text
    assert "killed by SIGKILL" in text  # submit's final status shows it dead
    launcher_says = re.findall(r"`(actx rerun [^`]*)`", text)

    # While the worker was in hand, status showed it working with a throughput.
    st = json.loads(during)
    [host] = st["hosts"]
    assert host["live"] and st["partitions"][layout.partition_name(held)] == "in_progress"
    assert st["elapsed_s"] > 0 and st["average_tokens_per_s"] > 0

    # At once (its heartbeat is seconds old, the stale threshold 60 s): dead, and stale.
    code, out = _status(run, "--json", "--check")
    st = json.loads(out)
    assert code == 1  # incomplete
    [host] = st["hosts"]
    assert host["state"] == "failed" and not host["live"] and host["age_s"] < 60
    # The launcher's record of the death names the run as the user typed it, and the
    # command that finishes it: not `--only stale`, which would leave the partitions after
    # the dead one pending.
    assert f"`actx rerun {run}` finishes the run" in host["message"], host
    # Stale: the partition in hand and those it had claimed ahead (its heartbeat's
    # `held`, the prefetch's), not pending as if nobody had them.
    beat = s.read_json(layout.heartbeat_key(HOST))
    assert held in beat["held"] and len(beat["held"]) > 1, beat["held"]
    assert st["partitions"][layout.partition_name(held)] == "stale"
    # The beat was written before the process stopped: a partition it held may have been
    # committed since (the writers finish one while the next computes), and is then done.
    committed = commit.committed_partitions(s, 24)
    assert sorted(p for p, v in st["partitions"].items() if v == "stale") == sorted(
        layout.partition_name(p) for p in beat["held"] if p not in committed)
    assert "pending" in st["partitions"].values()  # the work the dead worker never reached
    page = ui_data.page_commands(runstate.compute_status(run_dir.open_run(run)))
    advised = {*launcher_says, *re.findall(r"`(actx rerun [^`]*)`", host["message"]),
               *(c for c in page.values() if c.startswith("actx rerun"))}
    assert advised == {f"actx rerun {run}"}, advised

    # Typed exactly as printed, it finishes the run.
    [command] = advised
    out = io.StringIO()
    t0 = time.time()
    assert cli.main(shlex.split(command)[1:], out=out) == 0, out.getvalue()
    wall_s = time.time() - t0
    assert commit.read_marker(s, held) is not None

    # After the run: complete; no live worker, so 0 now, but elapsed and average of that
    # attempt; no failure and no rerun advice left anywhere.
    code, out = _status(run, "--json", "--check")
    st = json.loads(out)
    assert code == 0 and st["complete"] and st["phase"] == "finished", st
    assert st["current_tokens_per_s"] == 0
    assert not any("actx rerun" in h["message"] for h in st["hosts"]), st["hosts"]
    data = ui_data.page_data(runstate.compute_status(run_dir.open_run(run)))
    assert not any(h["dead"] for h in data["hosts"]) and "rerun_all" not in data["commands"]
    assert "actx rerun" not in _status(run)[1]
    beat = s.read_json(layout.heartbeat_key(HOST))
    mine = [commit.read_marker(s, p) for p in commit.committed_partitions(s, 24)]
    tokens = sum(m.tokens for m in mine if m.attempt == beat["attempt"])
    assert tokens == beat["tokens_done"] > 0  # the heartbeat counts what it committed
    assert 0 < st["elapsed_s"] <= wall_s
    assert abs(st["average_tokens_per_s"] * st["elapsed_s"] - tokens) <= 0.1 * st[
        "elapsed_s"] + 0.05 * st["average_tokens_per_s"] + 1
    text = _status(run)[1]
    assert (f"throughput: finished; average {st['average_tokens_per_s']:,.0f} tokens/s "
            f"over" in text)


def test_check_exits_1_until_every_partition_is_committed(tmp_path):
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, "unused-model", n_rows=24, seq_len=16, partition_rows=8,
                               rows_per_shard=4)  # 3 partitions
    s = store.open_store(run)
    for p in range(3):
        assert _status(run, "--check")[0] == 1
        assert _status(run, "--check", "--json")[0] == 1
        s.create_json(layout.commit_key(p), {"partition": p})
    assert _status(run, "--check")[0] == 0
    assert _status(run)[0] == 0  # without --check an incomplete run is no error


def test_current_rate_is_the_latest_interval_and_average_spans_the_run(tmp_path):
    """Two hosts' heartbeats with known histories: one live, one finished."""
    from actx.schemas import config as config_lib, heartbeat

    run = str(tmp_path / "run")
    token_runs.write_token_run(run, "unused-model", n_rows=24, seq_len=16, partition_rows=8,
                               rows_per_shard=4)
    s = store.open_store(run)
    now = time.time()
    t0 = now - 100
    beats = [("a", "working", ((t0, 0), (t0 + 90, 9000), (now - 2, 9400))),  # 50 tok/s now
             ("b", "done", ((t0 + 10, 0), (t0 + 50, 4000)))]
    for host, state, history in beats:
        hb = heartbeat.Heartbeat(host=host, replica=0, process_index=0, state=state,
                                 attempt=f"{host}-1-x", updated_at=history[-1][0],
                                 tokens_done=history[-1][1], tokens_per_s=99.0,
                                 partition=0 if state == "working" else None, history=history)
        s.write_json(layout.heartbeat_key(host), config_lib.to_dict(hb))
    st = json.loads(_status(run, "--json")[1])
    assert st["current_tokens_per_s"] == 50.0  # (9400 - 9000) / 8 s; b is done
    assert 100 <= st["elapsed_s"] <= 100 + (time.time() - now) + 0.1
    assert abs(st["average_tokens_per_s"] - 13400 / st["elapsed_s"]) <= 0.1
    assert st["tokens_per_s"] == 99.0  # the heartbeats' own rates, for the ETA


def test_a_gone_process_on_this_machine_is_dead_at_once(tmp_path):
    """No launcher saw it die (started by hand, or the launcher died too): its fresh
    heartbeat still says working, but its process is gone from this machine."""
    from actx.schemas import config as config_lib, heartbeat

    run = str(tmp_path / "run")
    token_runs.write_token_run(run, "unused-model", n_rows=24, seq_len=16, partition_rows=8,
                               rows_per_shard=4)
    s = store.open_store(run)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    here = heartbeat.this_machine()
    for host, partition, pid, machine in (("gone", 0, ended.pid, here),
                                          ("alive", 1, os.getpid(), here),
                                          ("elsewhere", 2, ended.pid, "other-host/boot")):
        hb = heartbeat.Heartbeat(host=host, replica=0, process_index=0, state="working",
                                 attempt=f"{host}-{pid}-x", updated_at=time.time(),
                                 partition=partition, machine=machine, pid=pid)
        s.write_json(layout.heartbeat_key(host), config_lib.to_dict(hb))
    st = json.loads(_status(run, "--json")[1])
    hosts = {h["host"]: h for h in st["hosts"]}
    assert hosts["gone"]["state"] == "working (process gone)" and not hosts["gone"]["live"]
    assert hosts["alive"]["live"] and hosts["elsewhere"]["live"]  # no way to tell elsewhere
    assert st["partitions"] == {"p-00000": "stale", "p-00001": "in_progress",
                                "p-00002": "in_progress"}


def test_heartbeats_name_their_process(tmp_path):
    from actx.schemas import heartbeat
    from actx.workers.loop import progress

    s = store.open_store(str(tmp_path))
    beats = progress.HeartbeatThread(s, "h", 0, 0, "h-1-x", progress.Progress(), 60.0)
    beats.beat(force=True)
    [hb] = heartbeat.read_heartbeats(s)
    assert (hb.machine, hb.pid) == (heartbeat.this_machine(), os.getpid())
    assert not heartbeat.process_gone(hb)


def test_a_hosts_first_claim_is_named_at_once_and_later_ones_at_the_interval(tmp_path):
    """The first partition a process claims is written into its heartbeat at once (it holds
    the owner's longest chains: a host dying before its next beat would leave it to the
    run's tail); later claims wait for the interval; a stopped thread writes no more."""
    from actx.schemas import heartbeat
    from actx.workers.loop import progress

    s = store.open_store(str(tmp_path))
    p = progress.Progress()
    beats = progress.HeartbeatThread(s, "h", 0, 0, "h-1-x", p, interval_s=3600.0)
    beats.start()

    def held():
        [hb] = heartbeat.read_heartbeats(s)
        return hb.held

    assert held() == ()
    p.hold(7)
    assert held() == (7,)
    p.hold(8)
    assert held() == (7,)  # not before the interval
    beats.stop()
    assert held() == (7, 8) and p.beat_now is None
    again = progress.HeartbeatThread(s, "h", 0, 0, "h-1-x", p, interval_s=3600.0)
    again.start()
    p.hold(9)  # this process named a claim already: no write out of turn
    assert held() == (7, 8)
    again.stop(final_beat=False)


def _taker_done_or_stalled(taker, s, n_partitions: int, stall_s: float = 10.0) -> set[int]:
    """Waits until `taker` exits, or commits nothing for `stall_s` (it waits on a write the
    frozen worker holds: a local store's file lock); returns the partitions committed."""
    committed, since = commit.committed_partitions(s, n_partitions), time.monotonic()
    while taker.poll() is None and time.monotonic() - since < stall_s:
        time.sleep(0.2)
        now = commit.committed_partitions(s, n_partitions)
        if now != committed:
            committed, since = now, time.monotonic()
    return commit.committed_partitions(s, n_partitions)


def test_a_frozen_worker_resumed_writes_nothing_over_a_takers_partitions(tmp_path):
    """A worker frozen (SIGSTOP) inside a partition while another job's worker extracts
    the whole run, its partitions in hand included: resumed (SIGCONT), the frozen one
    finds its heartbeats were silent long enough to look dead, and writes no row of a
    partition the taker committed meanwhile (neither the steps after the freeze nor a
    block it had queued), commits none, and exits 0; the run verifies. (Where the taker
    waits on a write the frozen worker held, a local file lock, it finishes after the
    resume, and only what it had not committed by then may be written by both.)"""
    from tests import worker_procs

    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=2)
    run = str(tmp_path / "run")
    rows_per_partition, rows_per_shard = 64, 8
    # 48 partitions: about 5 s of extraction here, for beats that catch it inside one.
    token_runs.write_token_run(run, str(model), n_rows=3072, seq_len=128,
                               partition_rows=rows_per_partition, rows_per_shard=rows_per_shard)
    s = store.open_store(run)
    log = tmp_path / "writes.log"
    frozen = worker_procs.start_worker(
        ["--run", run, "--batch-size", "8", "--job", "first", "--host-name", HOST,
         "--heartbeat-s", "1"], ACTX_WRITE_LOG=str(log))
    pid, held = _stop_in_partition(s, frozen)
    taker = None
    try:
        written_before = len(log.read_text().splitlines())
        asked = tmp_path / "writes.log.asked"  # what the fence let through before the freeze
        asked_before = set(asked.read_text().splitlines()) if asked.exists() else set()
        taker = worker_procs.start_worker(
            ["--run", run, "--batch-size", "8", "--job", "taker", "--host-name", "taker"])
        committed_at_resume = _taker_done_or_stalled(taker, s, 48)
    finally:
        os.kill(pid, signal.SIGCONT)
        code, out = worker_procs.finish(taker) if taker else (None, "")
    assert code == 0, out
    code, out = worker_procs.finish(frozen, timeout=120)
    assert code == 0, out
    assert commit.committed_partitions(s, 48) == set(range(48))
    # A writer thread frozen between the fence's answer and its write writes once resumed
    # (the window is kept short, not closed): only writes asked about after it count.
    after = [line.split(" ", 1)[1] for line in log.read_text().splitlines()[written_before:]
             if line.startswith(f"{pid} ") and line not in asked_before]
    rows = {int(key.rsplit("/", 3)[-3]) * rows_per_shard for key in after}
    assert not {r // rows_per_partition for r in rows} & committed_at_resume, (after, out)
    if committed_at_resume == set(range(48)):  # the taker was not held up: all its own
        assert after == [], after
        assert re.search(r"were taken over meanwhile|is not committed by this process|"
                         r"already committed by attempt taker-", out), out
        assert commit.read_marker(s, held).attempt.startswith("taker-")
    out = io.StringIO()
    assert cli.main(["verify", run], out=out) == 0, out.getvalue()
