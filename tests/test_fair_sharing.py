"""Work sharing between replicas (workers.replicas.choice_policy): what a replica may take, when,
and what its heartbeat says about it; then the real thing, a job of 2 local hosts over
partitions of a few long documents (issue 50's held-out case), a dead replica's claimed
partition taken over, and a host that waits saying why."""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import signal
import time

import pytest

from actx.schemas import commit, heartbeat, layout, manifest, request_budget, store
from actx.schemas import config as config_lib
from actx.workers.replicas import choice_policy as pc
from actx.workers.loop import prefetch, progress, schedule
from actx.workers.replicas import chooser
from tests import hf_models, token_runs, worker_procs

JOB = "j"


def _beat(s, host: str, replica: int, attempt: str, state: str = "working", step: int = 5,
          age_s: float = 0.0, job: str = JOB, now: float | None = None,
          held: tuple[int, ...] = (), interval_s: float = 0.0, tokens_per_s: float = 0.0,
          partitions_done: int = 0) -> None:
    now = time.time() if now is None else now
    hb = heartbeat.Heartbeat(host=host, replica=replica, process_index=0, state=state,
                             attempt=attempt, updated_at=now - age_s, step=step,
                             tokens_done=step * 10, job=job, held=held, interval_s=interval_s,
                             tokens_per_s=tokens_per_s, partitions_done=partitions_done)
    heartbeat.HeartbeatWriter(s, host).beat(hb, force=True)


# -- what the heartbeats say -------------------------------------------------------------
def test_replica_states_from_heartbeats(tmp_path):
    s = store.open_store(str(tmp_path))
    now = 1000.0
    _beat(s, "h0", 0, "a0", now=now)                                  # stepping
    _beat(s, "h1", 1, "a1", state="starting", step=0, now=now)        # loading
    _beat(s, "h2", 2, "a2", age_s=61, now=now)                        # silent 61 s
    _beat(s, "h3", 3, "a3", state="failed", now=now)
    _beat(s, "h4", 4, "a4", state="done", now=now)
    _beat(s, "h5", 5, "a5", job="earlier", now=now)                   # another job's
    _beat(s, "h6a", 6, "a6a", now=now)                                # host 0 of replica 6:
    _beat(s, "h6b", 6, "a6b", state="failed", now=now)                # its other host died
    beats = pc.Beats.read(heartbeat.read_heartbeats(s), JOB, now, stale_after_s=60.0)
    assert beats.replicas == {0: pc.STARTED, 1: pc.LOADING, 2: pc.DEAD, 3: pc.DEAD,
                              4: pc.DONE, 6: pc.DEAD}
    assert beats.holder_dead("a0") is False and beats.holder_dead("a1") is False
    assert beats.holder_dead("a2") and beats.holder_dead("a3") and beats.holder_dead("a4")
    assert beats.holder_dead("a6a")  # alive itself, but its replica stopped
    assert beats.holder_dead("a5") is None and beats.holder_dead("nobody") is None


# -- the decision ------------------------------------------------------------------------
def test_own_partitions_come_first():
    shares = pc.Shares(own=(4, 8), others={1: (1, 5)}, held={}, states={1: pc.STARTED})
    assert pc.decide(shares, now=0.0, grace_until=0.0) == pc.Decision((4, 8), wait=False)


def test_stealing_takes_the_ends_of_the_longest_lists_of_replicas_that_started():
    """r1 started (3 left), r2 is dead (2 left), r3 is loading, r4 never beat. The dead
    one's list first (its owner reaches none of it), from its front (its long documents
    first: nobody works through it from there); then r1's from its end; r3's and r4's stay
    with them, so the replica waits once those are taken. After the grace r4 counts as
    dead."""
    shares = pc.Shares(own=(), others={1: (1, 5, 9), 2: (2, 6), 3: (3, 7, 11, 15), 4: (4,)},
                       held={}, states={1: pc.STARTED, 2: pc.DEAD, 3: pc.LOADING})
    decision = pc.decide(shares, now=10.0, grace_until=60.0)
    assert decision.take == (2, 6, 9, 5, 1)
    assert decision.wait
    assert decision.why == ("r3 is loading and keeps its 4 partition(s) until it steps; "
                            "r4 has not beaten and keeps its 1 partition(s) for 50s more of "
                            "start-up grace")
    after_grace = pc.decide(shares, now=60.0, grace_until=60.0)
    assert after_grace.take == (2, 6, 4, 9, 5, 1)


