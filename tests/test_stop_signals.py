"""schemas.stop_signals: a stop signal that lands somewhere an exception would not reach
the command's handling (an import, a garbage-collector callback) is held back and comes
back once out of there, so the command still stops with its one line."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time

import pytest

from actx.schemas import stop_signals


def test_a_signal_during_an_import_stops_the_command_after_the_import(tmp_path, monkeypatch):
    # The class body runs while the signal is pending: raised there, Python 3.11 would
    # wrap Stopped in a RuntimeError from __set_name__ (what CI once saw in `import jax`).
    (tmp_path / "slow_to_import.py").write_text(
        "import functools, os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "class Sharding:\n"
        "    time.sleep(0.3)\n"
        "    @functools.cached_property\n"
        "    def devices(self):\n"
        "        return 1\n"
        "COMPLETE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_to_import", raising=False)
    with stop_signals.handled():
        with pytest.raises(stop_signals.Stopped) as stopped:
            importlib.import_module("slow_to_import")
            time.sleep(5)  # the redelivered signal lands here, out of the import
    assert stopped.value.signum == signal.SIGTERM
    assert sys.modules["slow_to_import"].COMPLETE  # not left half-imported


def test_a_signal_outside_an_import_raises_at_once():
    with stop_signals.handled():
        with pytest.raises(stop_signals.Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert stopped.value.signum == signal.SIGINT
