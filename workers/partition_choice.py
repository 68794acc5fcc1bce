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
and the clock; `Chooser` reads the store and claims. tests/schedule_sim.py drives the
`Chooser` of many simulated replicas with fake clocks and heartbeats.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import time
from typing import Callable, Iterable, Mapping, Sequence

from actx.schemas import commit as commit_lib
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import manifest as manifest_lib
from actx.workers import schedule

# `actx status --stale-after`'s default: a heartbeat this old is a dead host's.
STALE_AFTER_S = 60.0
# How long a replica that has never beaten keeps its partitions, from this worker's start.
START_GRACE_S = 60.0
# Seconds a view of the store (commits, claims, heartbeats) is reused before it is re-read
# (heartbeats change every heartbeat_s, 2 s by default).
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
LIVE_STATES = ("starting", "working", "idle")  # as deploy.runstate reads them
_STEALABLE = (STARTED, DONE, DEAD)


def replica_name(replica: int) -> str:
    return f"r{replica}"


def host_state(hb: heartbeat_lib.Heartbeat, now: float, stale_after_s: float) -> str:
    if hb.state == "done":
        return DONE
    if (hb.state not in LIVE_STATES or now - hb.updated_at > stale_after_s
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

    @classmethod
    def read(cls, beats: Iterable[heartbeat_lib.Heartbeat], job: str, now: float,
             stale_after_s: float) -> "Beats":
        by_replica: dict[int, list[str]] = collections.defaultdict(list)
        attempts = {}
        rates: dict[int, float] = collections.defaultdict(float)
        for hb in beats:
            # Another job's heartbeats (an earlier job on the run) and the launcher's note
            # of a process that died before it beat (no attempt) say nothing of this job.
            if hb.job != job or not hb.attempt:
                continue
            state = host_state(hb, now, stale_after_s)
            by_replica[hb.replica].append(state)
            attempts[hb.attempt] = (hb.replica, state)
            if state == STARTED:
                rates[hb.replica] += hb.tokens_per_s
        replicas = {}
        for replica, states in by_replica.items():
            replicas[replica] = (DEAD if DEAD in states else
                                 DONE if all(s == DONE for s in states) else
                                 STARTED if STARTED in states else LOADING)
        return cls(replicas, attempts, {r: v for r, v in rates.items() if v > 0})

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
    """

    own: tuple[int, ...]
    others: Mapping[int, tuple[int, ...]]
    held: Mapping[int, int]
    states: Mapping[int, str]
    pace: Mapping[int, float] = dataclasses.field(default_factory=dict)
    my_pace: float = 0.0


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
    on ties). With `my_seconds` (what a partition takes this replica), only while the owner
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
        order.append(lists[replica][left[replica]])
        if left[replica]:
            heapq.heappush(heap, key(replica, left[replica]))
    return order


def decide(shares: Shares, now: float, grace_until: float, idle: bool = True,
           fill_slots: bool = FILL_SLOTS) -> Decision:
    """The partitions to try next, own first; other replicas' only when the own are all
    taken, and (unless `fill_slots`) only when this host has nothing in hand (`idle`)."""
    if shares.own:
        return Decision(tuple(shares.own), wait=False)
    takeable = {r: items for r, items in shares.others.items()
                if items and stealable(shares.states.get(r, UNSEEN), now, grace_until)}
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
    in_hand = collections.Counter(shares.held.values())
    take = from_the_longest_ends(takeable, seconds, in_hand, shares.my_pace)
    reached = {r: items for r, items in takeable.items() if not set(items) & set(take)}
    why = _why_waiting(kept, shares.held, shares.states, now, grace_until, reached)
    return Decision(tuple(take), wait=bool(kept or shares.held or reached), why=why)


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
    for r in sorted(holders):
        pids = sorted(holders[r])
        shown = ", ".join(map(str, pids[:5])) + (", ..." if len(pids) > 5 else "")
        parts.append(f"{replica_name(r)} is extracting {len(pids)} partition(s) ({shown}), "
                     f"taken over if its heartbeat goes stale")
    return "; ".join(parts)


def longest_chain_at_least(part: manifest_lib.Partition) -> int:
    """Rows of the partition's longest chain, at least: a chain starts where a document
    starts (`docs` of them) or at the partition's first row, so there are at most docs + 1
    chains over its rows."""
    return -(-part.row_count // (part.docs + 1))


def own_order(manifest: manifest_lib.Manifest, pids: Sequence[int]) -> list[int]:
    """A replica's partitions in the order it takes them: those whose longest chain is
    longest first (a chain runs through one slot, one row a step, so a long one started
    last would end the run late), then in id order; most partitions hold many documents,
    a bound of 1, and keep the id order."""
    return sorted(pids, key=lambda pid: -longest_chain_at_least(manifest.partition(pid)))


class Chooser:
    """One process's partition choice (the leader's, in a multi-host replica).

    `choose(tried, is_committed, idle)` returns a partition id (claimed when stealing),
    None (nothing to take now: ask again later) or -1 (no more). `clock` gives wall-clock
    seconds (heartbeats' `updated_at`); a simulator passes its own.
    """

    def __init__(self, store, manifest: manifest_lib.Manifest, topo: schedule.Topology,
                 job: str, attempt: str, only: Sequence[int] | None = None,
                 steal: bool = True, clock: Callable[[], float] = time.time,
                 stale_after_s: float | None = None, start_grace_s: float | None = None,
                 refresh_s: float | None = None, fill_slots: bool | None = None):
        """The settings left None are this module's constants, read now."""
        self.store, self.topo, self.job, self.attempt = store, topo, job, attempt
        self.steal, self.clock = steal, clock
        self.stale_after_s = STALE_AFTER_S if stale_after_s is None else stale_after_s
        self.refresh_s = REFRESH_S if refresh_s is None else refresh_s
        self.fill_slots = FILL_SLOTS if fill_slots is None else fill_slots
        start_grace_s = START_GRACE_S if start_grace_s is None else start_grace_s
        wanted = None if only is None else set(only)
        self.universe = [p.id for p in manifest.partitions if wanted is None or p.id in wanted]
        self.own = own_order(manifest, [p for p in schedule.own_partitions(manifest, topo)
                                        if wanted is None or p in wanted])
        self.n_partitions = len(manifest.partitions)
        # Tokens of a partition, on average: with a replica's tokens/s, its pace.
        self.partition_tokens = manifest.total_tokens / max(1, self.n_partitions)
        self.grace_until = clock() + start_grace_s
        self._own_next = 0  # own partitions before this index were tried once
        self._holders: dict[tuple[int, int], str] = {}  # (pid, generation) -> attempt
        # The last look at the store: (when, Shares, claim generations, what the
        # heartbeats said: replica states, dead attempts, whether the grace is over).
        self._view: tuple[float, Shares, dict[int, int], tuple] | None = None
        self._beats: tuple[float, Beats] | None = None  # the last heartbeats read
        # What the heartbeat reports: owner replica -> partitions taken from its list;
        # taker replica (or "?") -> own partitions another replica took first.
        self.stolen_from: collections.Counter = collections.Counter()
        self.given_up: collections.Counter = collections.Counter()
        self.why_waiting = ""

    def choose(self, tried: set[int], is_committed: Callable[[int], bool],
               idle: bool = True) -> int | None:
        if not self.steal:  # own partitions only, unclaimed (a job's one-replica worker)
            for pid in self.own:
                if pid not in tried and not is_committed(pid):
                    tried.add(pid)
                    return pid
            return -1
        pid = self._next_own(tried, is_committed)
        if pid is not None:
            return pid
        for _ in range(3):  # a lost race for every candidate: the view was old, read again
            now = self.clock()
            shares, generations = self._shares(tried, now, is_committed)
            decision = decide(shares, now, self.grace_until, idle, self.fill_slots)
            for pid in decision.take:
                if pid in tried or is_committed(pid):
                    continue
                generation = generations.get(pid, -1) + 1
                if schedule.try_claim(self.store, self.job, pid, self.attempt, generation):
                    tried.add(pid)
                    owner = pid % self.topo.replicas
                    if owner != self.topo.replica:
                        self.stolen_from[replica_name(owner)] += 1
                    self.why_waiting = ""
                    return pid
            if not decision.take:
                self.why_waiting = decision.why if decision.wait else ""
                return None if decision.wait else -1
            self._view = None
        self.why_waiting = "every partition it tried was claimed first by another replica"
        return None

    def why_nothing_done(self, committed_before: set[int]) -> str:
        """Why a host that extracted nothing did not (for its last heartbeat)."""
        if not self.own:
            return (f"{replica_name(self.topo.replica)} owns no partition here (more "
                    f"replicas than partitions, or none of --only)")
        reasons = []
        if committed_before:
            reasons.append(f"{len(committed_before)} of its {len(self.own)} partitions were "
                           f"committed before it started")
        if self.given_up:
            takers = ", ".join(f"{r} ({n})" for r, n in sorted(self.given_up.items()))
            reasons.append(f"{sum(self.given_up.values())} were claimed first by other "
                           f"replicas: {takers}")
        return "; ".join(reasons) or "nothing was left to take when it came to choose"

    def _next_own(self, tried: set[int], is_committed: Callable[[int], bool]) -> int | None:
        """The next own partition in order that this attempt claims (generation 0); those
        another attempt claimed first are left to the view (a dead one's are taken over)."""
        while self._own_next < len(self.own):
            pid = self.own[self._own_next]
            self._own_next += 1
            if pid in tried or is_committed(pid):
                continue
            if schedule.try_claim(self.store, self.job, pid, self.attempt):
                tried.add(pid)
                return pid
            self._count_given_up(pid)
        return None

    def _count_given_up(self, pid: int) -> None:
        """Counts an own partition another attempt claimed first, by the replica of the
        attempt that holds it now (the claim's last generation)."""
        holder, generation = "", 0
        while (data := self.store.read_json(
                schedule.claim_key(self.job, pid, generation))) is not None:
            holder = self._holders[(pid, generation)] = data.get("attempt", "")
            generation += 1
        now = self.clock()
        if self._beats is None or now - self._beats[0] >= self.refresh_s:
            self._beats = (now, Beats.read(heartbeat_lib.read_heartbeats(
                self.store, history=False), self.job, now, self.stale_after_s))
        taker = self._beats[1].attempts.get(holder, ("?",))[0]
        self.given_up[taker if taker == "?" else replica_name(taker)] += 1

    def _shares(self, tried: set[int], now: float,
                is_committed: Callable[[int], bool]) -> tuple[Shares, dict[int, int]]:
        """The store's view, re-read at most every `refresh_s`: Shares, and the claim
        generation each claimed partition is at. After a look that found nothing to take,
        a look whose heartbeats say what they said then (no replica started, ended or died,
        the grace not over) reads only the commit markers of the partitions others hold: a
        waiting host lists no claims and markers (tens of thousands on a pod) every poll."""
        view = self._view
        if view is not None and now - view[0] < self.refresh_s:
            return _without(view[1], tried), view[2]
        beats = Beats.read(heartbeat_lib.read_heartbeats(self.store, history=False),
                           self.job, now, self.stale_after_s)
        self._beats = (now, beats)
        signature = (tuple(sorted(beats.replicas.items())),
                     frozenset(a for a in beats.attempts if beats.holder_dead(a)),
                     now >= self.grace_until)
        if (view is not None and view[3] == signature
                and not decide(view[1], now, self.grace_until).take):
            shares = dataclasses.replace(
                _without(view[1], tried),
                held={p: r for p, r in view[1].held.items() if not is_committed(p)})
            self._view = (now, shares, view[2], signature)
            return shares, view[2]
        committed = commit_lib.committed_partitions(self.store, self.n_partitions)
        generations = schedule.claim_generations(
            self.store.list_names(schedule.claims_folder(self.job)))
        open_pids = [p for p in self.universe if p not in committed and p not in tried]
        holders = self._read_holders([(p, generations[p]) for p in open_pids
                                      if p in generations])
        own, others, held = [], collections.defaultdict(list), {}
        for pid in open_pids:
            owner = pid % self.topo.replicas
            if pid in generations:
                holder = holders[(pid, generations[pid])]
                dead = beats.holder_dead(holder)
                if holder == self.attempt or dead is None:
                    continue  # this attempt's own, or an attempt this job does not know
                if not dead:
                    held[pid] = beats.attempts[holder][0]
                    continue
            (own if owner == self.topo.replica else others[owner]).append(pid)
        states = {r: s for r, s in beats.replicas.items() if r != self.topo.replica}
        pace = {r: self.partition_tokens / rate for r, rate in beats.rates.items()}
        shares = Shares(tuple(own), {r: tuple(v) for r, v in others.items()}, held, states,
                        {r: v for r, v in pace.items() if r != self.topo.replica},
                        pace.get(self.topo.replica, 0.0))
        self._view = (now, shares, generations, signature)
        return shares, generations

    def _read_holders(self, claims: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """The attempt of each claim (pid, generation); a claim never changes, so each is
        read once."""
        unread = [c for c in claims if c not in self._holders]
        keys = [schedule.claim_key(self.job, pid, generation) for pid, generation in unread]
        for claim, key, data in zip(unread, keys, self.store.read_many(keys)):
            self._holders[claim] = ("" if data is None else
                                    (self.store.parse_json(key, data) or {}).get("attempt", ""))
        return {c: self._holders[c] for c in claims}


def _without(shares: Shares, taken: set[int]) -> Shares:
    """`shares` less the partitions this process has taken since."""
    return dataclasses.replace(
        shares, own=tuple(p for p in shares.own if p not in taken),
        others={r: tuple(p for p in items if p not in taken)
                for r, items in shares.others.items()})