def test_the_longest_list_is_the_one_its_owner_needs_longest_for():
    """r1 has 4 partitions left at 10 s each, r2 has 2 at 30 s each and 1 in hand: r2's
    90 s outlast r1's 40 s, so its last goes first, until the lists even out. A replica
    at 25 s a partition takes only while the owner would need longer than that for what
    it has left: r1's last two stay with r1."""
    shares = pc.Shares(own=(), others={1: (1, 3, 5, 7), 2: (2, 4)}, held={10: 2},
                       states={1: pc.STARTED, 2: pc.STARTED}, pace={1: 10.0, 2: 30.0})
    assert pc.decide(shares, 0.0, 0.0).take == (4, 2, 7, 5, 3, 1)
    slow = dataclasses.replace(shares, my_pace=25.0)
    decision = pc.decide(slow, 0.0, 0.0)
    assert decision.take == (4, 2, 7, 5)
    # With a partition's worth of rows still in hand, a partition taken now ends here in
    # 50 s: r1's last four (40 s) stay with r1 too.
    assert pc.decide(dataclasses.replace(slow, in_hand=1.0), 0.0, 0.0).take == (4, 2)
    slower = dataclasses.replace(shares, my_pace=100.0)
    decision = pc.decide(slower, 0.0, 0.0)
    assert decision.take == () and decision.wait
    assert decision.why.startswith("r1 gets through its last 4 partition(s) sooner than "
                                   "this replica would; r2 gets through its last 2")


def test_a_slow_replica_leaves_the_last_partitions_to_the_faster_ones():
    """Near the end, a replica three times slower than the typical one takes nothing it
    would finish after the others, at their pace, have got through what is left and half
    a partition more: they take it then and end sooner. Earlier, with much left, it takes."""
    end = pc.Shares(own=(), others={1: (1, 3, 5)}, held={10: 1, 12: 2},
                    states={1: pc.STARTED, 2: pc.STARTED, 3: pc.STARTED},
                    pace={1: 10.0, 2: 10.0, 3: 10.0}, my_pace=30.0)
    # 3 left + half of 2 in hand = 4 partitions over the 3 faster at 10 s: 13.3 s, + 5 < 30.
    decision = pc.decide(end, 0.0, 0.0)
    assert decision.take == () and decision.wait
    assert decision.why == ("a partition takes this replica 30s, longer than the faster "
                            "replicas take to finish the 4 left")
    early = dataclasses.replace(end, others={1: tuple(range(1, 40, 2))})
    assert pc.decide(early, 0.0, 0.0).take[:1] == (39,)  # 21 left: 70 s + 5 > 30
    # The rows it has still to write come first: with two partitions' worth in hand, one
    # taken now ends here in 90 s, after the faster replicas' 75; with one's, in 60.
    busy = pc.decide(dataclasses.replace(early, in_hand=2.0), 0.0, 0.0)
    assert busy.take == () and busy.wait
    assert busy.why == ("a partition taken now would end here in 90s (after the rows in "
                        "hand), later than the faster replicas finish the 21 left")
    assert pc.decide(dataclasses.replace(early, in_hand=1.0), 0.0, 0.0).take[:1] == (39,)
    typical = dataclasses.replace(end, my_pace=10.0)
    assert pc.decide(typical, 0.0, 0.0).take == (5, 3, 1)
    # Its own last partitions too: left to the faster replicas, which take them from its
    # list (they would reach them sooner than it would finish one).
    own = dataclasses.replace(end, own=(0, 4), others={1: (1,)})
    decision = pc.decide(own, 0.0, 0.0)
    assert decision.take == () and decision.wait and "finish the 4 left" in decision.why
    taker = pc.Shares(own=(), others={0: (0, 4)}, held={}, states={0: pc.STARTED},
                      pace={0: 30.0}, my_pace=10.0)
    assert pc.decide(taker, 0.0, 0.0).take == (4, 0)
    assert pc.decide(dataclasses.replace(own, own=tuple(range(0, 40, 4))), 0.0, 0.0).take[:2] \
        == (0, 4)  # with much left it takes its own, in order
    # Slower than the rest, but nobody faster is working: it takes, rather than wait for
    # replicas that are done, dead or loading.
    alone = dataclasses.replace(own, states={1: pc.DONE, 2: pc.DEAD, 3: pc.LOADING})
    assert pc.decide(alone, 0.0, 0.0).take == (0, 4)


