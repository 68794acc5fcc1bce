"""The chain schedule: a long document's rows through one slot, in order, every row once.

Checked against the rows themselves (which rows exist, which continue which), not against
the scheduler's own bookkeeping.
"""

from __future__ import annotations

import numpy as np

from actx.workers.loop import schedule


def _partitions(seed: int, n_parts: int = 5, rows: int = 12):
    """Random continuation flags per partition (True: the row continues the row above)."""
    rng = np.random.default_rng(seed)
    parts = {}
    for p in range(n_parts):
        lo = p * rows
        flags = rng.random(rows) < 0.6
        positions = np.where(flags, 16 * rng.integers(1, 4, rows), 0)
        parts[p] = (lo, lo + rows, flags, positions)
    return parts


def _check_slots(steps, parts, local_batch):
    """Every row of every partition written exactly once; a row that continues the row
    above runs with `continues` set, in the slot that ran that row in the previous step;
    a row that starts a document runs with `continues` unset."""
    written = [r for s in steps for r, w in zip(s.rows, s.write) if w]
    want = [r for lo, hi, _, _ in parts.values() for r in range(lo, hi)]
    assert sorted(written) == want
    continues_row = {lo + i: bool(f) for lo, _, flags, _ in parts.values()
                     for i, f in enumerate(flags)}
    for j in range(local_batch):
        last = None
        for s in steps:
            row = s.rows[j]
            if s.write[j]:
                assert s.continues[j] == continues_row[row], (j, row)
            if s.continues[j]:
                assert last is not None and row == last + 1, (j, row, last)
            last = row


def test_stream_writes_every_row_once_and_keeps_chains_in_one_slot():
    parts = _partitions(0)
    chains = {p: schedule.chains(lo, hi, flags, positions, 16)
              for p, (lo, hi, flags, positions) in parts.items()}
    order = iter(sorted(parts))

    def next_partition():
        p = next(order, None)
        return None if p is None else (p, chains[p])

    steps = list(schedule.stream(next_partition, 4))
    _check_slots(steps, parts, 4)
    # Work-conserving: while any chain is still waiting, no slot runs padding.
    total = sum(len(c.rows) for cs in chains.values() for c in cs)
    padding = sum(1 for s in steps for p in s.partitions if p < 0)
    assert len(steps) * 4 == total + padding
    assert padding < 4 * max(len(c.rows) for cs in chains.values() for c in cs)


def test_a_slice_that_starts_inside_a_document_warms_up_from_its_first_row():
    flags = np.array([True, True, False, True])
    positions = np.array([48, 64, 0, 16])  # the first row is the document's 4th (48 / 16)
    chains = schedule.chains(100, 104, flags, positions, 16)
    assert chains[0] == schedule.Chain((97, 98, 99, 100, 101), warmup=3)
    assert chains[1:] == [schedule.Chain((102, 103))]
    steps = schedule.assign(chains, 2, 100)
    _check_slots(steps, {0: (100, 104, flags, positions)}, 2)
    assert [r for s in steps for r, w in zip(s.rows, s.write) if not w and r < 100] == \
        [97, 98, 99]


def test_longest_chain_first_bounds_the_steps_by_the_longest_chain():
    chains = [schedule.Chain((r,)) for r in range(6)] + [schedule.Chain(tuple(range(6, 14)))]
    steps = schedule.assign(chains, 2, 0)
    assert len(steps) == 8  # not 3 + 8: the 8-row chain starts in the first step


def test_stream_pads_until_told_to_stop_once_the_work_is_out():
    """A host of a multi-host replica keeps stepping (padding, marked done) until every
    host is out of work; nothing after the last real step is written."""
    parts = iter([(0, [schedule.Chain((0, 1, 2))]), (1, [])])  # partition 1: none here
    steps = schedule.stream(lambda: next(parts, None), 2, pad_forever=True)
    first = [next(steps) for _ in range(6)]
    assert [s.done for s in first] == [False, False, False, True, True, True]
    assert [r for s in first for r, w in zip(s.rows, s.write) if w] == [0, 1, 2]
    assert all(not any(s.write) and set(s.partitions) == {-1} for s in first[3:])


def test_stream_pads_the_free_slots_while_the_next_partition_is_not_yet_chosen():
    """A host whose leader has not chosen the next partition (NOT_YET) runs padding in its
    free slots, not marked done, and asks again at the next step; the busy slot goes on."""
    answers = iter([(0, [schedule.Chain((0, 1, 2)), schedule.Chain((3,))]),
                    schedule.NOT_YET, schedule.NOT_YET,
                    (1, [schedule.Chain((4,))]), None])
    asked = []

    def next_partition():
        asked.append(True)
        return next(answers)

    steps = list(schedule.stream(next_partition, 2))
    assert [s.rows for s in steps] == [(0, 3), (1, 0), (2, 0), (4, 0)]
    assert [s.write for s in steps] == [(True, True), (True, False), (True, False),
                                        (True, False)]
    assert [s.partitions for s in steps] == [(0, 0), (0, -1), (0, -1), (1, -1)]
    assert not any(s.done for s in steps)
    assert len(asked) == 5  # 0; NOT_YET at steps 2 and 3; at step 4: 1, then None

    # Nothing chosen yet at the start: padding steps until the partition comes.
    answers = iter([schedule.NOT_YET, (0, [schedule.Chain((5,))]), None])
    steps = list(schedule.stream(lambda: next(answers), 2, pad_forever=False))
    assert [(s.rows, s.write) for s in steps] == [((0, 0), (False, False)),
                                                   ((5, 0), (True, False))]
