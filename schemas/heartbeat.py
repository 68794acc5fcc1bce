"""Worker heartbeats: `workers/<host>.json`, the only live signal of a worker's progress.

GCS allows about one write per second to one object, so a writer never writes more often
than `min_interval_s`. Each heartbeat carries a short history of (time, tokens done), so
throughput over time can be drawn without a database.
"""

from __future__ import annotations

import dataclasses
import time

from schemas import config as config_lib
from schemas import layout


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """state: "starting", "working", "idle", "done", "failed" or "preempted".

    partition: partition in hand (None when idle); step / steps: progress in it.
    tokens_per_s: recent throughput of this host (non-padding tokens).
    eta_s: seconds until this host's assigned partitions are done (None: unknown).
    """

    host: str
    replica: int
    process_index: int
    state: str
    attempt: str
    updated_at: float
    partition: int | None = None
    step: int = 0
    steps: int = 0
    tokens_done: int = 0
    tokens_per_s: float = 0.0
    eta_s: float | None = None
    partitions_done: int = 0
    message: str = ""
    history: tuple[tuple[float, int], ...] = ()


# Samples kept per heartbeat: when full, every other one is dropped, so the history spans
# the whole attempt at a resolution that halves each time (a few KB per host at most).
MAX_HISTORY = 64


class HeartbeatWriter:
    """Writes a host's heartbeat at most once per `min_interval_s` (unless forced)."""

    def __init__(self, store, host: str, min_interval_s: float = 2.0):
        self._store = store
        self._key = layout.heartbeat_key(host)
        self._min_interval_s = max(1.0, min_interval_s)
        self._last = 0.0
        self._history: list[tuple[float, int]] = []

    def beat(self, heartbeat: Heartbeat, force: bool = False) -> bool:
        """Writes `heartbeat` with this writer's history appended (its own is ignored)."""
        now = time.monotonic()
        if not force and now - self._last < self._min_interval_s:
            return False
        self._history.append((round(heartbeat.updated_at, 1), heartbeat.tokens_done))
        if len(self._history) > MAX_HISTORY:
            self._history = self._history[-1::-2][::-1]  # keeps the newest sample
        heartbeat = dataclasses.replace(heartbeat, history=tuple(self._history))
        self._store.write_json(self._key, config_lib.to_dict(heartbeat))
        self._last = now
        return True


def read_heartbeats(store, max_parallel: int = 32) -> list[Heartbeat]:
    """Every host's heartbeat: one listing of names, then the reads in parallel."""
    keys = [k for k in store.list(layout.WORKERS_PREFIX) if k.endswith(".json")]
    datas = store.read_many(keys, max_parallel=max_parallel)
    beats = []
    for key, data in zip(keys, datas):
        if data is None:  # deleted between the listing and the read
            continue
        beats.append(config_lib.from_dict(Heartbeat, store.parse_json(key, data),
                                          str(store.location.join(key)) + ": "))
    return beats