def test_with_nothing_to_take_a_replica_waits_while_others_hold_work_else_ends():
    held = pc.Shares(own=(), others={}, held={7: 1, 9: 1}, states={1: pc.STARTED})
    decision = pc.decide(held, now=0.0, grace_until=0.0)
    assert decision.take == () and decision.wait
    assert decision.why == ("r1 is extracting 2 partition(s) (7, 9), taken over if its "
                            "heartbeat goes stale")
    done = pc.Shares(own=(), others={1: ()}, held={}, states={1: pc.DONE})
    assert pc.decide(done, now=0.0, grace_until=0.0) == pc.Decision((), wait=False)


def test_without_fill_slots_a_busy_host_takes_nothing_of_another_replicas():
    shares = pc.Shares(own=(), others={1: (1, 5)}, held={}, states={1: pc.STARTED})
    assert pc.decide(shares, 0.0, 0.0, idle=False, fill_slots=True).take == (5, 1)
    busy = pc.decide(shares, 0.0, 0.0, idle=False, fill_slots=False)
    assert busy.take == () and busy.wait
    assert pc.decide(shares, 0.0, 0.0, idle=True, fill_slots=False).take == (5, 1)


def test_claim_keys_and_generations():
    assert schedule.claim_key(JOB, 42) == layout.claim_key(JOB, 42)
    assert schedule.claim_key(JOB, 42, 2) == "claims/j/p-00042.2.json"
    assert schedule.claims_folder(JOB) + "p-00042.json" == layout.claim_key(JOB, 42)
    names = ["p-00003.json", "p-00003.1.json", "p-00004.json", "p-00005.2.json",
             "p-00005.json", "p-00005.1.json", "notes.json", "p-00006.json.tmp-1"]
    assert schedule.claim_generations(names) == {3: 1, 4: 0, 5: 2}


def test_own_order_starts_with_the_partitions_that_must_hold_a_long_chain(tmp_path):
    """A partition where few documents start holds a long chain: the packer's layout
    bears the bound out (chains read back from the token store, as a worker reads them);
    the manifest's columns, as prepare records them, give the longest chain's rows for a
    model of any warm-up (longest_doc_rows without one), and the partitions come in their
    replica's order longest chain first."""
    run = str(tmp_path / "run")
    lengths = (5, 16, 3, 80, 7, 32, 2, 192, 9, 11, 40, 4, 100, 6, 27, 1, 60, 300, 8, 2)
    token_runs.write_long_document_run(run, "unused", lengths=lengths, seq_len=16,
                                       partition_rows=8, rows_per_shard=4)
    m = manifest.read_manifest(store.open_store(run))
    tokens = prefetch.TokenStore(store.open_store(run).location)
    by_warmup = {}  # a model's warm-up rows -> each partition's longest chain
    for warmup in (0, 3, 100):
        longest = by_warmup[warmup] = {}
        for part in m.partitions:
            continues, positions = tokens.continuation_flags(part.row_start, part.row_stop)
            chains = schedule.chains(part.row_start, part.row_stop, continues, positions, 16,
                                     max_warmup_rows=warmup)
            longest[part.id] = max(len(c.rows) for c in chains)
            assert longest[part.id] >= pc.longest_chain_at_least(part), part
            assert longest[part.id] == pc.longest_chain(part, warmup), (warmup, part)
            if warmup == 0:
                assert part.longest_doc_rows == longest[part.id], part
        order = pc.own_order(m, [p.id for p in m.partitions], warmup)
        assert [longest[p] for p in order] == sorted(longest.values(), reverse=True)
        assert longest[order[0]] > longest[order[-1]]
        for n in set(longest.values()):  # ties keep the id order
            ties = [p for p in order if longest[p] == n]
            assert ties == sorted(ties)
    # The warm-up reorders: a document continued from the partition before makes the first
    # chain the longest of some partition.
    assert by_warmup[3] != by_warmup[0] and by_warmup[100] != by_warmup[3]
    longest = by_warmup[0]
    # A manifest without the columns (before version 3) orders by the bound from `docs`.
    old = dataclasses.replace(m, partitions=tuple(
        dataclasses.replace(p, longest_doc_rows=0, continued_doc_rows=0, continued_from_rows=0)
        for p in m.partitions))
    bounds = [pc.longest_chain_at_least(m.partition(p)) for p in pc.own_order(old, list(longest))]
    assert bounds == sorted(bounds, reverse=True) and bounds[0] > 1


