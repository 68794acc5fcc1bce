"""SIGINT or SIGTERM during a prepare: Beam's runners wrap the KeyboardInterrupt it raises
into errors of their own, so `actx prepare` tells an interrupted run from a failed one by
what the signal recorded, and exits 128 + the signal's number without a traceback."""

from __future__ import annotations

import contextlib
import logging

from actx.schemas import stop_signals


@contextlib.contextmanager
def interruptible():
    """Yields a `stop_signals.Received` set by SIGINT or SIGTERM. Beam's runners wrap the
    KeyboardInterrupt a signal raises into their own errors ("RuntimeError:
    KeyboardInterrupt [while running ...]"), so the caller asks this, not the exception's
    type, whether the user stopped it, and which signal did."""
    interrupted = stop_signals.Received()
    beam_log = logging.getLogger("apache_beam")
    beam_level = beam_log.level

    def on_signal(signum, frame):
        interrupted.set(signum)
        # Beam logs the interrupted bundle's traceback itself; the run is abandoned, and
        # one line says so.
        beam_log.setLevel(logging.CRITICAL + 1)
        stop_signals.raise_stopped(signum, frame)

    try:
        with stop_signals.handled(on_signal):
            yield interrupted
    finally:
        beam_log.setLevel(beam_level)
