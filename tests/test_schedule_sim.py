"""Work sharing between replicas, simulated: the real partition choice and step stream
driven with fake clocks and heartbeats (tests/schedule_sim.py), over FineWeb-like
documents, with start-up delays, different speeds, slow hosts, a stall, deaths and a
replica that never starts. Checked against the fluid ideal (every slot busy from each
replica's first step, the work cut anywhere), which no real schedule can beat, and against
the rules the choice must keep, read from the claims and commits the replicas made."""

from __future__ import annotations

import dataclasses

import os

import pytest

from actx.schemas import request_budget

from tests import schedule_sim as sim


@pytest.fixture(scope="module")
def fineweb():
    """96 partitions a replica for 64 replicas (6,144 partitions of 32 rows of 1024
    tokens, ~8 steps of a host's 8 slots each, a replica's run ~12 times its longest
    chains); smaller runs take the first ones."""
    return sim.fineweb_like(64 * 96, partition_rows=32)


def _check_every_partition_committed_once(out: sim.Outcome, workload: sim.Workload):
    assert sorted(out.committed_by) == [p.id for p in workload.manifest.partitions]
    assert out.duplicates == 0


def _check_kept_while_loading(out: sim.Outcome, replicas: list[sim.Replica],
                              grace_s: float = 60.0):
    """No partition of a replica was taken by another before that replica stepped (or,
    for one that never beat, before the taker's start-up grace ended)."""
    n = len(replicas)
    for t, taker, pid in out.claims:
        owner = pid % n
        if taker == owner:
            continue
        if replicas[owner].beats:
            assert t >= out.first_step[owner], (pid, taker, t, out.first_step[owner])
        else:
            assert t >= replicas[taker].start + grace_s, (pid, taker, t)


def test_64_replicas_each_do_their_share_and_end_near_the_ideal(fineweb):
    """No deaths: processes starting over 20 s, 20-90 s of loading, speeds within 15%, two
    hosts at a third of the speed, one that stalls for 40 s. Every replica does within 10%
    of its share, the run ends within 5% of the ideal makespan, no partition is extracted
    twice, and no replica takes from one that is still loading."""
    replicas = sim.mixed_replicas(64, stragglers=2)
    out = sim.simulate(fineweb, replicas)
    _check_every_partition_committed_once(out, fineweb)
    for r, share in out.share.items():
        assert abs(out.work[r] - share) <= 0.10 * share, (r, out.work[r], share)
    assert out.makespan <= 1.05 * out.ideal, out.summary()
    _check_kept_while_loading(out, replicas)
    assert sum(sum(s.values()) for s in out.stolen.values()) > 0  # the slow ones were helped
    slow = [r for r, spec in enumerate(replicas) if spec.step_s > 2]
    assert all(sum(s.get(f"r{r}", 0) for s in out.stolen.values()) > 0 for r in slow)
    print(f"\n64 replicas: {out.summary()}")


def test_a_dead_replicas_partitions_are_finished_by_the_others_after_stale_after(fineweb):
    """One of 16 replicas dies silently at 200 s (no last heartbeat). Everything is
    committed once; the partitions it held when it died are taken over, but only after its
    heartbeat is stale_after old; its partitions it never reached are taken by the others."""
    workload = sim.subset(fineweb, 16 * 96)
    replicas = sim.mixed_replicas(16, stragglers=1, deaths=1, die_at=200.0)
    (dead,) = [r for r, spec in enumerate(replicas) if spec.dies_at is not None]
    out = sim.simulate(workload, replicas, stale_after_s=60.0, heartbeat_s=2.0)
    _check_every_partition_committed_once(out, workload)
    held_at_death = {pid for t, r, pid in out.claims if r == dead} - {
        pid for pid, r in out.committed_by.items() if r == dead}
    assert held_at_death  # it died with partitions in hand
    last_beat = 200.0 - 2.0  # its heartbeats came every 2 s up to its death
    for t, taker, pid in out.claims:
        if pid in held_at_death and taker != dead:
            assert t >= last_beat + 60.0, (pid, taker, t)
    assert {out.committed_by[p] for p in held_at_death} - {dead}
    never_reached = [p.id for p in workload.manifest.partitions if p.id % 16 == dead
                     and p.id not in {pid for _, r, pid in out.claims if r == dead}]
    assert never_reached and all(out.committed_by[p] != dead for p in never_reached)
    assert sum(s.get(f"r{dead}", 0) for s in out.stolen.values()) >= len(never_reached)
    print(f"\n16 replicas, one dead at 200 s: {out.summary()}")