def test_a_chooser_takes_its_own_in_the_order_its_models_warm_up_gives(tmp_path):
    """A worker's chooser orders by the manifest alone until its model loads
    (`order_by_warmup(0)`), then by the model's warm-up rows: its first claim is the
    partition whose continued document makes the longest chain with that warm-up."""
    parts = (manifest.Partition(0, 0, 8, 64, docs=2, longest_doc_rows=4),
             manifest.Partition(1, 8, 8, 64, docs=1, longest_doc_rows=3, continued_doc_rows=3,
                                continued_from_rows=9),
             manifest.Partition(2, 16, 8, 64, docs=4, longest_doc_rows=2))
    m = manifest.Manifest("f", 4, 24, 192, parts, {}, 10)
    c = chooser.Chooser(store.open_store(str(tmp_path)), m,
                        schedule.Topology(replicas=1, replica=0), JOB, "a0", steal=False)
    assert c.own == [0, 1, 2]
    c.order_by_warmup(2)  # chains: 4, 3 + 2, 2
    assert c.own == c.universe == pc.own_order(m, [0, 1, 2], 2) == [1, 0, 2]
    assert c.choose(set(), lambda pid: False) == 1


# -- the choice against a store ------------------------------------------------------------
def _manifest(n: int, rows: int = 8) -> manifest.Manifest:
    parts = tuple(manifest.Partition(i, i * rows, rows, rows * 4, docs=rows) for i in range(n))
    return manifest.Manifest("f", 4, n * rows, n * rows * 4, parts, {}, 10)


def _count_claim_reads(s) -> collections.Counter:
    """Counts the claims read through `s.read_many` (how a chooser reads holders), by key."""
    reads = collections.Counter()
    read_many = s.read_many

    def counted(keys, **kw):
        reads.update(k for k in keys if k.startswith(layout.CLAIMS_PREFIX))
        return read_many(keys, **kw)

    s.read_many = counted
    return reads


class _Clock:
    def __init__(self):
        self.now = time.time()

    def __call__(self):
        return self.now


def test_chooser_steals_waits_and_takes_over_a_dead_attempts_claims(tmp_path):
    """Replica 0 of 2 with partitions 0..9. It takes its own; replica 1 (started, attempt
    a1) holds 1 and 3 (its heartbeat names them): replica 0 takes r1's others from the
    end, then waits, saying why; when r1's heartbeat goes stale it takes 1 and 3 over (a
    claim of the next generation). A claim no heartbeat names (9) is read at the first look
    (one of the few oldest unnamed claims a look reads): it names an attempt this job does
    not know, and is left alone. Replica 1, restarted, counts the partitions of its list it
    finds taken as given up, by whom. No claim a heartbeat names is read."""
    s = store.open_store(str(tmp_path))
    clock = _Clock()
    m = _manifest(10)
    reads = _count_claim_reads(s)

    def is_committed(pid):
        return s.exists(layout.commit_key(pid))

    _beat(s, "h1", 1, "a1", now=clock.now, held=(1, 3))
    assert schedule.try_claim(s, JOB, 1, "a1") and schedule.try_claim(s, JOB, 3, "a1")
    assert schedule.try_claim(s, JOB, 9, "someone-else")
    r0 = chooser.Chooser(s, m, schedule.Topology(replicas=2, replica=0), JOB, "a0",
                                   clock=clock, refresh_s=0.0)
    _beat(s, "h0", 0, "a0", now=clock.now)
    tried: set[int] = set()
    assert [r0.choose(tried, is_committed) for _ in range(5)] == [0, 2, 4, 6, 8]
    assert [r0.choose(tried, is_committed) for _ in range(2)] == [7, 5]
    assert r0.choose(tried, is_committed) is None
    assert r0.why_waiting == ("r1 is extracting 2 partition(s) (1, 3), taken over if its "
                              "heartbeat goes stale")
    assert list(reads) == [schedule.claim_key(JOB, 9)]
    clock.now += 61
    _beat(s, "h0", 0, "a0", now=clock.now, held=tuple(sorted(tried)))
    assert sorted(r0.choose(tried, is_committed) for _ in range(2)) == [1, 3]
    assert s.read_json(schedule.claim_key(JOB, 1, 1))["attempt"] == "a0"
    assert s.read_json(schedule.claim_key(JOB, 1))["attempt"] == "a1"
    assert r0.choose(tried, is_committed) == -1  # 9 is someone else's: not waited for
    assert reads == {schedule.claim_key(JOB, 9): 1}  # read once
    assert dict(r0.stolen_from) == {"r1": 4}
    # Replica 1 again, while r0 extracts what it took: those are held by a live attempt.
    _beat(s, "h0", 0, "a0", now=clock.now, held=tuple(sorted(tried)))
    r1 = chooser.Chooser(s, m, schedule.Topology(replicas=2, replica=1), JOB, "a1b",
                                   clock=clock)
    assert r1.choose(set(), is_committed) is None
    assert dict(r1.given_up) == {"r0": 4, "?": 1}
    assert r1.why_waiting.startswith("r0 is extracting 9 partition(s) (0, 1, 2, 3, 4, ...)")
    for pid in tried:  # r0 commits them: nothing is left for r1 (9 is not its to wait for)
        s.create_json(layout.commit_key(pid), {})
    clock.now += pc.REFRESH_S  # its next look (it read 9 when it found it taken)
    assert r1.choose(set(), is_committed) == -1


