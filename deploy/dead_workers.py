"""Worker processes that died (SIGKILL, the out-of-memory killer) noticed by the launcher
that started them, whatever ran them (`actx extract` children, the processes of Beam's
local runners, which are not the launcher's children and whose exit status it never
sees): a heartbeat of the launcher's job that still says "working" but whose process is
gone from this machine (local launchers start their workers here; status, anywhere, calls
a silent heartbeat stale after its interval, and its held partitions with it).

A launcher that finds one stops its job with one line naming the process and the command
that finishes the run, instead of waiting for a runner that waits forever for it.
"""

from __future__ import annotations

import time

from actx.deploy.status.runstate import LIVE_STATES
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import layout as layout_lib


def holds_work(hb: heartbeat_lib.Heartbeat) -> bool:
    return bool(hb.held) or hb.partition is not None


def find(store, job: str, gone_since: dict[str, float], grace_s: float,
         now: float | None = None) -> list[heartbeat_lib.Heartbeat]:
    """The job's worker processes that are dead: gone while holding partitions, or gone
    for `grace_s` while holding none (a runner that ends its workers normally ends itself
    within that). `gone_since` (host -> first seen gone) is the caller's memory between
    calls. Silence alone is no death here: a process loading its model does not beat."""
    now = time.time() if now is None else now
    dead = []
    for hb in heartbeat_lib.read_heartbeats(store, history=False):
        if hb.job != job or hb.state not in LIVE_STATES:
            continue
        if not heartbeat_lib.process_gone(hb):
            gone_since.pop(hb.host, None)
            continue
        first = gone_since.setdefault(hb.host, now)
        if holds_work(hb) or now - first >= grace_s:
            dead.append(hb)
    return dead


def describe(hb: heartbeat_lib.Heartbeat, now: float | None = None) -> str:
    """'beam-host-123 (pid 123, holding p-00001, p-00002)'."""
    now = time.time() if now is None else now
    held = sorted(set(hb.held) | ({hb.partition} if hb.partition is not None else set()))
    what = (f"holding {', '.join(layout_lib.partition_name(p) for p in held[:10])}"
            f"{' ...' if len(held) > 10 else ''}" if held else "holding no partition")
    return (f"{hb.host} (pid {hb.pid or '?'}, {what}; last heartbeat "
            f"{now - hb.updated_at:.0f} s ago)")
