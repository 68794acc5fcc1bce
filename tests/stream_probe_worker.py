"""`python -m actx.workers.main`, recording when partitions' steps are dispatched and commits are
submitted (run by tests/test_worker_pipeline.py on multi-host replicas).

Usage: ACTX_STREAM_PROBE=FILE python -m tests.stream_probe_worker WORKER ARGS...
Each line of FILE: "dispatch ROW" when the dispatching thread takes a step that stores row
ROW, "commit PID" when the worker submits partition PID's commit, "not-yet" when the
leader's next partition was not yet chosen when this host asked, "choose IDLE ROWS PID" when
this host's partition choice (the leader's) was asked with IDLE (1: nothing in hand) and
ROWS (rows in hand still to write) and answered PID (-2: nothing yet).
Settings for the test, in the environment: ACTX_AGREEMENT_WINDOW (a narrower
`partition_stream.AGREEMENT_WINDOW`, so partitions cross it), ACTX_LEADER_LOOKAHEAD
(`distributed.LeaderSequence.LOOKAHEAD`), ACTX_CHOICE_FAILS_AFTER=N (the leader's N+1-th
partition choice raises).
"""

from __future__ import annotations

import os
import sys

from actx.workers import main
from actx.workers.loop import prefetch, runner, partition_stream
from actx.workers.replicas import distributed
from actx.workers.write import commit


def _probe(path: str) -> None:
    out = open(path, "a", buffering=1)
    batches = prefetch.Prefetcher.__iter__

    def iterate(self):  # the dispatching thread takes each batch just before its step
        for batch in batches(self):
            for row, write in zip(batch.step.rows, batch.step.write):
                if write:
                    out.write(f"dispatch {row}\n")
            yield batch

    submit = commit.Committer.submit

    def submitted(self, part, *args, **kwargs):
        out.write(f"commit {part.id}\n")
        return submit(self, part, *args, **kwargs)

    leader_next = distributed.LeaderSequence.next

    def asked(self):
        value = leader_next(self)
        if value is None:
            out.write("not-yet\n")
        return value

    choose = runner.Worker.choose_partition

    def chose(self, tried, idle=True, rows_in_hand=0):
        pid = choose(self, tried, idle, rows_in_hand)
        out.write(f"choose {int(idle)} {rows_in_hand} {-2 if pid is None else pid}\n")
        return pid

    runner.Worker.choose_partition = chose
    prefetch.Prefetcher.__iter__ = iterate
    commit.Committer.submit = submitted
    distributed.LeaderSequence.next = asked


def _settings(env) -> None:
    if env.get("ACTX_START_GRACE_S"):  # a replica that never starts: no wait for it
        from actx.workers.replicas import choice_policy

        choice_policy.START_GRACE_S = float(env["ACTX_START_GRACE_S"])
    if env.get("ACTX_AGREEMENT_WINDOW"):
        partition_stream.AGREEMENT_WINDOW = int(env["ACTX_AGREEMENT_WINDOW"])
    if env.get("ACTX_LEADER_LOOKAHEAD"):
        distributed.LeaderSequence.LOOKAHEAD = int(env["ACTX_LEADER_LOOKAHEAD"])
    if env.get("ACTX_CHOICE_FAILS_AFTER"):
        choose, calls = runner.Worker.choose_partition, []

        def failing(self, tried, idle=True, rows_in_hand=0):
            calls.append(1)
            if len(calls) > int(env["ACTX_CHOICE_FAILS_AFTER"]):
                raise OSError("claims store unreachable (test)")
            return choose(self, tried, idle, rows_in_hand)

        runner.Worker.choose_partition = failing


if __name__ == "__main__":
    _probe(os.environ["ACTX_STREAM_PROBE"])
    _settings(os.environ)
    sys.exit(main.main())
