"""Which partition a replica takes next when the replicas of a job share work (`--steal`).

A replica's own partitions (p mod R, `schedule.own_partitions`) come first, front to back
(`own_order`: those that must hold a long chain first). Once they are all taken it takes
another replica's only where the owner will not reach them soon: from the end of the
longest list left among the replicas that have started (a heartbeat with steps), that are
dead or stale, or that are done. A replica that has not beaten keeps its partitions for a
start-up grace, and one that beats but has not stepped yet (loading its model, compiling)
keeps them until it steps: the first hosts to get going never empty the lists of the hosts
still loading; they run with fewer slots busy instead. A partition claimed by an attempt
that is dead is taken over (the claim's next generation, `schedule.try_claim`), so the
partitions of a dead replica, in hand or not, are finished by the others once its
heartbeat is `stale_after_s` old. While another live host holds uncommitted work, a replica
with nothing to take waits rather than ends, so that work is finished if that host dies.

Claims only steer the sharing: a commit marker is create-only and a partition's bytes are
a function of the run, so two attempts that extract one partition commit it once, with one
set of bytes. `decide` is a pure function of what the store said at one moment (`Shares`)
and the clock; `chooser.Chooser` reads the store and claims. tests/schedule_sim.py
drives the `Chooser` of many simulated replicas with fake clocks and heartbeats.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import math
from typing import Iterable, Mapping, Sequence

from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import manifest as manifest_lib

# `actx status --stale-after`'s default: a heartbeat this old is a dead host's.
STALE_AFTER_S = 60.0
# How long a replica that has never beaten keeps its partitions, from this worker's start.
START_GRACE_S = 60.0
# Seconds a view of the store (commits, claims, heartbeats) is reused before it is re-read
# (heartbeats change every heartbeat_s, 2 s by default); on a pod, longer, so that the
# replicas' looks stay within the bucket's budget for them
# (schemas.request_budget.tail_look_interval_s).
REFRESH_S = 2.0
# Whether a host whose own list is used up takes another replica's partition for slots
# its own chains leave free (True), or only once it has nothing in hand (False: it runs
# with fewer slots busy meanwhile). Either way it never takes from a replica that has not
# started: it runs with fewer slots busy instead. Measured in tests/schedule_sim.py (64,
# 16 and 2 replicas): True ends as soon or sooner (64 replicas: 1.032x the ideal makespan
# against 1.051x) and keeps every replica closer to its share.
FILL_SLOTS = True

# What a replica's heartbeats say about it.
UNSEEN, LOADING, STARTED, DONE, DEAD = "unseen", "loading", "started", "done", "dead"
LIVE_STATES = ("starting", "working", "idle")  # as deploy.status.runstate reads them
# The replica `Shares.held` names for a claim that no heartbeat names yet (made since its
# holder last beat): held, by a replica not known yet.
UNNAMED = -1
_STEALABLE = (STARTED, DONE, DEAD)


def replica_name(replica: int) -> str:
    return f"r{replica}"


def host_state(hb: heartbeat_lib.Heartbeat, now: float, stale_after_s: float) -> str:
    if hb.state == "done":
        return DONE
    if (hb.state not in LIVE_STATES or heartbeat_lib.is_stale(hb, now, stale_after_s)
            or heartbeat_lib.process_gone(hb)):
        return DEAD
    if hb.step > 0 or hb.tokens_done > 0 or hb.partitions_done > 0:
        return STARTED
    return LOADING


@dataclasses.dataclass(frozen=True)
class Beats:
    """The job's heartbeats, read at `now`: each replica's state and each attempt's."""

    replicas: Mapping[int, str]
    attempts: Mapping[str, tuple[int, str]]  # attempt -> (replica, its host's state)
    rates: Mapping[int, float] = dataclasses.field(default_factory=dict)  # tokens/s, live
    # partition -> the attempts whose heartbeats say they hold it (`held`): a claim's
    # holder without reading the claim, so what a host reads does not grow with the pod.
    holders: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Partitions the job's replicas say they committed (each replica's most-counting host;
    # an earlier attempt's count is gone with its heartbeat) and the partitions live
    # attempts say they hold: what is left, roughly, without listing the commit markers.
    partitions_done: int = 0
    in_hand: int = 0
    # When they were read, and the tokens the started hosts have done since their last
    # beats at their rates: what partitions_done lags by (a beat is up to an interval old).
    at: float = 0.0
    tokens_since: float = 0.0

    @classmethod
    def read(cls, beats: Iterable[heartbeat_lib.Heartbeat], job: str, now: float,
             stale_after_s: float) -> "Beats":
        by_replica: dict[int, list[str]] = collections.defaultdict(list)
        attempts, holders = {}, collections.defaultdict(tuple)
        rates: dict[int, float] = collections.defaultdict(float)
        done: dict[int, int] = collections.defaultdict(int)
        tokens_since = 0.0
        for hb in beats:
            # Another job's heartbeats (an earlier job on the run) and the launcher's note
            # of a process that died before it beat (no attempt) say nothing of this job.
            if hb.job != job or not hb.attempt:
                continue
            state = host_state(hb, now, stale_after_s)
            by_replica[hb.replica].append(state)
            attempts[hb.attempt] = (hb.replica, state)
            for pid in (*hb.held, *(() if hb.partition is None else (hb.partition,))):
                holders[pid] += (hb.attempt,)
            if state == STARTED:
                rates[hb.replica] += hb.tokens_per_s
                tokens_since += hb.tokens_per_s * max(0.0, now - hb.updated_at)
            done[hb.replica] = max(done[hb.replica], hb.partitions_done)
        replicas = {}
        for replica, states in by_replica.items():
            replicas[replica] = (DEAD if DEAD in states else
                                 DONE if all(s == DONE for s in states) else
                                 STARTED if STARTED in states else LOADING)
        in_hand = sum(1 for named in holders.values()
                      if any(attempts[a][1] in (STARTED, LOADING) for a in named))
        return cls(replicas, attempts, {r: v for r, v in rates.items() if v > 0},
                   dict(holders), sum(done.values()), in_hand, now, tokens_since)

    @functools.cached_property
    def total_rate(self) -> float:
        """Tokens/s of the job's started hosts together (summed once a listing: a chooser
        asks `partitions_left` once a partition)."""
        return sum(self.rates.values())

    def partitions_left(self, n_partitions: int, partition_tokens: float, now: float) -> float:
        """Partitions of work left at `now`, roughly: those not committed, the ones in hand
        counted half done (`decide` counts them so at a look), less what the started hosts
        have done since their beats and since the listing, at their rates (a pod's beats
        are seconds old: counted as they were, the end would look further off than it is)."""
        since = self.tokens_since + max(0.0, now - self.at) * self.total_rate
        return max(0.0, n_partitions - self.partitions_done - 0.5 * self.in_hand
                   - since / max(partition_tokens, 1.0))

    def holder_dead(self, attempt: str) -> bool | None:
        """Whether the attempt holding a claim will never commit it (None: not known)."""
        if attempt not in self.attempts:
            return None
        replica, state = self.attempts[attempt]
        # A host of a multi-host replica that died stops its replica, whatever its
        # leader's heartbeat still says.
        return state in (DEAD, DONE) or self.replicas.get(replica) == DEAD


