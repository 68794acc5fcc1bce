"""The run's metadata that every host would write (activations/actx.json, each array's
zarr.json) is written by one process, process 0 of replica 0; the others wait for it and
read it. One name then takes one write, not one per host (a 1,024-host pod's creates on
one name in the same minute: GCS allows one write a second per name).

The wait is bounded, its polls spaced out (`poll_delays_s`), and a wait that runs out
names the object, who writes it and what to do.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Iterator

from actx.schemas import advice
from actx.schemas import heartbeat as heartbeat_lib
from actx.workers.replicas import choice_policy

# How long a host waits for process 0 of replica 0 to write the metadata: that process
# loads the model too before it writes (20-90 s on a pod), and may start later.
WAIT_S = 900.0
# Seconds between looks while waiting: from 1 s, doubling to at most 10 s (1,024 hosts
# waiting read one name ~100 times a second at worst).
FIRST_POLL_S, LAST_POLL_S = 1.0, 10.0


class MetadataNotWritten(RuntimeError):
    """The process that writes the run's metadata did not write it in time."""


def writes_metadata(replica: int, host_index: int) -> bool:
    """Whether this process writes the run's metadata: process 0 of replica 0."""
    return replica == 0 and host_index == 0


def poll_delays_s(rng: random.Random) -> Iterator[float]:
    """Seconds to sleep between looks: doubling from FIRST_POLL_S to LAST_POLL_S, each
    less up to a quarter at random, so hosts that began together do not look together."""
    delay = FIRST_POLL_S
    while True:
        yield delay * (1.0 - 0.25 * rng.random())
        delay = min(LAST_POLL_S, delay * 2)


def wait_for(look: Callable[[], object], where: str, run: str, wait_s: float = WAIT_S,
             writer_gone: Callable[[], str | None] = lambda: None,
             sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> object:
    """`look()`'s first answer that is not None, asked until `wait_s` has passed;
    MetadataNotWritten naming `where` (the object) and `run` after that, or as soon as
    `writer_gone()` says why the writing process will not write it."""
    deadline = clock() + wait_s
    delays = poll_delays_s(random.Random())
    while True:
        found = look()
        if found is not None:
            return found
        gone = writer_gone()
        if gone:
            # A launcher's record of the death already ends with the rerun: said once.
            then = ("" if f"`{advice.rerun(run)}`" in gone else
                    f". See `{advice.status(run)}`, then run `{advice.rerun(run)}`")
            raise MetadataNotWritten(
                f"{where}: not written, and process 0 of replica 0, which writes it, will not: "
                f"{gone}{then}")
        if clock() >= deadline:
            raise MetadataNotWritten(
                f"{where}: not written after {wait_s:.0f}s of waiting; process 0 of replica 0 "
                f"writes it once its model is loaded, and the other hosts wait for it. Look at "
                f"that host (`{advice.status(run)}` names its state and its log), then run "
                f"`{advice.rerun(run)}`")
        sleep(min(next(delays), max(0.0, deadline - clock())))


def writer_gone(store, job: str, since: float) -> str | None:
    """Why process 0 of replica 0 of `job` will not write the run's metadata: it failed,
    was refused or stopped, or its heartbeat went stale, since `since` (a heartbeat from
    before is an earlier attempt's); None while it may."""
    now = time.time()
    for hb in heartbeat_lib.read_heartbeats(store, history=False):
        if (hb.job != job or hb.replica != 0 or hb.process_index != 0
                or hb.updated_at < since):
            continue
        # A record with no attempt is its launcher's: the process died before it beat
        # here (deploy.local.mark_dead), which says so with its job.
        if hb.state in ("failed", "refused", "preempted"):
            return f"{hb.host} is {hb.state}: {hb.message}"
        if hb.attempt and heartbeat_lib.is_stale(hb, now, choice_policy.STALE_AFTER_S):
            return f"{hb.host} stopped beating {now - hb.updated_at:.0f}s ago"
    return None
