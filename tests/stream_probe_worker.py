"""`python -m workers.main`, recording when partitions' steps are dispatched and commits are
submitted (run by tests/test_worker_pipeline.py on multi-host replicas).

Usage: ACTX_STREAM_PROBE=FILE [ACTX_AGREEMENT_WINDOW=N] python -m tests.stream_probe_worker
WORKER ARGS... (ACTX_AGREEMENT_WINDOW: a narrower `stream_loop.AGREEMENT_WINDOW`, so a few
partitions cross it.)
Each line of FILE: "dispatch ROW" when the dispatching thread takes a step that stores row
ROW, "commit PID" when the worker submits partition PID's commit.
"""

from __future__ import annotations

import os
import sys

from workers import commit, main, prefetch, stream_loop


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

    prefetch.Prefetcher.__iter__ = iterate
    commit.Committer.submit = submitted


if __name__ == "__main__":
    _probe(os.environ["ACTX_STREAM_PROBE"])
    if os.environ.get("ACTX_AGREEMENT_WINDOW"):
        stream_loop.AGREEMENT_WINDOW = int(os.environ["ACTX_AGREEMENT_WINDOW"])
    sys.exit(main.main())
