"""Chooser: one process's partition choice against the run's store (the leader's, in a
multi-host replica): it reads the heartbeats and claims, asks `choice_policy.decide`
what to take, and claims it.

Apart from `workers.replicas.choice_policy`, which holds the policy as pure functions of one
look at the store and the clock (what `tests/test_fair_sharing.py` checks case by case),
because this is the part with a store, a cache of what it last read and the claims'
races. The settings it does not get are `choice_policy`'s constants, read when a
Chooser is made (a test may set them first).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import time
from typing import Callable, Sequence

from actx.schemas import commit as commit_lib
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import manifest as manifest_lib
from actx.schemas import request_budget
from actx.workers.replicas import choice_policy
from actx.workers.loop import schedule


# Live replicas that try to take over one partition a dead attempt held, as soon as its
# heartbeat shows the death (the others leave it to them, or to their looks in the tail).
TAKEOVER_TRIERS = 2


class Chooser:
    """One process's partition choice (the leader's, in a multi-host replica).

    `choose(tried, is_committed, idle, rows_in_hand)` returns a partition id (claimed when
    stealing), None (nothing to take now: ask again later) or -1 (no more). `clock` gives
    wall-clock seconds (heartbeats' `updated_at`); a simulator passes its own.
    """

    def __init__(self, store, manifest: manifest_lib.Manifest, topo: schedule.Topology,
                 job: str, attempt: str, only: Sequence[int] | None = None,
                 steal: bool = True, clock: Callable[[], float] = time.time,
                 stale_after_s: float | None = None, start_grace_s: float | None = None,
                 refresh_s: float | None = None, fill_slots: bool | None = None):
        """The settings left None are this module's constants, read now."""
        self.store, self.topo, self.job, self.attempt = store, topo, job, attempt
        self.steal, self.clock = steal, clock
        self.stale_after_s = choice_policy.STALE_AFTER_S if stale_after_s is None else stale_after_s
        self.refresh_s = choice_policy.REFRESH_S if refresh_s is None else refresh_s
        self.fill_slots = choice_policy.FILL_SLOTS if fill_slots is None else fill_slots
        start_grace_s = choice_policy.START_GRACE_S if start_grace_s is None else start_grace_s
        wanted = None if only is None else set(only)
        self._manifest = manifest
        self._wanted = [p.id for p in manifest.partitions if wanted is None or p.id in wanted]
        self._mine = set(schedule.own_partitions(manifest, topo))
        self.order_by_warmup(0)
        self.n_partitions = len(manifest.partitions)
        # Tokens of a partition, on average: with a replica's tokens/s, its pace.
        self.partition_tokens = manifest.total_tokens / max(1, self.n_partitions)
        # Rows of a partition on one host of this replica, on average: what rows in hand
        # are counted in.
        self.host_partition_rows = max(1.0, manifest.total_rows / max(1, self.n_partitions)
                                       / topo.hosts_per_replica)
        self.grace_until = clock() + start_grace_s
        self._own_next = 0  # own partitions before this index were tried once
        self._holders: dict[tuple[int, int], str] = {}  # (pid, generation) -> attempt, read
        # Claims no heartbeat named yet: (pid, generation) -> when first seen so.
        self._unnamed_since: dict[tuple[int, int], float] = {}
        self._dead_tried: set[int] = set()  # dead attempts' partitions tried to take over
        # Those of them this replica is to try: (when the heartbeats they come from were
        # read, the partitions).
        self._dead_held: tuple[float | None, list[int]] = (None, [])
        # This replica's pace and the faster ones' (`choice_policy.faster_paces`) by the
        # heartbeats listed at that time (`_maybe_too_slow`).
        self._too_slow: tuple[float | None, float, tuple[float, int]] = (None, 0.0, (0.0, 0))
        self._universe = set(self.universe)
        self.looks = 0  # looks at the store (listings of commits, claims and heartbeats)
        self.holders_read = 0  # claims read at those looks for their holders
        # The last look at the store: (when, choice_policy.Shares, claim generations).
        self._view: tuple[float, choice_policy.Shares, dict[int, int]] | None = None
        # Seconds between looks: refresh_s, or longer where the pod's replicas looking that
        # often would pass the bucket's budget for listings (set at each look, jittered).
        self.look_every_s = self.refresh_s
        self._lost: set[int] = set()  # claimed first by others since the last look
        self._jitter = random.Random(attempt)
        self._beats: tuple[float, choice_policy.Beats] | None = None  # the last heartbeats read
        # What the heartbeat reports: owner replica -> partitions taken from its list;
        # taker replica (or "?") -> own partitions another replica took first.
        self.stolen_from: collections.Counter = collections.Counter()
        self.given_up: collections.Counter = collections.Counter()
        self.why_waiting = ""

    def order_by_warmup(self, warmup_rows: int) -> None:
        """Every partition in its owner's order (`own_order`: longest chain first, a chain
        of a document continued from the partition before counting `warmup_rows`, the
        model's), the order the looks keep each replica's list in too. Called again once
        the model is known, before the first `choose`: every replica of a job runs the
        same model, so their orders agree."""
        self.universe = choice_policy.own_order(self._manifest, self._wanted, warmup_rows)
        self.own = [p for p in self.universe if p in self._mine]

    def choose(self, tried: set[int], is_committed: Callable[[int], bool],
               idle: bool = True, rows_in_hand: int = 0) -> int | None:
        """idle: this host has nothing in hand; rows_in_hand: the rows it has still to
        write (a partition taken now ends after them)."""
        if not self.steal:  # own partitions only, unclaimed (a job's one-replica worker)
            for pid in self.own:
                if pid not in tried and not is_committed(pid):
                    tried.add(pid)
                    return pid
            return -1
        pid = self._take_over_the_dead(tried, is_committed)
        in_hand = rows_in_hand / self.host_partition_rows
        if pid is None and not self._maybe_too_slow(in_hand):
            pid = self._next_own(tried, is_committed)
        if pid is not None:
            return pid
        for _ in range(3):  # a lost race for every candidate: the view was old, read again
            now = self.clock()
            shares, generations = self._shares(tried, now, is_committed)
            decision = choice_policy.decide(dataclasses.replace(shares, in_hand=in_hand), now,
                                            self.grace_until, idle, self.fill_slots)
            for pid in decision.take:
                if pid in tried or is_committed(pid):
                    continue
                generation = generations.get(pid, -1) + 1
                if not schedule.try_claim(self.store, self.job, pid, self.attempt, generation):
                    self._lost.add(pid)  # not tried again before the next look
                else:
                    self.why_waiting = ""
                    return self._claimed(pid, tried)
            if not decision.take:
                self.why_waiting = decision.why if decision.wait else ""
                return None if decision.wait else -1
            if self._view is not None and now - self._view[0] < self.look_every_s:
                break  # others took these first: look again when a look is due
            self._view = None
        self.why_waiting = "every partition it tried was claimed first by another replica"
        return None

    def why_nothing_done(self, committed_before: set[int]) -> str:
        """Why a host that extracted nothing did not (for its last heartbeat)."""
        if not self.own:
            return (f"{choice_policy.replica_name(self.topo.replica)} owns no partition here (more "
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

    def _maybe_too_slow(self, in_hand: float) -> bool:
        """Whether, by the heartbeats last listed (their paces and partitions done, brought
        to now at their rates), this replica may be too slow to take even its own next
        partition after the `in_hand` partitions' worth of rows it has still to write
        (`choice_policy.slower_than_the_rest`): then it looks at the store first,
        and `decide` says, rather than claim it blind. False for most replicas most of the
        run, which take their own list without a look. The paces are gone through once a
        listing of the heartbeats, not once a partition."""
        if self._beats is None:
            return False
        read_at, beats = self._beats
        if self._too_slow[0] != read_at:
            mine = beats.rates.get(self.topo.replica)
            my_pace = self.partition_tokens / mine if mine else 0.0
            pace = {r: self.partition_tokens / rate for r, rate in beats.rates.items()
                    if r != self.topo.replica}
            self._too_slow = (read_at, my_pace,
                              choice_policy.faster_paces(my_pace, pace, beats.replicas))
        _, my_pace, faster = self._too_slow
        return choice_policy.too_slow_for(my_pace, faster, beats.partitions_left(
            self.n_partitions, self.partition_tokens, self.clock()), in_hand)

    def _take_over_the_dead(self, tried: set[int], is_committed: Callable[[int], bool]
                            ) -> int | None:
        """A partition a dead attempt held (its heartbeat names it, and it is stale or
        ended), claimed at the next generation, before this replica's own list: a death is
        made good as soon as it shows, not once every replica's own list is used up (a
        partition of long chains redone in the tail ends the run late). Heartbeats are
        listed at most once a heartbeat interval of the pod's (a death shows only once a
        heartbeat is 3 of them old); each dead partition is tried by the TAKEOVER_TRIERS
        live replicas its id ranks first, so a pod does not race for it."""
        beats = self._heartbeats(max(self.look_every_s, request_budget.heartbeat_interval_s(
            self.refresh_s, self.topo.replicas * self.topo.hosts_per_replica)))
        read_at = self._beats[0]
        if self._dead_held[0] != read_at:  # once a heartbeat listing, not once a partition
            live = sorted(r for r, state in beats.replicas.items()
                          if state == choice_policy.STARTED)
            self._dead_held = (read_at, [
                pid for pid, named in sorted(beats.holders.items())
                if pid in self._universe and any(beats.holder_dead(a) for a in named)
                and not any(beats.holder_dead(a) is False for a in named)
                and self.topo.replica in sorted(
                    live, key=lambda r: hash((pid, r)) & 0xFFFFFFFF)[:TAKEOVER_TRIERS]])
        for pid in self._dead_held[1]:
            if pid in tried or pid in self._dead_tried:
                continue
            self._dead_tried.add(pid)
            if is_committed(pid):
                continue
            holder, generation = self._last_claim(pid)
            if generation < 0 or not beats.holder_dead(holder):
                continue  # not claimed, or held now by a live attempt: the looks decide
            if schedule.try_claim(self.store, self.job, pid, self.attempt, generation + 1):
                return self._claimed(pid, tried)
        return None

    def _claimed(self, pid: int, tried: set[int]) -> int:
        """Records partition `pid`, just claimed, as taken (from its owner's list, when
        that is another replica's); returns it."""
        tried.add(pid)
        owner = pid % self.topo.replicas
        if owner != self.topo.replica:
            self.stolen_from[choice_policy.replica_name(owner)] += 1
        return pid

    def _count_given_up(self, pid: int) -> None:
        """Counts an own partition another attempt claimed first, by the replica of the
        attempt that holds it now (the claim's last generation)."""
        holder, _ = self._last_claim(pid)
        taker = self._heartbeats(self.look_every_s).attempts.get(holder, ("?",))[0]
        self.given_up[taker if taker == "?" else choice_policy.replica_name(taker)] += 1

    def claimed_by_another(self, pid: int) -> bool:
        """Whether partition `pid`'s claim is now held by another attempt (taken over from
        this one, as from a dead attempt's). A replica that does not steal claims nothing."""
        if not self.steal:
            return False
        holder, _ = self._last_claim(pid)
        return holder not in ("", self.attempt)

    def _last_claim(self, pid: int) -> tuple[str, int]:
        """The attempt holding partition `pid`'s claim and the claim's generation (-1: not
        claimed), read generation by generation (each holder kept: a claim never changes)."""
        holder, generation = "", -1
        while (data := self.store.read_json(
                schedule.claim_key(self.job, pid, generation + 1))) is not None:
            generation += 1
            holder = self._holders[(pid, generation)] = data.get("attempt", "")
        return holder, generation

    def _heartbeats(self, every_s: float) -> choice_policy.Beats:
        """The job's heartbeats, listed again once the last listing is `every_s` old."""
        now = self.clock()
        if self._beats is None or now - self._beats[0] >= every_s:
            self._beats = (now, choice_policy.Beats.read(heartbeat_lib.read_heartbeats(
                self.store, history=False), self.job, now, self.stale_after_s))
        return self._beats[1]

    def _shares(self, tried: set[int], now: float,
                is_committed: Callable[[int], bool]) -> tuple[choice_policy.Shares, dict[int, int]]:
        """The store's view, re-read at most every `look_every_s`: choice_policy.Shares, and
        the claim generation each claimed partition is at. A look lists the heartbeats, the
        commit markers and the claims; it reads no claim whose holder a heartbeat names
        (`held`), so what a host reads does not grow with the pod. Between looks the view
        is reused, less what this process took since: a host whose own list is used up
        (the tail) lists the run once per `look_every_s`, however often it asks."""
        view = self._view
        if view is not None and now - view[0] < self.look_every_s:
            shares = _without(view[1], tried | self._lost)
            if self._lost:  # held by whoever won them: waited for, as at a look
                shares = dataclasses.replace(shares, held={
                    **shares.held, **dict.fromkeys(self._lost, choice_policy.UNNAMED)})
            return shares, view[2]
        self._lost = set()
        listed = heartbeat_lib.read_heartbeats(self.store, history=False)
        beats = choice_policy.Beats.read(listed, self.job, now, self.stale_after_s)
        self._beats = (now, beats)
        committed = commit_lib.committed_partitions(self.store, self.n_partitions)
        names = self.store.list_names(schedule.claims_folder(self.job))
        generations = schedule.claim_generations(names)
        open_pids = [p for p in self.universe if p not in committed and p not in tried]
        holders = self._holders_of([(p, generations[p]) for p in open_pids if p in generations],
                                   beats, now)
        own, others, held = [], collections.defaultdict(list), {}
        for pid in open_pids:
            owner = pid % self.topo.replicas
            if pid in generations:
                holder = holders[(pid, generations[pid])]
                if holder is None:  # claimed since its holder last beat: held, by whom not
                    held[pid] = choice_policy.UNNAMED  # known yet (or committed since the listing)
                    continue
                dead = beats.holder_dead(holder)
                if holder == self.attempt or dead is None:
                    continue  # this attempt's own, or an attempt this job does not know
                if not dead:
                    held[pid] = beats.attempts[holder][0]
                    continue
            (own if owner == self.topo.replica else others[owner]).append(pid)
        states = {r: s for r, s in beats.replicas.items() if r != self.topo.replica}
        pace = {r: self.partition_tokens / rate for r, rate in beats.rates.items()}
        shares = choice_policy.Shares(tuple(own), {r: tuple(v) for r, v in others.items()}, held, states,
                        {r: v for r, v in pace.items() if r != self.topo.replica},
                        pace.get(self.topo.replica, 0.0))
        self._view = (now, shares, generations)
        pages = (request_budget.list_pages(len(committed)) + request_budget.list_pages(len(names))
                 + request_budget.list_pages(len(listed)))
        self.look_every_s = request_budget.jittered(request_budget.tail_look_interval_s(
            self.refresh_s, self.topo.replicas, pages), self._jitter)
        return shares, generations

    def _holders_of(self, claims: list[tuple[int, int]], beats: choice_policy.Beats,
                    now: float) -> dict[tuple[int, int], str | None]:
        """The attempt holding each claim (pid, generation): the one whose heartbeat names
        the partition, else the claim's own word, read once (a claim never changes); None
        for a claim not read yet. A look reads at most
        request_budget.UNNAMED_CLAIM_READS_A_LOOK claims, those first seen longest ago
        first: what a host reads a look stays flat however many hosts claim, and a claim
        no heartbeat will name (its holder died before beating, or is no worker of this
        job's) is read within a few looks rather than waited on."""
        found: dict[tuple[int, int], str | None] = {}
        unnamed = []
        for claim in claims:
            pid, generation = claim
            named = beats.holders.get(pid, ())
            live = [a for a in named if beats.holder_dead(a) is False]
            if claim in self._holders:
                found[claim] = self._holders[claim]
            elif live or (named and generation == 0):
                # A takeover (generation > 0) is named by its dead first holder too: only a
                # live one that names it holds it.
                found[claim] = (live or named)[0]
                self._unnamed_since.pop(claim, None)
            else:
                found[claim] = None
                unnamed.append((self._unnamed_since.setdefault(claim, now), claim))
        unread = [claim for _, claim in sorted(unnamed)[:request_budget.UNNAMED_CLAIM_READS_A_LOOK]]
        keys = [schedule.claim_key(self.job, pid, generation) for pid, generation in unread]
        self.looks += 1
        self.holders_read += len(unread)
        for claim, key, data in zip(unread, keys, self.store.read_many(keys)):
            self._holders[claim] = found[claim] = (
                "" if data is None else (self.store.parse_json(key, data) or {}).get("attempt", ""))
            self._unnamed_since.pop(claim, None)
        return found


def _without(shares: choice_policy.Shares, taken: set[int]) -> choice_policy.Shares:
    """`shares` less the partitions this process has taken since."""
    return dataclasses.replace(
        shares, own=tuple(p for p in shares.own if p not in taken),
        others={r: tuple(p for p in items if p not in taken)
                for r, items in shares.others.items()})
