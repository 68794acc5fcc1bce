"""Fault injection for crash-safety tests: kill this process at a named point.

ACTX_CRASH_AT="point", "point:N" or "point:N:TERM" sends SIGKILL (or SIGTERM, a
preemption notice) to the process the N-th time (1-based, default 1) it reaches `point`. Points: "step" (after a step is dispatched), "write"
(between the writes of one block's arrays), "before_commit" (all data durable, marker not
yet written). Unset in production, where `maybe_crash` is a dictionary lookup.
"""

from __future__ import annotations

import collections
import os
import signal

_COUNTS: collections.Counter = collections.Counter()


def enabled() -> bool:
    """Whether a crash point is armed (hot paths skip crash-only synchronisation if not)."""
    return bool(os.environ.get("ACTX_CRASH_AT"))


def maybe_crash(point: str) -> None:
    spec = os.environ.get("ACTX_CRASH_AT")
    if not spec:
        return
    name, nth, sig = (spec.split(":") + ["", ""])[:3]
    if name != point:
        return
    _COUNTS[point] += 1
    if _COUNTS[point] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGTERM if sig == "TERM" else signal.SIGKILL)
