"""What a whole pod may ask of its bucket for control traffic, and the intervals that keep it
there whatever the pod's size.

Cloud Storage gives a new bucket about 1,000 object writes/s and 5,000 reads/s (listings
included), and one object name about one write a second. Control traffic (heartbeats,
logs, claims bookkeeping, the tail's listings, status, the launcher's polls) must stay a
small part of that at 1,024 hosts, so each periodic request's interval is the larger of
its configured floor and what the pod-wide budget leaves each of the hosts that make it:
interval = writers / budget. tests/test_schedule_sim.py counts the requests of 1,024
simulated replicas against these figures; docs/performance.md gives the formulas.
"""

from __future__ import annotations

import random

# Pod-wide heartbeat writes a second: 1,024 hosts beat every 20.5 s (64 hosts: the
# configured 2 s).
HEARTBEAT_WRITES_PER_S = 50.0
# Pod-wide log copies a second (deploy.detached.host_run): 1,024 hosts every 41 s.
LOG_WRITES_PER_S = 25.0
# A heartbeat is stale once it is this many of its own intervals old, when that is more
# than `--stale-after` (60 s): a pod so big that its hosts beat every 30 s is judged after
# 90 s, never after the second beat it has not had time to write.
STALE_INTERVALS = 3.0
# Pod-wide list pages a second for the partition choice's looks at the store (commits,
# claims, heartbeats) once replicas have no own partitions left: the tail.
TAIL_LIST_PAGES_PER_S = 2_000.0
# Objects a listing returns a page (GCS's maximum, and its default).
LIST_PAGE_OBJECTS = 1_000
# Claims a chooser reads at one look whose holder no heartbeat names yet (a claim made
# since its holder last beat, or one whose holder never beats), the first seen first:
# what a host reads a look stays this, however many hosts claim; the others are waited on
# as held until a heartbeat names them or a later look reads them.
UNNAMED_CLAIM_READS_A_LOOK = 8


def heartbeat_interval_s(floor_s: float, hosts: int) -> float:
    """Seconds between a host's heartbeats: `floor_s` (the configured heartbeat_s), or
    longer where `hosts` beating that often would pass HEARTBEAT_WRITES_PER_S."""
    return max(floor_s, hosts / HEARTBEAT_WRITES_PER_S)


def log_interval_s(floor_s: float, hosts: int) -> float:
    """Seconds between a host's log copies: `floor_s` (log_every_s), or longer where
    `hosts` copying that often would pass LOG_WRITES_PER_S."""
    return max(floor_s, hosts / LOG_WRITES_PER_S)


def stale_after_s(stale_after: float, interval_s: float) -> float:
    """How old a heartbeat written every `interval_s` is before its host counts as dead:
    `stale_after`, or STALE_INTERVALS of its intervals where that is longer."""
    return max(stale_after, STALE_INTERVALS * interval_s)


def list_pages(objects: int) -> int:
    """Requests one listing of `objects` objects takes (at least one)."""
    return max(1, -(-objects // LIST_PAGE_OBJECTS))


def tail_look_interval_s(floor_s: float, choosers: int, pages_a_look: int) -> float:
    """The longest wait between a tail chooser's looks at the store: `floor_s`, or longer
    where `choosers` (one a replica) each listing `pages_a_look` pages that often would
    pass TAIL_LIST_PAGES_PER_S."""
    return max(floor_s, choosers * pages_a_look / TAIL_LIST_PAGES_PER_S)


def jittered(seconds: float, rng: random.Random) -> float:
    """`seconds` less up to a quarter, at random: hosts that began to wait together do not
    look together."""
    return seconds * (1.0 - 0.25 * rng.random())