def test_a_dead_attempts_partition_is_taken_over_before_the_own_list(tmp_path):
    """Replica 1's attempt died (its heartbeat stale) holding partition 1, claimed: replica
    0, with its own list still to do, takes 1 over first (a claim of the next generation),
    as soon as the heartbeat shows the death rather than once its own list is used up.
    A partition a live attempt holds is left alone."""
    s = store.open_store(str(tmp_path))
    clock = _Clock()
    m = _manifest(8)
    assert schedule.try_claim(s, JOB, 1, "a1") and schedule.try_claim(s, JOB, 3, "a3")
    _beat(s, "h1", 1, "a1", now=clock.now, age_s=120, held=(1,))     # dead
    _beat(s, "h3", 3, "a3", now=clock.now, held=(3,))                # live
    _beat(s, "h0", 0, "a0", now=clock.now)
    r0 = chooser.Chooser(s, m, schedule.Topology(replicas=4, replica=0), JOB, "a0",
                         clock=clock)
    tried: set[int] = set()
    assert [r0.choose(tried, lambda p: False) for _ in range(3)] == [1, 0, 4]
    assert s.read_json(schedule.claim_key(JOB, 1, 1))["attempt"] == "a0"
    assert not s.exists(schedule.claim_key(JOB, 3, 1))
    assert dict(r0.stolen_from) == {"r1": 1}


def test_a_slow_replica_looks_before_its_own_last_partition_and_leaves_it(tmp_path):
    """Replicas 1 and 2 step three times as fast as replica 0. Early on, replica 0 takes
    its own partition without a look. Near the end (the heartbeats say 11 of 12 partitions
    done), its last own partition would end the run late: it looks at the store instead of
    claiming it blind, leaves it and says why; replica 1, out of work, takes it."""
    s = store.open_store(str(tmp_path))
    clock = _Clock()
    m = _manifest(12)  # 32 tokens a partition
    topo = {r: schedule.Topology(replicas=3, replica=r) for r in range(3)}

    def beat_all(done: dict[int, int]) -> None:
        for r, rate in ((0, 1.0), (1, 3.0), (2, 3.0)):
            _beat(s, f"h{r}", r, f"a{r}", now=clock.now, tokens_per_s=rate,
                  partitions_done=done[r])

    def is_committed(pid):
        return s.exists(layout.commit_key(pid))

    beat_all({0: 0, 1: 0, 2: 0})
    r0 = chooser.Chooser(s, m, topo[0], JOB, "a0", clock=clock)
    tried: set[int] = set()
    assert r0.choose(tried, is_committed) == 0 and r0.looks == 0
    for pid in range(12):
        if pid != 9:
            assert pid == 0 or schedule.try_claim(s, JOB, pid, f"a{pid % 3}")
            s.create_json(layout.commit_key(pid), {})
    clock.now += 100
    beat_all({0: 3, 1: 4, 2: 4})
    assert r0.choose(tried, is_committed) is None
    assert r0.looks == 1 and not s.exists(schedule.claim_key(JOB, 9))
    assert r0.why_waiting == ("a partition takes this replica 32s, longer than the faster "
                              "replicas take to finish the 1 left")
    r1 = chooser.Chooser(s, m, topo[1], JOB, "a1", clock=clock)
    assert r1.choose({1, 4, 7, 10}, is_committed) == 9
    assert dict(r1.stolen_from) == {"r0": 1}