def test_a_host_dying_right_after_its_first_claim_has_it_taken_over_once_stale(fineweb):
    """One of 16 replicas dies half a second after its first claim (an out-of-memory first
    step), between two heartbeats: the first partition it claimed (its longest chains) is
    named at once (workers.loop.progress.Progress.hold), so it is taken over as soon as
    the host is stale (60 s), not found by a look once the others' own lists run out."""
    workload = sim.subset(fineweb, 16 * 96)
    replicas = [sim.Replica(start=0.0, load=31.0, step_s=1.0) for _ in range(16)]
    replicas[5] = dataclasses.replace(replicas[5], dies_at=31.5)  # beats at 30 s and 32 s
    out = sim.simulate(workload, replicas, stale_after_s=60.0, heartbeat_s=2.0)
    _check_every_partition_committed_once(out, workload)
    mine = [pid for t, r, pid in out.claims if r == 5]
    again = min(t for t, r, pid in out.claims if pid == mine[0] and r != 5)
    # The dead one's partitions it never claimed are taken by looks, once the others' own
    # lists run out: the tail, where a partition of long chains ends the run late.
    tail = min(t for t, r, pid in out.claims if pid % 16 == 5 and pid not in mine)
    # Stale 60 s after the beat that named it; seen at the next heartbeat listing; taken
    # when a trier next chooses (a partition here is a few steps of 1 s).
    assert 31.0 + 60.0 <= again <= 31.0 + 60.0 + 2 * 2.0 + 8.0 < tail, (again, tail)
    print(f"\n16 replicas, one dead right after its first claim: {out.summary()}; taken "
          f"over at {again:.0f}s")


def test_a_replica_that_never_beats_keeps_its_partitions_for_the_start_up_grace(fineweb):
    """Replica 3 of 8 never starts; the others, done with their own in under a minute,
    wait out the grace (saying why), then finish its partitions."""
    workload = sim.subset(fineweb, 8 * 3)
    replicas = [sim.Replica(start=0.0, load=20.0 + 5 * r) for r in range(8)]
    replicas[3] = dataclasses.replace(replicas[3], beats=False)
    out = sim.simulate(workload, replicas, start_grace_s=60.0)
    _check_every_partition_committed_once(out, workload)
    _check_kept_while_loading(out, replicas, grace_s=60.0)
    assert all(r != 3 for r in out.committed_by.values())
    # Until the grace ended the others said why they waited, naming the silent replica.
    assert any("r3 has not beaten" in why for whys in out.idle_reasons.values()
               for why in whys)


def _few_long_documents(n_partitions: int, docs: int, rows: int) -> sim.Workload:
    """Partitions of `docs` documents of `rows` rows each: fewer chains than a host's slots."""
    from actx.schemas import manifest as manifest_lib
    from actx.workers.loop import schedule

    per = docs * rows
    parts, chains = [], {}
    for pid in range(n_partitions):
        lo = pid * per
        chains[pid] = [schedule.Chain(tuple(range(lo + d * rows, lo + (d + 1) * rows)))
                       for d in range(docs)]
        parts.append(manifest_lib.Partition(pid, lo, per, per * 64, docs))
    m = manifest_lib.Manifest("sim", 64, n_partitions * per, n_partitions * per * 64,
                              tuple(parts), {}, 0)
    return sim.Workload(m, chains, 64)


