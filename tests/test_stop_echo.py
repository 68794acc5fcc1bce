"""A worker told to stop, then sent the same signal again at once (Slurm's scancel signals
every process of the job step, and host_run forwards what it got to the worker it
supervises), keeps stopping at its step boundary: the repeat is the same notice, not a
second signal that ends the host at once without the replica's shutdown barrier (which
took a multi-host replica's other hosts down mid-stop: tests/test_slurm_real.py's
test_down_cancels_a_running_job). A signal after the window, or another signal, still
stops it at once."""

from __future__ import annotations

import signal
import threading

import pytest

from actx.schemas import stop_signals
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