@dataclasses.dataclass(frozen=True)
class Shares:
    """What the store says, at one moment, about the partitions this replica may take.

    own: this replica's partitions nobody holds (unclaimed, or held by a dead attempt), in
      its order.
    others: per other replica, its partitions nobody holds, in the owner's order.
    held: uncommitted partitions held by a live attempt of another host -> that host's
      replica: finished there, unless it dies.
    states: what the other replicas' heartbeats say (a replica absent is UNSEEN).
    pace: seconds a partition takes each replica that has started, where its heartbeats
      say (their tokens/s); my_pace: this replica's (0: not known yet).
    in_hand: the rows this host has still to write, in partitions (an average partition's
      rows on a host is 1): a partition it takes now ends after them.
    """

    own: tuple[int, ...]
    others: Mapping[int, tuple[int, ...]]
    held: Mapping[int, int]
    states: Mapping[int, str]
    pace: Mapping[int, float] = dataclasses.field(default_factory=dict)
    my_pace: float = 0.0
    in_hand: float = 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """take: partitions to try in this order (the first whose claim succeeds is taken);
    wait: nothing (else) to take now but work remains that may come to this replica, so ask
    again later rather than end; why: what keeps this replica waiting, in words."""

    take: tuple[int, ...]
    wait: bool
    why: str = ""


def stealable(state: str, now: float, grace_until: float) -> bool:
    """Whether another replica's partitions may be taken: it has started, is done or is
    dead; one never seen keeps them until the start-up grace ends; a loading one keeps them."""
    return state in _STEALABLE or (state == UNSEEN and now >= grace_until)


