"""A worker told to stop, then sent the same signal again at once (Slurm's scancel signals
every process of the job step, and host_run forwards what it got to the worker it
supervises), keeps stopping at its step boundary: the repeat is the same notice, not a
second signal that ends the host at once without the replica's shutdown barrier (which
took a multi-host replica's other hosts down mid-stop: tests/test_slurm_real.py's
test_down_cancels_a_running_job). A signal after the window, or another signal, still
stops it at once.

Under Slurm the supervisor sends no copy at all (a copy delayed past the window on a loaded
host would end the host at once; that test still failed now and then after the window): the
worker gets the scheduler's one notice. A supervisor signalled alone (a TPU host's) still
passes it on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from actx.deploy.detached import host_run
from actx.schemas import stop_signals, store as store_lib
from actx.workers import main


class _Loop:
    def __init__(self):
        self.stop_requested = threading.Event()


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(main.time, "monotonic", lambda: now[0])
    return now


def _stopping(clock):
    handler, loop = main._StopSignals(), _Loop()
    handler.workers = [loop]
    handler.on_signal(signal.SIGTERM, None)
    assert loop.stop_requested.is_set() and handler.received.signum == signal.SIGTERM
    return handler


def test_the_same_signal_again_within_the_window_is_the_same_notice(clock):
    handler = _stopping(clock)
    clock[0] += main.ECHO_S / 2
    handler.on_signal(signal.SIGTERM, None)  # no Stopped: the loop goes on to its boundary
    assert handler.received.exit_code == 143


def test_the_same_signal_after_the_window_stops_at_once(clock):
    handler = _stopping(clock)
    clock[0] += main.ECHO_S
    with pytest.raises(stop_signals.Stopped):
        handler.on_signal(signal.SIGTERM, None)


def test_another_signal_stops_at_once(clock):
    handler = _stopping(clock)
    with pytest.raises(stop_signals.Stopped):
        handler.on_signal(signal.SIGINT, None)


def test_a_signal_while_starting_is_not_taken_for_an_echo(clock):
    """Before the loop runs, a signal raises (or comes back, redelivered, to raise): the
    window applies only once the loops were asked to stop."""
    handler = main._StopSignals()
    with pytest.raises(stop_signals.Stopped):
        handler.on_signal(signal.SIGTERM, None)
    with pytest.raises(stop_signals.Stopped):
        handler.on_signal(signal.SIGTERM, None)


# A stand-in worker: counts the SIGTERMs it gets until 2 s after the first (a forwarded copy
# comes within milliseconds), then says how many and exits 0.
_COUNTING_WORKER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(time.monotonic()))
open(sys.argv[1], "w").close()  # ready: the handler is in place
while not got or time.monotonic() - got[0] < 2.0:
    time.sleep(0.05)
print(f"SIGTERMs received: {len(got)}", flush=True)
"""


def _supervised(tmp_path, supervisor: list[str], signal_every_process: bool) -> str:
    """The log the supervisor copied into the run after one SIGTERM: sent to every process
    of its session, as Slurm signals a job step's, or to the supervisor alone, as a
    launcher that knows only its pid does."""
    run, ready = tmp_path / "run", tmp_path / "ready"
    run.mkdir()
    env = dict(os.environ, HOME=str(tmp_path), SLURM_PROCID="0", SLURM_NTASKS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", *supervisor, "--run", str(run), "--job", "j",
         "--log-every-s", "1", "--", sys.executable, "-c", _COUNTING_WORKER, str(ready)],
        env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        if signal_every_process:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (key,) = store_lib.open_store(str(run)).list("logs/j/")
    return store_lib.open_store(str(run)).read(key).decode()


def test_a_slurm_task_passes_no_copy_of_the_signal_slurm_sent_its_worker(tmp_path):
    """Slurm signals every process of the step: the task's supervisor stays (to copy the
    log to its end) and sends nothing, so the worker gets one notice, however late a
    forwarded copy would have come on a loaded host."""
    log = _supervised(tmp_path, ["actx.deploy.targets.slurm.step", "--name", "t",
                                 "--port", "1"], signal_every_process=True)
    assert "SIGTERMs received: 1\n[actx: worker exited with code 0]" in log, log


def test_a_tpu_hosts_supervisor_passes_its_signal_on(tmp_path):
    """A launcher that signals the supervisor alone: the worker still gets the notice."""
    log = _supervised(tmp_path, ["actx.deploy.host_run", "--host", "h0"],
                      signal_every_process=False)
    assert "SIGTERMs received: 1\n[actx: worker exited with code 0]" in log, log
