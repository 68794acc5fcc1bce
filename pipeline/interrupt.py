"""SIGINT during a prepare: Beam's runners wrap the KeyboardInterrupt it raises into errors
of their own, so `actx prepare` tells an interrupted run from a failed one by an event
that the signal sets, and exits 130 without a traceback."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def interruptible():
    """Yields an Event set by SIGINT. Beam's runners wrap the KeyboardInterrupt a SIGINT
    raises into their own errors ("RuntimeError: KeyboardInterrupt [while running ...]"),
    so the caller asks this event, not the exception's type, whether the user stopped it."""
    import signal
    import threading

    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    beam_log = logging.getLogger("apache_beam")
    beam_level = beam_log.level

    def on_sigint(signum, frame):
        interrupted.set()
        # Beam logs the interrupted bundle's traceback itself; the run is abandoned, and
        # one line says so.
        beam_log.setLevel(logging.CRITICAL + 1)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)
        beam_log.setLevel(beam_level)
