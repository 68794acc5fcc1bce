"""Worker heartbeats: `workers/<host>.json`, the only live signal of a worker's progress.

GCS allows about one write per second to one object, so a writer never writes more often
than `min_interval_s`.
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


class HeartbeatWriter:
    """Writes a host's heartbeat at most once per `min_interval_s` (unless forced)."""

    def __init__(self, store, host: str, min_interval_s: float = 2.0):
        self._store = store
        self._key = layout.heartbeat_key(host)
        self._min_interval_s = max(1.0, min_interval_s)
        self._last = 0.0

    def beat(self, heartbeat: Heartbeat, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._last < self._min_interval_s:
            return False
        self._store.write_json(self._key, config_lib.to_dict(heartbeat))
        self._last = now
        return True


def read_heartbeats(store) -> list[Heartbeat]:
    beats = []
    for key in store.list(layout.WORKERS_PREFIX):
        if key.endswith(".json"):
            data = store.read_json(key)
            if data is not None:
                beats.append(config_lib.from_dict(Heartbeat, data, key))
    return beats
