"""Worker heartbeats: `workers/<host>.json`, the only live signal of a worker's progress.

GCS allows about one write per second to one object, so a writer never writes more often
than `min_interval_s`. Each heartbeat carries a short history of (time, tokens done), so
throughput over time can be drawn without a database, and is written with a summary (the
history included where it fits) that a GCS listing returns, so status and the live page
read 512 hosts in one request.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from actx.schemas import config as config_lib
from actx.schemas import layout
from actx.schemas import request_budget
from actx.schemas import store as store_lib


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """state: "starting", "working", "idle", "done", "failed", "preempted" or "refused"
      (the run refused this worker as it started: other settings than its numerics
      record, another model; it did nothing to the run).

    partition: partition in hand (None when idle); step / steps: progress in it.
    tokens_per_s: this host's steady-state throughput (non-padding tokens per second from
      its first tokens on, start-up excluded); 0 until tokens came after the first ones.
    eta_s: seconds until this host's assigned partitions are done (None: unknown).
    machine / pid: where the worker process runs (`this_machine()`) and its process id, so
      status on the same machine sees at once that a process is gone ("" / 0: unknown).
    job: the launcher's job id ("" in heartbeats written before it was recorded), so a
      launcher tells its own workers from an earlier job's.
    held: every partition given to this process and not yet done (a Beam bundle's, from
      before its model loads; a worker's, each one it claimed, ahead of the one in hand
      too), so a process that dies holding them leaves them stale, not pending;
      `partition` alone names only the one in hand.
    stolen_from: where replicas share work (`--steal`), per replica ("r1"), the partitions
      of its list this host's replica took (claimed), a dead attempt's taken over included.
      Written by the host that chooses: a multi-host replica's process 0.
    given_up: per replica ("r1"; "?" when the taker is not known), the partitions of this
      replica's own list another replica had claimed when this one came to them.
    idle_reason: why this host has nothing to extract: while it waits for work that may
      still come to it (another replica's partitions, taken later), or, in the last
      heartbeat of a host that extracted nothing, why it did not; "" otherwise.
    interval_s: seconds between this host's heartbeats, which grow with the pod
      (schemas.request_budget); 0 in heartbeats written before it was recorded. A heartbeat
      is stale once older than `--stale-after` or 3 of its intervals, whichever is longer
      (`is_stale`).
    Heartbeats written before a field existed read with its default.
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
    machine: str = ""
    pid: int = 0
    job: str = ""
    held: tuple[int, ...] = ()
    stolen_from: dict[str, int] = dataclasses.field(default_factory=dict)
    given_up: dict[str, int] = dataclasses.field(default_factory=dict)
    idle_reason: str = ""
    interval_s: float = 0.0


def is_stale(heartbeat: Heartbeat, now: float, stale_after_s: float) -> bool:
    """Whether `heartbeat` is too old for its host to be alive: older than `stale_after_s`
    or than 3 of the host's heartbeat intervals, whichever is longer."""
    return now - heartbeat.updated_at > request_budget.stale_after_s(stale_after_s,
                                                                     heartbeat.interval_s)


def this_machine() -> str:
    """This machine's name and boot id: a process id means something only on the machine,
    and the boot, that gave it."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def process_gone(heartbeat: Heartbeat) -> bool:
    """True when the heartbeat's process ran on this machine and is gone (killed, crashed,
    out of memory) though its heartbeat still says it works."""
    import os

    if not heartbeat.pid or not heartbeat.machine or heartbeat.machine != this_machine():
        return False
    try:
        os.kill(heartbeat.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


# Samples kept per heartbeat: when full, every other one is dropped, so the history spans
# the whole attempt at a resolution that halves each time (a few KB per host at most).
MAX_HISTORY = 64


class HeartbeatWriter:
    """Writes a host's heartbeat at most once per `min_interval_s` (unless forced)."""

    def __init__(self, store, host: str, min_interval_s: float = 2.0):
        self._store = store
        self._key = layout.heartbeat_key(host)
        self.min_interval_s = max(1.0, min_interval_s)  # between two unforced beats
        self._last = 0.0
        self._history: list[tuple[float, int]] = []

    def beat(self, heartbeat: Heartbeat, force: bool = False) -> bool:
        """Writes `heartbeat` with this writer's history appended (its own is ignored)."""
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return False
        self._history.append((round(heartbeat.updated_at, 1), heartbeat.tokens_done))
        if len(self._history) > MAX_HISTORY:
            self._history = self._history[-1::-2][::-1]  # keeps the newest sample
        heartbeat = dataclasses.replace(heartbeat, history=tuple(self._history))
        self._store.write_with_summary(self._key, store_lib.dumps(config_lib.to_dict(heartbeat)),
                                       summary(heartbeat))
        self._last = now
        return True


