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


def test_the_handler_imports_nothing():
    """A handler that imports (here once: `gc`, not imported at a process's start) and
    lands inside another import's `_ModuleLock.acquire` overwrites that import's entry of
    Python 3.11's lock table: the outer import then fails with a KeyError and a traceback
    (CI: SIGTERM during `actx verify`'s import of numpy). In a fresh process, the
    handler's checks and its redelivery import no module."""
    import subprocess

    code = (
        "import signal, sys, time\n"
        "from actx.schemas import stop_signals\n"
        "signal.signal(signal.SIGUSR1, lambda *a: None)\n"
        "before = set(sys.modules)\n"
        "stop_signals.safe_to_raise(sys._getframe())\n"
        "stop_signals.redeliver(signal.SIGUSR1, after_s=0.01)\n"
        "time.sleep(0.2)\n"
        "print(sorted(set(sys.modules) - before))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_a_signal_outside_an_import_raises_at_once():
    with stop_signals.handled():
        with pytest.raises(stop_signals.Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert stopped.value.signum == signal.SIGINT


@pytest.mark.parametrize("where", ["__del__", "weakref.finalize"])
def test_a_signal_inside_a_finalizer_stops_the_command_after_it(where):
    """Python prints and drops an exception raised in a finalizer (a `__del__`, the
    standard library's weak-reference callbacks); `actx status --serve` once served on
    after a SIGTERM raised in WeakSet's removal callback. Held back, the signal comes
    back once out of there."""
    import weakref

    def signal_then_wait():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)  # the handler runs here, inside the finalizer

    class Dying:
        def __del__(self):
            signal_then_wait()

    class Plain:
        pass

    with stop_signals.handled():
        with pytest.raises(stop_signals.Stopped) as stopped:
            if where == "__del__":
                Dying()
            else:
                thing = Plain()
                weakref.finalize(thing, signal_then_wait)
                del thing
            time.sleep(5)  # the redelivered signal lands here
    assert stopped.value.signum == signal.SIGTERM