def test_a_slow_replica_counts_the_rows_in_hand_before_its_own_next_partition(tmp_path):
    """Replicas 1 and 2 step three times as fast as replica 0 (32 s a partition); the
    heartbeats say 16 of 24 partitions are done, and the store agrees. A partition of
    replica 0's alone would end in time (32 s, against the 8 left over the 2 faster
    replicas at 10.7 s each, plus half a partition: 48 s), but not after a partition's
    worth of rows in hand (64 s): with those it looks at the store, leaves its own next
    partition and says why. With a quarter of a partition in hand (40 s) it takes it
    without a look."""
    s = store.open_store(str(tmp_path))
    clock = _Clock()
    m = _manifest(24)  # 8 rows and 32 tokens a partition
    r0 = chooser.Chooser(s, m, schedule.Topology(replicas=3, replica=0), JOB, "a0",
                         clock=clock)
    tried: set[int] = set()
    assert r0.choose(tried, lambda pid: s.exists(layout.commit_key(pid))) == 0
    left = {3, 6, 9, 12, 15, 18, 21, 23}
    for pid in sorted(set(range(24)) - left):
        assert pid == 0 or schedule.try_claim(s, JOB, pid, f"a{pid % 3}")
        s.create_json(layout.commit_key(pid), {})
    clock.now += 100
    for r, rate, done in ((0, 1.0, 1), (1, 3.0, 8), (2, 3.0, 7)):
        _beat(s, f"h{r}", r, f"a{r}", now=clock.now, tokens_per_s=rate, partitions_done=done)

    def is_committed(pid):
        return s.exists(layout.commit_key(pid))

    assert r0.choose(tried, is_committed, idle=False, rows_in_hand=8) is None
    assert r0.looks == 1 and not s.exists(schedule.claim_key(JOB, 3))
    assert r0.why_waiting == ("a partition taken now would end here in 64s (after the rows "
                              "in hand), later than the faster replicas finish the 8 left")
    assert r0.choose(tried, is_committed, idle=False, rows_in_hand=2) == 3
    assert r0.looks == 1 and s.read_json(schedule.claim_key(JOB, 3))["attempt"] == "a0"


def test_the_heartbeats_progress_is_brought_to_now_at_their_rates(tmp_path):
    """A pod's heartbeats are seconds old when listed, and the listing is older still when
    used: what is left counts the work done since, at each started host's rate. Replica 0
    (a third of the others' speed) is told by 20 s old heartbeats that 7 of 12 partitions
    are done: as they were, 5 left, enough for its own; brought to now, under one: it looks
    at the store before its own last partition and leaves it."""
    s = store.open_store(str(tmp_path))
    clock = _Clock()
    m = _manifest(12)  # 32 tokens a partition
    topo = schedule.Topology(replicas=3, replica=0)
    rates = {0: 1.0, 1: 3.0, 2: 3.0}
    for r, rate in rates.items():
        _beat(s, f"h{r}", r, f"a{r}", now=clock.now, tokens_per_s=rate)
    r0 = chooser.Chooser(s, m, topo, JOB, "a0", clock=clock)
    tried: set[int] = set()
    assert r0.choose(tried, lambda pid: s.exists(layout.commit_key(pid))) == 0
    for pid in range(1, 12):
        if pid != 9:
            assert schedule.try_claim(s, JOB, pid, f"a{pid % 3}")
            s.create_json(layout.commit_key(pid), {})
    clock.now += 100
    done = {0: 2, 1: 3, 2: 2}
    for r, rate in rates.items():
        _beat(s, f"h{r}", r, f"a{r}", now=clock.now, tokens_per_s=rate,
              partitions_done=done[r])
    beats = pc.Beats.read(heartbeat.read_heartbeats(s, history=False), JOB, clock.now + 10, 60.0)
    # 12 - 7 done - (1 + 3 + 3) tokens/s x (10 s old when listed + 2 s since) / 32 a partition
    assert beats.partitions_left(12, 32.0, clock.now + 12) == pytest.approx(12 - 7 - 7 * 12 / 32)
    assert beats.partitions_left(12, 32.0, clock.now + 1_000) == 0.0
    clock.now += 20
    assert r0.choose(tried, lambda pid: s.exists(layout.commit_key(pid))) is None
    assert r0.looks == 1 and not s.exists(schedule.claim_key(JOB, 9))
    assert r0.why_waiting.startswith("a partition takes this replica 32s, longer than")