# A summary's message is cut here, and a summary over SUMMARY_BYTES leaves its history out
# (GCS allows 8 KiB of custom metadata per object, the key's name included).
SUMMARY_MESSAGE_CHARS = 500
SUMMARY_BYTES = 6 << 10


def summary(heartbeat: Heartbeat) -> str:
    """The heartbeat as compact JSON, its message cut: what a GCS listing returns, so
    status needs no read per host. It carries the history (64 samples, about 2 KB) where
    the whole fits in SUMMARY_BYTES, so the live page draws 512 hosts from one listing too;
    a summary without it (or from an earlier writer, whose summaries never had one)
    sends a reader that wants the history to the object itself."""
    small = dataclasses.replace(heartbeat, message=heartbeat.message[:SUMMARY_MESSAGE_CHARS])
    text = json.dumps(config_lib.to_dict(small), sort_keys=True, separators=(",", ":"))
    if len(text.encode()) > SUMMARY_BYTES:
        small = dataclasses.replace(small, history=())
        text = json.dumps(config_lib.to_dict(small), sort_keys=True, separators=(",", ":"))
    return text


def read_heartbeats(store, max_parallel: int = 32, history: bool = True,
                    damaged: list[str] | None = None) -> list[Heartbeat]:
    """Every host's heartbeat. Where the store lists summaries (GCS), one listing is
    enough: 512 hosts cost one request instead of 512 reads. A host's object is read where
    its summary lacks what the caller needs: any summary at all, or with `history`, the
    history and the whole message (a writer always has at least one sample, so an empty
    history means a summary without it). On local disk: a listing, then reads in parallel.
    Without `history`, a history that is there keeps its first sample and its last two:
    what a host's start and current rate are read from (status), without checking 64
    samples a host for 512 hosts.
    `damaged`: where given, a heartbeat object that cannot be parsed (not JSON, or not a
    heartbeat) is left out and the error, naming the object, appended to it (a heartbeat is
    advisory: `actx status` shows such a host as unreadable and carries on); without it,
    the ValueError is raised.
    """
    def parse(key, text):
        try:
            return _PARSED.parse(store, key, text, history)
        except ValueError as e:  # config_lib.ConfigError is one too
            if damaged is None:
                raise
            damaged.append(str(e))
            return None

    summaries = store.list_summaries(layout.WORKERS_PREFIX)
    if summaries is None:
        summaries = dict.fromkeys(store.list(layout.WORKERS_PREFIX))
    keys = sorted(k for k in summaries if k.endswith(".json"))
    beats, unread = {}, []
    for key in keys:
        text = summaries[key]
        try:
            beat = None if text is None else _PARSED.parse(store, key, text, history)
        except ValueError:  # a summary that does not parse: the object decides
            beat = None
        if beat is None or (history and not (
                beat.history and len(beat.message) < SUMMARY_MESSAGE_CHARS)):
            unread.append(key)
        else:
            beats[key] = beat
    for key, text in zip(unread, store.read_many(unread, max_parallel=max_parallel)):
        if text is not None:  # None: deleted between the listing and the read
            beat = parse(key, text)
            if beat is not None:
                beats[key] = beat
    return [beats[k] for k in keys if k in beats]


class _ParsedBeats:
    """The Heartbeat last parsed from each heartbeat object's text, reused while the text
    is the same: a host choosing partitions lists every heartbeat about once a heartbeat
    interval, and most have not changed since its last listing (parsing 1,024 of them
    anew costs a host ~50 ms each time). Keyed by the object's path and the exact text, so
    a changed heartbeat is always parsed; a Heartbeat is frozen, so sharing it is safe."""

    MAX_OBJECTS = 16_384  # past it, forgotten at once (a process reading many pods)

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[tuple[str, bool], tuple[str | bytes, Heartbeat]] = {}

    def parse(self, store, key: str, text: str | bytes, history: bool) -> Heartbeat:
        path = str(store.location.join(key))
        with self._lock:
            last = self._last.get((path, history))
        if last is not None and last[0] == text:
            return last[1]
        data = store.parse_json(key, text)
        if not history:
            data = _ends_of_history(data)
        beat = config_lib.from_dict(Heartbeat, data, path + ": ")
        with self._lock:
            if len(self._last) >= self.MAX_OBJECTS:
                self._last.clear()
            self._last[(path, history)] = (text, beat)
        return beat


_PARSED = _ParsedBeats()


def _ends_of_history(data):
    samples = data.get("history") if isinstance(data, dict) else None
    if isinstance(samples, list) and len(samples) > 3:
        return dict(data, history=samples[:1] + samples[-2:])
    return data
