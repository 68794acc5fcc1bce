"""Progress of a running prepare, for the person waiting on it.

Each tokenized unit leaves a small record in the run directory (`prepare/progress/`,
removed with the unit tokens once the run is prepared); the driver reads the new ones at a
steady interval and logs one line: documents and tokens done, the rate, files done of
total, partitions written. The same numbers are Beam counters (namespace actx.prepare),
which Dataflow shows while the job runs.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from actx.schemas import layout
from actx.schemas import run_dir
from actx.schemas import store as store_lib

PROGRESS_PREFIX = "prepare/progress/"
DEFAULT_INTERVAL_S = 10.0
_log = logging.getLogger("actx.prepare")


def report_unit(store: store_lib.ObjectStore, unit, docs: int, tokens: int) -> None:
    store.write(f"{PROGRESS_PREFIX}{unit.unit_id}.json", json.dumps(
        {"file": unit.path, "source_index": unit.source_index,
         "units_in_file": unit.units_in_file, "docs": docs, "tokens": tokens}).encode())


class Reporter:
    """Logs a progress line every `interval_s` seconds from a background thread."""

    def __init__(self, run: run_dir.RunDir, n_files: int, interval_s: float = DEFAULT_INTERVAL_S):
        self.store = run.store
        self.n_files, self.interval_s = n_files, interval_s
        self.seen: dict[str, dict] = {}
        self.started = time.monotonic()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="prepare-progress", daemon=True)

    def __enter__(self) -> "Reporter":
        self.thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop_event.set()
        self.thread.join()
        if exc_type is None:  # the final count, once every worker has reported
            _log.info("%s", self.line())

    def _loop(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            try:
                _log.info("%s", self.line())
            except Exception as e:  # noqa: BLE001 - progress must never fail the run
                _log.debug("prepare: progress unavailable: %s", e)

    def line(self) -> str:
        """One progress line from what the workers have reported so far."""
        new = [k for k in self.store.list(PROGRESS_PREFIX) if k not in self.seen]
        for key, data in zip(new, self.store.read_many(new)):
            if data is not None:
                self.seen[key] = json.loads(data)
        docs = sum(r["docs"] for r in self.seen.values())
        tokens = sum(r["tokens"] for r in self.seen.values())
        per_file: dict[tuple, list] = {}
        for r in self.seen.values():
            per_file.setdefault((r["source_index"], r["file"]), []).append(r["units_in_file"])
        files_done = sum(1 for v in per_file.values() if len(v) >= v[0])
        written = len(self.store.list(layout.DOCS_PREFIX))
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return (f"prepare: {docs:,} docs, {tokens:,} tokens tokenized ({tokens / elapsed:,.0f} "
                f"tokens/s); files {files_done}/{self.n_files} done; {written} partition(s) "
                f"written; {elapsed:.0f}s")
