"""SIGINT and SIGTERM, one mechanism for every stage: both stop a command the same way.

A stop signal raises `Stopped` (a KeyboardInterrupt, so every path that already cleans up
after Ctrl-C cleans up after a SIGTERM too: temporary files, child processes, nothing
half-committed), and the command exits 128 + the signal's number (130 for SIGINT, 143 for
SIGTERM) with one line. Shared by `actx` (deploy.cli), prepare (pipeline.interrupt) and
the workers (workers.main), which is why it lives in schemas: it imports neither jax nor
Beam.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived. `hint`: what to do next (the command that resumes), set by
    whoever knows it on the way out."""

    def __init__(self, signum: int = signal.SIGINT, hint: str = ""):
        super().__init__(signal_name(signum))
        self.signum = signum
        self.hint = hint


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signum_of(error: BaseException) -> int:
    """The signal behind a KeyboardInterrupt (a plain one is SIGINT's)."""
    return getattr(error, "signum", signal.SIGINT)


def exit_code(signum: int) -> int:
    """128 + the signal's number, as a shell reports a process the signal ended."""
    return 128 + int(signum)


def raise_stopped(signum, frame):
    if safe_to_raise(frame):
        raise Stopped(signum)
    redeliver(signum)


def safe_to_raise(frame) -> bool:
    """False where an exception raised now would not reach the command's own handling:
    - inside a garbage-collector callback (JAX has one): Python ignores an exception
      raised there and prints its traceback ("Exception ignored in ..."), so the stop would
      be lost and the user would see a traceback;
    - inside an import (JAX's takes seconds): the exception can surface as another one
      (a RuntimeError from a class body's `__set_name__`) with a traceback, and it leaves
      the module half-imported;
    - inside a finalizer: a `__del__`, or the standard library's weak-reference code
      (WeakSet's and WeakValueDictionary's removal callbacks, weakref.finalize), which
      the collector runs at any point: Python ignores the exception there too (seen: a
      SIGTERM raised in WeakSet's callback was printed and dropped, and `actx status
      --serve` served on).
    The caller redelivers the signal, which comes back once out of there. (It imports
    nothing, nor does `redeliver`: an import in a handler that lands inside another
    import's module lock, Python 3.11's `_ModuleLock.acquire`, overwrites that import's
    entry of the locks' table, and the outer import fails with a KeyError.)"""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks} - {None}
    while frame is not None:
        code = frame.f_code
        if (code in callbacks or code.co_filename.startswith(_IMPORT_MACHINERY)
                or code.co_name == "__del__" or code.co_filename in _WEAKREF_FILES):
            return False
        frame = frame.f_back
    return True


def _weakref_files() -> frozenset:
    import _weakrefset
    import weakref

    return frozenset(m.__file__ for m in (_weakrefset, weakref))


_WEAKREF_FILES = _weakref_files()


# importlib's own frames, present on the stack for as long as any module is being imported
_IMPORT_MACHINERY = "<frozen importlib._bootstrap"


def redeliver(signum: int, after_s: float = 0.05) -> None:
    """Sends `signum` to this process again shortly, once out of the callback."""
    timer = threading.Timer(after_s, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def handled(handler=raise_stopped):
    """Installs `handler(signum, frame)` for SIGINT and SIGTERM for the block (in the main
    thread only: elsewhere Python cannot), restoring what was there after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Received:
    """Which stop signal came first (None: none yet), readable from any thread."""

    def __init__(self):
        self._event = threading.Event()
        self.signum: int | None = None

    def set(self, signum: int) -> None:
        if not self._event.is_set():
            self.signum = signum
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum or signal.SIGINT)

    @property
    def name(self) -> str:
        return signal_name(self.signum or signal.SIGINT)