def test_a_look_reads_few_unnamed_claims_and_waits_for_the_others(tmp_path):
    """Replica 1's 12 partitions were claimed by attempts no heartbeat names (made since
    their holders last beat, as far as a look can tell). A look reads the oldest
    UNNAMED_CLAIM_READS_A_LOOK of them, whatever their number, and waits on the others as
    held; the next look reads the rest, and none is read twice. What a host reads a look
    does not grow with the hosts claiming."""
    s = store.open_store(str(tmp_path))
    clock = _Clock()
    m = _manifest(24)
    reads = _count_claim_reads(s)
    for pid in range(1, 24, 2):
        assert schedule.try_claim(s, JOB, pid, f"x{pid}")
    # Replica 1 started, beating every 2 s; its heartbeat names none of them.
    _beat(s, "h1", 1, "a1", now=clock.now, interval_s=2.0)
    r0 = chooser.Chooser(s, m, schedule.Topology(replicas=2, replica=0), JOB, "a0",
                         clock=clock, refresh_s=1.0)
    tried: set[int] = set()
    assert [r0.choose(tried, lambda p: False) for _ in range(12)] == list(range(0, 24, 2))
    first = request_budget.UNNAMED_CLAIM_READS_A_LOOK
    assert r0.choose(tried, lambda p: False) is None
    assert sum(reads.values()) == first < 12
    assert r0.why_waiting.endswith(f"{12 - first} partition(s) "
                                   f"({', '.join(map(str, range(2 * first + 1, 24, 2)))}) "
                                   f"were claimed by hosts whose heartbeats do not name them yet")
    assert r0.choose(tried, lambda p: False) is None  # the same look: nothing read
    assert sum(reads.values()) == first
    clock.now += 1.0
    assert r0.choose(tried, lambda p: False) == -1  # the rest read: another job's attempts
    assert sorted(reads) == sorted(schedule.claim_key(JOB, p) for p in range(1, 24, 2))
    assert set(reads.values()) == {1}


def test_without_steal_the_choice_is_the_replicas_own_list_unclaimed(tmp_path):
    s = store.open_store(str(tmp_path))
    m = _manifest(6)
    c = chooser.Chooser(s, m, schedule.Topology(replicas=3, replica=1), JOB, "a",
                                  steal=False)
    tried: set[int] = set()
    assert [c.choose(tried, lambda p: p == 4) for _ in range(2)] == [1, -1]
    assert s.list(layout.CLAIMS_PREFIX) == []


# -- the heartbeat's new fields ------------------------------------------------------------
def test_heartbeats_without_the_sharing_fields_still_read(tmp_path):
    s = store.open_store(str(tmp_path))
    old = {"host": "h", "replica": 0, "process_index": 0, "state": "done", "attempt": "a",
           "updated_at": 1.0, "partitions_done": 3, "job": "j"}
    s.write_json(layout.heartbeat_key("h"), old)
    (hb,) = heartbeat.read_heartbeats(s)
    assert (hb.stolen_from, hb.given_up, hb.idle_reason) == ({}, {}, "")
    new = dataclasses.replace(hb, stolen_from={"r1": 2}, given_up={"r3": 1},
                              idle_reason="r1 is loading")
    assert config_lib.from_dict(heartbeat.Heartbeat, json.loads(heartbeat.summary(new))) == new


def test_a_heartbeat_names_at_most_16_replicas_per_counter():
    counts = {f"r{i}": i + 1 for i in range(512)}
    kept = progress._largest(counts)
    assert len(kept) == progress.MAX_NAMED_REPLICAS and sum(kept.values()) == sum(counts.values())
    assert kept["r511"] == 512 and "r0" not in kept
    hb = heartbeat.Heartbeat(host="h" * 40, replica=511, process_index=0, state="working",
                             attempt="a" * 60, updated_at=0.0, stolen_from=kept,
                             given_up=kept, idle_reason="x" * 400)
    assert len(heartbeat.summary(hb)) < 4096  # GCS custom metadata: 8 KB per object


# -- real workers ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_docs(tmp_path_factory):
    """4 partitions of 2 documents of 16 rows (fewer chains than 8 slots), a tiny model, and
    the reference bytes of one process."""
    root = tmp_path_factory.mktemp("fair")
    model = str(hf_models.make_tiny_checkpoint(root / "qwen2", "qwen2"))
    ref = str(root / "ref")
    spec, _ = token_runs.write_long_document_run(
        ref, model, seq_len=16, max_context=64, lengths=[16 * 16] * 8,
        hooks="layers.1.resid_post", rows_per_shard=16, partition_rows=32)
    code, out = worker_procs.run_worker(["--run", ref, "--batch-size", "8"], devices=1)
    assert code == 0, out
    return ref, spec.fingerprint


