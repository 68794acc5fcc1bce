"""What the terminal says while a job starts and when it is stopped: a real local worker
process reports its start-up phase in its heartbeat before any token, `actx status` and
submit's progress line name it, and Ctrl-C (SIGINT) in the launcher says what was kept and
the command that resumes."""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import pytest

from actx.deploy import config as deploy_config
from actx.deploy import demo, local
from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.schemas import run_dir
from actx.schemas import stop_signals, store
from tests import token_runs


def test_sigint_while_workers_start_says_what_was_kept(tmp_path):
    model = demo.make_tiny_qwen2(str(tmp_path / "model"), num_layers=1, vocab_size=512)
    run = str(tmp_path / "run")
    spec = token_runs.write_token_run(run, model, n_rows=32, seq_len=16, partition_rows=8,
                                      rows_per_shard=4)
    s = store.open_store(run)
    seen: dict = {}

    def interrupt_once_a_worker_beats():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            beats = [s.read_json(k) for k in s.list("workers/")]
            if beats and beats[0]:
                seen["beat"] = beats[0]
                seen["line"] = status_text.one_line(runstate.compute_status(run_dir.open_run(run)))
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in the launcher's terminal

    out = io.StringIO()
    watcher = threading.Thread(target=interrupt_once_a_worker_beats, daemon=True)
    watcher.start()
    # As `actx` runs its commands (deploy/cli.py): under its stop-signal handler, which
    # raises where Python's default one can lose the interrupt (inside a garbage-collector
    # callback: JAX has one, and this process may have imported JAX for earlier tests).
    with pytest.raises(KeyboardInterrupt), stop_signals.handled():
        local.run_workers(run, deploy_config.TargetConfig(hosts=1, batch_size=8),
                          spec.fingerprint, "job1", progress_s=0.2, out=out)
    watcher.join(timeout=10)
    # The first heartbeat came before any token: a worker starting, saying what it does.
    beat = seen["beat"]
    assert beat["state"] == "starting" and beat["tokens_done"] == 0, beat
    assert beat["message"].startswith(("loading the model", "loading weights")), beat
    assert f"starting: local-r0h0 {beat['message']}" in seen["line"]
    assert "0 of 0" not in seen["line"] and "tok/s" not in seen["line"]
    text = out.getvalue()
    committed = len(s.list("commits/"))
    assert (f"extract: stopped; {committed} of 4 partition(s) are committed and kept in "
            f"{run}, nothing partial was committed. `actx rerun {run}` extracts the rest"
            in text), text
    # Status then reads "stopped", not "failed": the launcher stopped its worker.
    status = runstate.compute_status(run_dir.open_run(run))
    assert status.phase == "stopped", status.hosts
    assert [h.state for h in status.hosts] == ["stopped"]
    # Said by the worker (its stop handler caught the signal while it started) or, when
    # it could not say it, by the launcher.
    assert status.hosts[0].message.startswith(
        ("stopped by Ctrl-C", "interrupted while starting")), status.hosts[0].message
    # What it says to type, typed exactly, finishes the run; then it reads finished.
    import re
    import shlex

    from actx.deploy import cli

    [command] = set(re.findall(r"`(actx [^`]*)`", text))
    assert command == f"actx rerun {run}"
    assert cli.main(shlex.split(command)[1:], out=io.StringIO()) == 0
    status = runstate.compute_status(run_dir.open_run(run))
    assert status.complete and status.phase == "finished"
    assert not any("actx rerun" in h.message for h in status.hosts)


def test_a_stop_after_every_partition_committed_says_nothing_is_left(tmp_path):
    """Stopped once the last partition had committed, the launcher's line says the run
    has nothing left to extract, and names the check, not a rerun that would do nothing
    (one partition pending: the rerun, as before)."""
    from tests import reader_fixtures

    done = str(tmp_path / "done")
    reader_fixtures.build_run(done, num_partitions=3, committed=(0, 1, 2))
    line = local._kept_line(run_dir.RunDir.at(done))
    assert line == (f"extract: stopped after every partition had committed (3 of 3 "
                    f"partition(s) are committed and kept in {done}): nothing is left to "
                    f"extract; `actx verify {done}` checks the data"), line
    behind = str(tmp_path / "behind")
    reader_fixtures.build_run(behind, num_partitions=3, committed=(0, 1))
    assert local._kept_line(run_dir.RunDir.at(behind)).endswith(
        f"`actx rerun {behind}` extracts the rest")