def from_the_longest_ends(lists: Mapping[int, Sequence[int]],
                          seconds: Mapping[int, float] | None = None,
                          in_hand: Mapping[int, int] | None = None,
                          my_seconds: float = 0.0) -> list[int]:
    """Partitions of `lists` in the order a stealer takes them: each time the last of the
    longest list, the one its owner would reach last. Longest in time where `seconds`
    (per owner, what a partition takes it; inf: it will not reach any) says: the owner's
    partitions in hand and in its list, times its seconds a partition (the lowest replica
    on ties). The list of an owner that will reach none (dead, or never seen) is taken
    from its front instead, in the owner's order: nobody works through it from there, and
    its front holds the long documents (`own_order`), which end the run late if taken
    last. With `my_seconds` (what a partition takes this replica), only while the owner
    would get through its list no sooner than this replica through one partition: a slow
    replica leaves a fast one's last partitions to it."""
    seconds = seconds or {}
    in_hand = in_hand or {}

    def key(replica: int, n: int) -> tuple:
        return (-(n + in_hand.get(replica, 0)) * seconds.get(replica, 1.0), -n, replica)

    heap = [key(replica, len(items)) for replica, items in lists.items() if items]
    heapq.heapify(heap)
    left = {replica: len(items) for replica, items in lists.items()}
    order = []
    while heap and not (my_seconds and -heap[0][0] <= my_seconds):
        _, _, replica = heapq.heappop(heap)
        left[replica] -= 1
        items = lists[replica]
        from_front = math.isinf(seconds.get(replica, 1.0))
        order.append(items[len(items) - 1 - left[replica]] if from_front else items[left[replica]])
        if left[replica]:
            heapq.heappush(heap, key(replica, left[replica]))
    return order


