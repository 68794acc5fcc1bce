"""Fault injection for crash-safety tests: kill this process at a named point.

ACTX_CRASH_AT="point", "point:N", "point:N:TERM", "point:N:ABRT", "point:N:STOP" or
"point:N:RAISE" sends SIGKILL (or SIGTERM, a preemption notice; SIGABRT, an abort in native
code such as JAX's coordination service ending a host; SIGSTOP, a process frozen until a
SIGCONT; or raises RuntimeError: a bug) the N-th time (1-based,
default 1) the process reaches `point`. With ACTX_CRASH_PROCESS=i only the process of
jax.process_index() i does (one host of a multi-host replica). Points: "step" (after a step is dispatched), "write"
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
    name, nth, action = (spec.split(":") + ["", ""])[:3]
    if name != point:
        return
    only = os.environ.get("ACTX_CRASH_PROCESS")
    if only is not None:
        import jax

        if jax.process_index() != int(only):
            return
    _COUNTS[point] += 1
    if _COUNTS[point] != int(nth or 1):
        return
    if action == "RAISE":
        raise RuntimeError(f"injected failure at {point} (ACTX_CRASH_AT={spec})")
    os.kill(os.getpid(), {"TERM": signal.SIGTERM, "ABRT": signal.SIGABRT,
                          "STOP": signal.SIGSTOP}.get(action, signal.SIGKILL))