@pytest.mark.parametrize("r0_load", [30.0, 31.0, 90.0])
def test_two_hosts_with_few_long_documents_each_extract_half(r0_load):
    """The held-out case: 2 replicas, 4 partitions of 2 documents of 32 rows, 8 slots a
    host (a host wants 4 partitions to fill its slots). Whichever loads first takes its own
    two partitions and runs with half its slots busy rather than take the other's, even
    when the other loads a minute later: each extracts half."""
    workload = _few_long_documents(4, docs=2, rows=32)
    replicas = [sim.Replica(load=r0_load), sim.Replica(load=30.0)]
    out = sim.simulate(workload, replicas)
    _check_every_partition_committed_once(out, workload)
    assert sorted(out.committed_by.items()) == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert out.stolen == {0: {}, 1: {}}
    assert out.makespan == pytest.approx(max(r0_load, 30.0) + 32, abs=1e-6)
    if r0_load > 31:
        assert "r0 is loading and keeps its N partition(s) until it steps" in \
            out.idle_reasons[1]



# Control traffic: what is not data (shards, markers) nor per partition taken (claims).
CONTROL = ("heartbeats", "logs", "metadata", "status")
TAIL = ("heartbeats", "claims", "markers")  # what the choosers' looks list


@pytest.fixture(scope="module")
def pod():
    """1,024 replicas of one host, 12 partitions of 128 rows each (16 steps of 8 slots a
    partition), started over 20 s, loading for 20-90 s, 10 at a third of the speed, one
    that stalls, and 5% (51) dying silently at 100 s."""
    # About 16 minutes of one core on the 2-core CI machine (the simulator parses every
    # replica's heartbeat summary at each look): opt-in, so `.ci/run` stays under 20 min.
    if os.environ.get("ACTX_POD_SIM") != "1":
        pytest.skip("the 1,024-replica pod simulation takes ~16 min here; "
                    "ACTX_POD_SIM=1 python3 -m pytest tests/test_schedule_sim.py runs it")
    workload = sim.fineweb_like(1024 * 12, partition_rows=128)
    replicas = sim.mixed_replicas(1024, stragglers=10, deaths=51, die_at=100.0)
    return workload, replicas, sim.simulate(workload, replicas)


def test_a_pods_control_traffic_is_small_and_flat(pod):
    """Issue 63 at 1,024 hosts: heartbeats, logs and metadata stay <= 200 writes/s; their
    reads and the launcher's status polls <= 1,000 requests/s; the tail's looks <= 5,000
    list pages/s, in any 10 s of the run; no object name is written more than once a
    second over the run, the metadata once; claims cost about one write a partition, and
    the claims a replica reads do not grow with the pod (a holder comes from the
    heartbeats; a look reads at most a few claims none names yet)."""
    workload, replicas, out = pod
    _check_every_partition_committed_once(out, workload)
    totals = out.totals()
    writes = out.peak_per_s(("write",), CONTROL)
    reads = out.peak_per_s(("read",), CONTROL + ("claims",)) + out.peak_per_s(("list",), ("status",))
    tail = out.peak_per_s(("list",), TAIL)
    assert writes <= 200, totals
    assert reads <= 1_000, totals
    assert tail <= 5_000, totals
    assert max(out.writes_of.values()) <= out.makespan, out.writes_of.most_common(3)
    assert all(out.writes_of[key] == 1 for key in sim.METADATA_KEYS)
    n = len(workload.manifest.partitions)
    assert totals[("claims", "write")] <= 1.25 * n, totals
    # A look reads a few claims whose holder no heartbeat names yet, however many replicas
    # claim: a host's claim reads are bounded by its looks, not by the pod.
    cap = request_budget.UNNAMED_CLAIM_READS_A_LOOK
    assert all(out.holders_read[r] <= cap * out.looks[r] for r in out.looks)
    per_replica = totals.get(("claims", "read"), 0) / len(replicas)
    print(f"\n1,024 replicas: {out.summary()}; peak control writes {writes:.0f}/s, control "
          f"reads {reads:.0f}/s, tail list pages {tail:.0f}/s; claims read {per_replica:.1f} a "
          f"replica, in {sum(out.looks.values()) / len(replicas):.1f} looks")


def test_a_pods_makespan_is_within_5_percent_of_the_ideal(pod):
    """Issue 63: the tail, with its looks spaced to the bucket's budget, and 5 % of the
    replicas dying, costs at most 5 % over the fluid ideal (which cuts partitions and
    chains anywhere: nothing real reaches it)."""
    workload, replicas, out = pod
    assert out.makespan <= 1.05 * out.ideal, out.summary()