def decide(shares: Shares, now: float, grace_until: float, idle: bool = True,
           fill_slots: bool = FILL_SLOTS) -> Decision:
    """The partitions to try next, own first; other replicas' only when the own are all
    taken, and (unless `fill_slots`) only when this host has nothing in hand (`idle`).
    Near the end, a replica slower than the rest takes none (`slower_than_the_rest`)."""
    takeable = {r: items for r, items in shares.others.items()
                if items and stealable(shares.states.get(r, UNSEEN), now, grace_until)}
    left = (len(shares.own) + sum(len(items) for items in takeable.values())
            + 0.5 * len(shares.held))
    too_slow = slower_than_the_rest(shares.my_pace, shares.pace, shares.states, left,
                                    shares.in_hand)
    if shares.own:
        if too_slow:
            return Decision((), wait=True, why=too_slow)
        return Decision(tuple(shares.own), wait=False)
    kept = {r: items for r, items in shares.others.items() if items and r not in takeable}
    if takeable and not idle and not fill_slots:
        return Decision((), wait=True, why="its own chains still run; it takes another "
                                           "replica's partition once they end")
    # Seconds a partition takes each owner: a replica dead, done or never seen reaches
    # none; one whose pace is not known yet counts as a typical one (this one included).
    known = sorted([*shares.pace.values(), *([shares.my_pace] if shares.my_pace else [])])
    typical = known[len(known) // 2] if known else 1.0
    seconds = {r: shares.pace.get(r, typical) if shares.states.get(r) == STARTED
               else float("inf") for r in takeable}
    held_by = collections.Counter(shares.held.values())
    # What a partition taken now takes this replica: its pace, after the rows in hand.
    take = from_the_longest_ends(takeable, seconds, held_by,
                                 shares.my_pace * (1 + shares.in_hand))
    if take and too_slow:
        return Decision((), wait=True, why=too_slow)
    reached = {r: items for r, items in takeable.items() if not set(items) & set(take)}
    why = _why_waiting(kept, shares.held, shares.states, now, grace_until, reached)
    return Decision(tuple(take), wait=bool(kept or shares.held or reached), why=why)


def slower_than_the_rest(my_pace: float, pace: Mapping[int, float],
                         states: Mapping[int, str], left: float, in_hand: float = 0.0) -> str:
    """Why a replica takes no partition, own or another's, near the end ("": it takes):
    it would finish one (after its `in_hand` partitions' worth of rows) after the replicas
    faster than it, at their pace, have got through the `left` partitions and half of one
    more (the one of them that takes it instead is, on average, half a partition from its
    own end), so they take it then and end sooner, and the run's last commit is not a slow
    host's. my_pace, pace: seconds a partition takes this replica (0: not known) and the
    others that have started."""
    faster = faster_paces(my_pace, pace, states)
    if not too_slow_for(my_pace, faster, left, in_hand):
        return ""
    if in_hand:
        return (f"a partition taken now would end here in {my_pace * (1 + in_hand):.0f}s "
                f"(after the rows in hand), later than the faster replicas finish the "
                f"{left:.0f} left")
    return (f"a partition takes this replica {my_pace:.0f}s, longer than the faster "
            f"replicas take to finish the {left:.0f} left")


def faster_paces(my_pace: float, pace: Mapping[int, float],
                 states: Mapping[int, str]) -> tuple[float, int]:
    """(the typical pace, how many) of the started replicas faster than `my_pace`;
    (0, 0) when none is, or my_pace is not known."""
    faster = sorted(p for r, p in pace.items() if states.get(r) == STARTED and p < my_pace)
    if not my_pace or not faster:
        return 0.0, 0
    return faster[len(faster) // 2], len(faster)


def too_slow_for(my_pace: float, faster: tuple[float, int], left: float,
                 in_hand: float = 0.0) -> bool:
    """`slower_than_the_rest` from `faster_paces`: a partition taken here now (after the
    `in_hand` partitions' worth of rows) ends after the faster replicas get through `left`
    and half a partition more."""
    typical, n = faster
    return bool(n) and my_pace * (1 + in_hand) > left * typical / n + typical / 2


def _why_waiting(kept: Mapping[int, Sequence[int]], held: Mapping[int, int],
                 states: Mapping[int, str], now: float, grace_until: float,
                 reached: Mapping[int, Sequence[int]]) -> str:
    parts = [f"{replica_name(r)} gets through its last {len(items)} partition(s) sooner "
             f"than this replica would" for r, items in sorted(reached.items())]
    for r in sorted(kept):
        n = len(kept[r])
        if states.get(r, UNSEEN) == LOADING:
            parts.append(f"{replica_name(r)} is loading and keeps its {n} partition(s) "
                         f"until it steps")
        else:
            parts.append(f"{replica_name(r)} has not beaten and keeps its {n} partition(s) "
                         f"for {max(0.0, grace_until - now):.0f}s more of start-up grace")
    holders: dict[int, list[int]] = collections.defaultdict(list)
    for pid, r in held.items():
        holders[r].append(pid)
    for r in sorted(holders, key=lambda r: (r == UNNAMED, r)):
        pids = sorted(holders[r])
        shown = ", ".join(map(str, pids[:5])) + (", ..." if len(pids) > 5 else "")
        if r == UNNAMED:
            parts.append(f"{len(pids)} partition(s) ({shown}) were claimed by hosts whose "
                         f"heartbeats do not name them yet")
            continue
        parts.append(f"{replica_name(r)} is extracting {len(pids)} partition(s) ({shown}), "
                     f"taken over if its heartbeat goes stale")
    return "; ".join(parts)


def longest_chain_at_least(part: manifest_lib.Partition) -> int:
    """Rows of the partition's longest chain, at least: a chain starts where a document
    starts (`docs` of them) or at the partition's first row, so there are at most docs + 1
    chains over its rows."""
    return _longest_chain(0, part.row_count, part.docs, 0, 0, 0)


def longest_chain(part: manifest_lib.Partition, warmup_rows: int = 0) -> int:
    """Rows of the partition's longest chain as the manifest knows it: the rows its
    longest document runs through there (`longest_doc_rows`, manifests since version 3),
    or its first chain, a document continued from the partition before with up to
    `warmup_rows` of its earlier rows run first (the model's: workers.loop.schedule
    .warmup_rows; `continued_doc_rows`, `continued_from_rows`, since version 4), and at
    least `longest_chain_at_least`."""
    return _longest_chain(warmup_rows, *(getattr(part, f) for f in _CHAIN_FIELDS))


# The partition fields `_longest_chain` reads, in its order.
_CHAIN_FIELDS = ("row_count", "docs", "longest_doc_rows", "continued_doc_rows",
                 "continued_from_rows")


def _longest_chain(warmup_rows: int, row_count: int, docs: int, longest_doc_rows: int,
                   continued_doc_rows: int, continued_from_rows: int) -> int:
    """`longest_chain` from a partition's fields: the recorded rows, or the bound."""
    first = continued_doc_rows + min(continued_from_rows, warmup_rows)  # both 0 or neither
    return max(longest_doc_rows, first, -(-row_count // (docs + 1)))


def own_order(manifest: manifest_lib.Manifest, pids: Sequence[int],
              warmup_rows: int = 0) -> list[int]:
    """A replica's partitions in the order it takes them: those whose longest chain is
    longest first (a chain runs through one slot, one row a step, so a long one started
    last would end the run late: longest processing time first), then in id order.
    Others take a replica's partitions from the end of this order: the short ones.
    warmup_rows: the model's (`longest_chain`)."""
    # A manifest read holds columns: no object built a partition (150k at pod scale).
    columns = [manifest_lib.partition_column(manifest.partitions, f) for f in _CHAIN_FIELDS]
    chain = [_longest_chain(warmup_rows, *values) for values in zip(*columns)]
    return sorted(pids, key=lambda pid: -chain[pid])