def _markers(run: str) -> dict[int, commit.CommitMarker]:
    s = store.open_store(run)
    return {p: commit.read_marker(s, p) for p in commit.committed_partitions(s)}


def test_two_local_hosts_each_extract_half(long_docs, tmp_path):
    """Issue 50's held-out case, through the local launcher as `actx submit` runs it: 2
    hosts (replicas of one host), 8 slots each, partitions of 2 long documents. A host
    that loads first no longer takes the partitions of the other: each extracts 2
    partitions, half the tokens, and the bytes are one process's."""
    from actx.deploy import config as config_lib_deploy
    from actx.deploy import local

    ref, fingerprint = long_docs
    run = worker_procs.copy_token_store(ref, str(tmp_path / "run"))
    target = config_lib_deploy.TargetConfig(kind="local", hosts=2, batch_size=8,
                                            heartbeat_s=1.0)
    out = io.StringIO()
    assert local.run_workers(run, target, fingerprint, job="two", out=out) == 0, out.getvalue()
    beats = {hb.host: hb for hb in heartbeat.read_heartbeats(store.open_store(run))}
    total = manifest.read_manifest(store.open_store(run)).total_tokens
    assert sorted(beats) == ["local-r0h0", "local-r1h0"]
    for hb in beats.values():
        assert abs(hb.tokens_done - total / 2) <= 0.25 * total / 2, (hb.host, hb.tokens_done)
        assert (hb.state, hb.partitions_done, hb.stolen_from, hb.given_up, hb.idle_reason) \
            == ("done", 2, {}, {}, ""), hb
    assert {p: m.attempt.split("-")[1] for p, m in _markers(run).items()} == \
        {0: "r0h0", 1: "r1h0", 2: "r0h0", 3: "r1h0"}
    worker_procs.assert_same_activations(run, ref)


def _replica_0_of_2(run: str):
    """A stealing worker process of replica 0 of 2 (1 device, as the reference's)."""
    return worker_procs.start_worker(
        ["--run", run, "--batch-size", "8", "--replicas", "2", "--replica", "0", "--steal",
         "--job", JOB, "--heartbeat-s", "1", "--host-name", "w-r0h0"], devices=1)


def test_a_dead_replicas_claimed_partition_is_taken_over(long_docs, tmp_path):
    """Replica 1 failed holding partition 1 (its heartbeat says so, its claim stands):
    replica 0 does its own, steals 3 and takes 1 over, with the reference bytes."""
    ref, _ = long_docs
    run = worker_procs.copy_token_store(ref, str(tmp_path / "run"))
    s = store.open_store(run)
    _beat(s, "gone-r1h0", 1, "gone", state="failed")
    assert schedule.try_claim(s, JOB, 1, "gone")
    code, out = worker_procs.finish(_replica_0_of_2(run))
    assert code == 0, out
    assert sorted(_markers(run)) == [0, 1, 2, 3]
    beat = s.read_json(layout.heartbeat_key("w-r0h0"))
    assert s.read_json(schedule.claim_key(JOB, 1, 1))["attempt"] == beat["attempt"]
    assert beat["stolen_from"] == {"r1": 2} and beat["partitions_done"] == 4
    worker_procs.assert_same_activations(run, ref)


def test_a_host_waiting_for_another_replica_says_why_and_stops_on_sigterm(long_docs,
                                                                           tmp_path):
    """Replica 1 never starts: replica 0 does its own partitions, then waits out the
    start-up grace rather than take r1's; its heartbeat names why, and a stop signal ends
    the wait at once (nothing was in hand)."""
    ref, _ = long_docs
    run = worker_procs.copy_token_store(ref, str(tmp_path / "run"))
    proc = _replica_0_of_2(run)
    key = layout.heartbeat_key("w-r0h0")
    deadline = time.monotonic() + 120
    while True:
        beat = store.open_store(run).read_json(key) or {}
        if beat.get("idle_reason") and beat.get("partitions_done") == 2:  # own committed
            break
        assert proc.poll() is None and time.monotonic() < deadline, (beat, proc.poll())
        time.sleep(0.2)
    assert beat["idle_reason"].startswith("r1 has not beaten and keeps its 2 partition(s) "
                                          "for "), beat
    assert beat["state"] == "idle" and beat["partitions_done"] == 2
    proc.send_signal(signal.SIGTERM)
    code, out = worker_procs.finish(proc, timeout=60)
    assert code == 143, out
    assert sorted(_markers(run)) == [0, 2]
    assert store.open_store(run).read_json(key)["state"] == "preempted"
