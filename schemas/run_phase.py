"""A run's phase in one word, and what each phase advises, from its heartbeats.

`actx status` (deploy.status.run_facts, runstate) and a reader that follows a live run
(reader.streaming.follow) both say where a run stands: this module is what they share,
so the follower quotes the same phase and the same advice status prints. It reads
heartbeats (schemas.heartbeat), nothing of deploy/.
"""

from __future__ import annotations

import dataclasses
import time

from actx.schemas import advice
from actx.schemas import heartbeat as heartbeat_lib

NOT_STARTED, STARTING, RUNNING, FINISHED, STOPPED, FAILED = (
    "not started", "starting", "running", "finished", "stopped", "failed")
# What each phase means, for the page and the text status.
PHASE_NOTES = {
    NOT_STARTED: "prepared; no worker has reported yet",
    STARTING: "workers are loading the model or compiling; throughput follows",
    RUNNING: "workers are extracting",
    FINISHED: "every partition is committed",
    STOPPED: "no live worker and partitions left: `{rerun}` finishes them",
    FAILED: "a worker failed (its reason is in the hosts table): `{rerun}` after a fix",
}
# A heartbeat older than this, in a live state, is a dead worker's (status's default).
DEFAULT_STALE_AFTER_S = 60.0
LIVE_STATES = ("starting", "working", "idle")  # a heartbeat in these states claims a live worker


def phase_note(phase: str, run: str) -> str:
    """What the phase means, with the command that finishes the run as typed (`actx rerun`
    alone would not run: it needs the run)."""
    return PHASE_NOTES[phase].format(rerun=advice.rerun(run))


def phase(complete: bool, hosts) -> str:
    """One word for the run: finished beats everything; a live worker makes it running
    (starting while no live worker has processed a token yet); without one, a failed
    or refused worker makes it failed, any other heartbeat stopped, none at all not
    started.
    `hosts`: objects with .live, .state and .tokens_done (status's HostState, `Host`)."""
    if complete:
        return FINISHED
    live = [h for h in hosts if h.live]
    if live:
        return RUNNING if any(h.tokens_done > 0 for h in live) else STARTING
    if any(h.state.startswith(("failed", "refused")) or "process gone" in h.state
           for h in hosts):
        return FAILED
    return STOPPED if hosts else NOT_STARTED


@dataclasses.dataclass(frozen=True)
class Host:
    """One host as its heartbeat shows it at a time: state as status shows it ("working
    (stale)", "working (process gone)", "failed", ...), live or not, and its message."""

    host: str
    state: str
    live: bool
    tokens_done: int
    message: str
    age_s: float


def host_of(hb: heartbeat_lib.Heartbeat, now: float,
            stale_after_s: float = DEFAULT_STALE_AFTER_S) -> Host:
    """What status says of one heartbeat: live while it beats in a live state and its
    process (where this machine can tell) is there."""
    age = max(0.0, now - hb.updated_at)
    gone = hb.state in LIVE_STATES and heartbeat_lib.process_gone(hb)
    live = (hb.state in LIVE_STATES and not heartbeat_lib.is_stale(hb, now, stale_after_s)
            and not gone)
    state = ("stopped" if hb.state == "preempted" else hb.state) if (
        live or hb.state not in LIVE_STATES) else (
        f"{hb.state} (process gone)" if gone else f"{hb.state} (stale)")
    return Host(hb.host, state, live, hb.tokens_done, hb.message, round(age, 1))


@dataclasses.dataclass(frozen=True)
class RunPhase:
    """Where a run stands: its phase, the hosts not live (dead: stale, gone, failed,
    stopped; a host that is done is not dead) and the advice status gives."""

    phase: str
    dead: tuple[Host, ...]
    advice: str

    def words(self) -> str:
        """One line: the phase, the dead hosts and why, and the advice."""
        dead = "; ".join(f"{h.host} {h.state}" + (f" ({h.message})" if h.message else "")
                         for h in self.dead)
        return (f"phase {self.phase}" + (f"; dead hosts: {dead}" if dead else "")
                + f"; status says: {self.advice}")


def read_phase(store, complete: bool, stale_after_s: float = DEFAULT_STALE_AFTER_S,
               now: float | None = None) -> RunPhase:
    """The run's phase from its heartbeats: one listing on GCS (their summaries), a
    listing and a read per host on local disk."""
    beats = heartbeat_lib.read_heartbeats(store, history=False)
    now = time.time() if now is None else now
    hosts = [host_of(hb, now, stale_after_s) for hb in sorted(beats, key=lambda b: b.host)]
    word = phase(complete, hosts)
    dead = tuple(h for h in hosts if not h.live and h.state != "done")
    return RunPhase(word, dead, phase_note(word, str(store.location)))
