"""A scheduling simulator: many replicas, fake clocks, the real partition choice.

Each simulated replica is one host with `slots` batch slots. Its steps come from the real
`workers.loop.schedule.stream`, over chains the real `schedule.chains` makes from documents
packed by the real packer (`pipeline.pack.plan_pack`, FineWeb-like lengths); its partitions
come from the real `workers.replicas.chooser.Chooser`, claiming in a store, reading the
commit markers and the heartbeats that the simulated replicas write there with the
simulated clock. Only the mechanics are simulated: a step takes the replica's `step_s`
seconds whatever its slots hold (a fixed-shape step on a device); a partition is
committed when its last row is written; a replica with nothing in hand and nothing to take
waits a poll interval, as `workers.loop.partition_stream` does; a dead replica stops stepping and
beating (its heartbeat goes stale), a replica that never starts never beats.

The store counts the requests Cloud Storage would get (`DictStore`: by class, kind and
10 s window of the simulated clock), with the heartbeats, log copies and launcher polls
of a pod at their real intervals (schemas.request_budget) and the run's metadata written
once, so a test holds a pod's control traffic to issue 63's bounds.

The yardstick is the fluid ideal: every replica's slots busy from its first step until
the work is done, the work split in any proportion (chains cut anywhere): the least
possible makespan, below anything a real schedule reaches. A replica's share is what it
does in that ideal.

  python -m tests.schedule_sim       # the figures of the note (64, 16 and 2 replicas)
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import json
import math
import re

import numpy as np

from actx.pipeline import pack
from actx.pipeline import write_store
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import request_budget
from actx.schemas import runspec
from actx.schemas import storage_requests
from actx.schemas import store as store_lib
from actx.schemas import uri
from actx.schemas import commit as commit_lib
from actx.workers.loop import schedule
from actx.workers.replicas import choice_policy, chooser

JOB = "sim"
# A worker's and a launcher's defaults (schemas.worker_options, deploy.config): seconds
# between heartbeats and between log copies before the pod's size stretches them, and
# between the launcher's polls of status.
HEARTBEAT_S, LOG_EVERY_S, STATUS_EVERY_S = 2.0, 10.0, 2.0
# What every worker would otherwise write at start: the numerics record and a zarr.json
# per hook (4 hooks).
METADATA_KEYS = (layout.ACTIVATIONS_INFO_KEY,
                 *(f"{layout.ACTIVATIONS_GROUP}/layers.{i}.resid_post/zarr.json" for i in range(4)))


def request_class(key: str) -> str:
    """What a request is for, by its object's name: the bench's and the estimate's classes
    (schemas.storage_requests: heartbeats, logs, claims, markers, metadata, shards, ...)."""
    return storage_requests.object_class(key)


class DictStore(store_lib.ObjectStore):
    """An object store in a dict, with create-only writes: the store the simulated
    replicas share (listings by folder, so a view of 10k claims costs milliseconds).

    It counts the requests Cloud Storage would get, by `request_class`, kind (write,
    read, list: one a page of LIST_PAGE_OBJECTS) and `window_s` of the simulated clock,
    and each object's writes: a lost create is a write and a read (gcs_store reads what
    won), and summaries come back with a listing, as on GCS."""

    def __init__(self, clock=lambda: 0.0, window_s: float = 10.0):
        super().__init__(uri.parse("memory://schedule-sim"))
        self.objects: dict[str, bytes] = {}
        self.summaries: dict[str, str] = {}
        self.folders: dict[str, list[str]] = collections.defaultdict(list)  # sorted keys
        self.names: dict[str, list[str]] = collections.defaultdict(list)  # in write order
        self.clock, self.window_s = clock, window_s
        self.requests: collections.Counter = collections.Counter()  # (window, class, kind)
        self.writes_of: collections.Counter = collections.Counter()  # key -> writes
        self.actor = ""  # a class that counts whatever is asked meanwhile ("status")

    def count(self, key: str, kind: str, n: int = 1) -> None:
        cls = self.actor or request_class(key)
        self.requests[(int(self.clock() // self.window_s), cls, kind)] += n
        if kind == "write":
            self.writes_of[key] += n

    def _listed(self, prefix: str, objects: int) -> None:
        self.count(prefix, "list", request_budget.list_pages(objects))

    def read(self, key):
        self.count(key, "read")
        return self.objects.get(key)

    def write(self, key, data):
        self.count(key, "write")
        self._put(key, data)

    def _put(self, key, data):
        if key not in self.objects:
            folder, name = key.rsplit("/", 1)
            bisect.insort(self.folders[folder + "/"], key)
            self.names[folder + "/"].append(name)
        self.objects[key] = bytes(data)

    def write_with_summary(self, key, data, summary):
        self.write(key, data)
        self.summaries[key] = summary

    def create(self, key, data):
        self.count(key, "write")
        if key in self.objects:
            self.count(key, "read")
            return False
        self._put(key, data)
        return True

    def list(self, prefix=""):
        keys = []
        for folder in sorted(f for f in self.folders if f.startswith(prefix)
                             or prefix.startswith(f)):
            keys.extend(k for k in self.folders[folder] if k.startswith(prefix))
        self._listed(prefix, len(keys))
        return keys

    def list_names(self, folder):
        names = list(self.names.get(folder, ()))
        self._listed(folder, len(names))
        return names

    def list_summaries(self, prefix):
        keys = [k for k in self.folders.get(prefix, ())]
        self._listed(prefix, len(keys))
        return {k: self.summaries.get(k) for k in keys}

    def delete(self, key):
        if self.objects.pop(key, None) is not None:
            folder, name = key.rsplit("/", 1)
            self.folders[folder + "/"].remove(key)
            self.names[folder + "/"].remove(name)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Partitions of packed documents: each partition's chains (with warm-up rows) and the
    rows it writes."""

    manifest: manifest_lib.Manifest
    chains: dict[int, list[schedule.Chain]]
    seq_len: int
    warmup_rows: int = 0  # the model's (workers.loop.schedule.warmup_rows)

    @property
    def slot_steps(self) -> int:
        """Rows run, warm-up rows included: the work, in slot-steps."""
        return sum(len(c.rows) for cs in self.chains.values() for c in cs)


def fineweb_like(n_partitions: int, partition_rows: int = 64, seq_len: int = 1024,
                 max_context: int = 4096, layers: int = 4, median: float = 600.0,
                 sigma: float = 1.2, max_tokens: int = 100_000, seed: int = 0) -> Workload:
    """Documents of log-normal lengths (median ~600 tokens, a tail past 8k, as FineWeb's;
    bench/long_documents.py uses the same mix) packed `segmented` with "continue" overflow;
    chains as a worker makes them, with the warm-up a model of `layers` layers needs."""
    packing = runspec.PackingSpec(mode="segmented", seq_len=seq_len, overflow="continue",
                                  max_context=max_context)
    rng = np.random.default_rng(seed)
    rows_wanted = n_partitions * partition_rows
    # Mean length ~ median * exp(sigma^2 / 2); rows fill ~80% on average.
    n_docs = int(rows_wanted * seq_len * 0.75 / (median * math.exp(sigma ** 2 / 2))) + 16
    while True:
        lengths = np.clip(np.exp(rng.normal(np.log(median), sigma, n_docs)), 1, max_tokens)
        plan = pack.plan_pack([int(n) for n in lengths], packing)
        if plan.total_rows >= rows_wanted:
            break
        n_docs = int(n_docs * 1.2)
    total_rows = rows_wanted
    continues = np.zeros(total_rows, bool)
    first_positions = np.zeros(total_rows, np.int64)
    for pieces in plan.pieces:
        for piece in pieces:
            if piece.row < total_rows and piece.col == 0 and piece.position_start > 0:
                continues[piece.row] = True
                first_positions[piece.row] = piece.position_start
    starts = np.bincount([pieces[0].row // partition_rows for pieces in plan.pieces
                          if pieces[0].row < total_rows], minlength=n_partitions)
    warmup = schedule.warmup_rows([max_context] * layers, seq_len)
    parts, chains = [], {}
    for pid in range(n_partitions):
        lo, hi = pid * partition_rows, (pid + 1) * partition_rows
        chains[pid] = schedule.chains(lo, hi, continues[lo:hi], first_positions[lo:hi],
                                      seq_len, warmup)
        # As prepare records them (pipeline.write_store): the rows documents run through.
        runs = write_store.doc_runs(np.ones(hi - lo, np.int32), first_positions[lo:hi], seq_len)
        parts.append(manifest_lib.Partition(id=pid, row_start=lo, row_count=hi - lo,
                                            tokens=(hi - lo) * seq_len,
                                            docs=int(starts[pid]), **runs))
    m = manifest_lib.Manifest("sim", seq_len, total_rows, total_rows * seq_len, tuple(parts),
                              {}, 0)
    return Workload(m, chains, seq_len, warmup)


def subset(workload: Workload, n_partitions: int) -> Workload:
    """The first n partitions of a workload."""
    parts = workload.manifest.partitions[:n_partitions]
    rows = sum(p.row_count for p in parts)
    m = manifest_lib.Manifest("sim", workload.seq_len, rows, rows * workload.seq_len,
                              tuple(parts), {}, 0)
    return Workload(m, {p.id: workload.chains[p.id] for p in parts}, workload.seq_len,
                    workload.warmup_rows)


@dataclasses.dataclass(frozen=True)
class Replica:
    """start: its process starts (and beats); load: then it loads and compiles, and steps
    `load` seconds after start; step_s: seconds a step; dies_at: it stops, silently (no
    last heartbeat); beats: False for a replica that never starts; stall: (at, seconds)
    its steps pause (its heartbeat goes on)."""

    start: float = 0.0
    load: float = 30.0
    step_s: float = 1.0
    dies_at: float | None = None
    beats: bool = True
    stall: tuple[float, float] | None = None


@dataclasses.dataclass
class Outcome:
    makespan: float
    ideal: float
    work: dict[int, int]  # replica -> slot-steps of the partitions it committed
    share: dict[int, float]  # replica -> slot-steps it does in the fluid ideal
    committed_by: dict[int, int]  # partition -> replica
    claims: list[tuple[float, int, int]]  # (time, replica, partition) of every take
    duplicates: int  # partitions extracted to the end by two replicas
    stolen: dict[int, dict[str, int]]
    given_up: dict[int, dict[str, int]]
    first_step: dict[int, float]
    idle_reasons: dict[int, set[str]]
    # Per replica: its chooser's looks at the store, and the claims it read at them for
    # their holders (workers.replicas.chooser.Chooser.looks / holders_read).
    looks: dict[int, int] = dataclasses.field(default_factory=dict)
    holders_read: dict[int, int] = dataclasses.field(default_factory=dict)
    # The requests the bucket got: (window, request_class, kind) -> count, windows of
    # `window_s` simulated seconds; and how often each object was written.
    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    writes_of: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    window_s: float = 10.0

    def peak_per_s(self, kinds: tuple[str, ...], classes: tuple[str, ...]) -> float:
        """The highest rate over one window of the requests of `kinds` and `classes`."""
        per_window = collections.Counter()
        for (window, cls, kind), n in self.requests.items():
            if kind in kinds and cls in classes:
                per_window[window] += n
        return max(per_window.values(), default=0) / self.window_s

    def totals(self) -> dict[tuple[str, str], int]:
        """(class, kind) -> requests over the whole run."""
        out = collections.Counter()
        for (_, cls, kind), n in self.requests.items():
            out[(cls, kind)] += n
        return dict(out)

    def summary(self) -> str:
        shares = [self.work[r] / self.share[r] for r in self.share if self.share[r] > 0]
        stolen = sum(sum(s.values()) for s in self.stolen.values())
        return (f"makespan {self.makespan:,.0f}s, ideal {self.ideal:,.0f}s "
                f"({self.makespan / self.ideal:.3f}x); work / share {min(shares):.3f}.."
                f"{max(shares):.3f}; {stolen} partitions stolen, {self.duplicates} done twice")


class _Sim:
    def __init__(self, workload: Workload, replicas: list[Replica], slots: int,
                 stale_after_s: float, start_grace_s: float, poll_s: float,
                 heartbeat_s: float, fill_slots: bool, refresh_s: float):
        self.w, self.specs, self.slots = workload, replicas, slots
        self.stale_after_s, self.start_grace_s, self.poll_s = stale_after_s, start_grace_s, poll_s
        self.heartbeat_s, self.fill_slots, self.refresh_s = heartbeat_s, fill_slots, refresh_s
        self.store = DictStore(clock=lambda: self.now)
        self.now = 0.0
        self.log_s = request_budget.log_interval_s(LOG_EVERY_S, len(replicas))
        self.events: list = []
        self._seq = 0
        self.cost = {pid: sum(len(c.rows) for c in cs) for pid, cs in workload.chains.items()}
        self.rows = {p.id: p.row_count for p in workload.manifest.partitions}
        # Per replica: its Chooser and stream, the partitions it took, the rows left to
        # write of those in hand, its steps, rows written and commits, and what it said
        # while it waited.
        self.state = [dict(choice=None, gen=None, tried=set(), left={}, steps=0, rows=0,
                           commits=0, done=False, dead=False, first=None, sleeping=False,
                           reasons=set(), claimed_any=False)
                      for _ in replicas]
        self.committed_by: dict[int, int] = {}
        self.commit_at: dict[int, float] = {}
        self.claims: list[tuple[float, int, int]] = []
        self.duplicates = 0

    def push(self, t: float, kind: str, r: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, r))

    def run(self, limit_s: float) -> None:
        for r, spec in enumerate(self.specs):
            if spec.beats:
                self.push(spec.start, "start", r)
        self.push(0.0, "status", -1)
        while self.events:
            t, _, kind, r = heapq.heappop(self.events)
            if t > limit_s:
                raise AssertionError(f"the simulated run did not end within {limit_s:,.0f}s")
            self.now = t
            if r < 0:
                getattr(self, f"_{kind}")()
                continue
            st, spec = self.state[r], self.specs[r]
            if st["done"] or st["dead"]:
                continue
            if spec.dies_at is not None and t >= spec.dies_at:
                st["dead"] = True  # silent: no last heartbeat, nothing in flight commits
                continue
            getattr(self, f"_{kind}")(r, st, spec)

    # -- events ----------------------------------------------------------------------
    def _start(self, r, st, spec):
        st["choice"] = chooser.Chooser(
            self.store, self.w.manifest, schedule.Topology(replicas=len(self.specs), replica=r),
            JOB, self._attempt(r), clock=lambda: self.now, stale_after_s=self.stale_after_s,
            start_grace_s=self.start_grace_s, refresh_s=self.refresh_s,
            fill_slots=self.fill_slots)
        st["choice"].order_by_warmup(self.w.warmup_rows)  # as a worker does once it loads
        st["gen"] = schedule.stream(lambda: self._next_partition(r, st), self.slots)
        st["ready"] = self.now + spec.load
        if r == 0:  # the one process that writes the run's metadata (workers.write.metadata)
            for key in METADATA_KEYS:
                self.store.create(key, b"{}")
        self._beat(r, st, spec)
        self._log(r, st, spec)
        self.push(self.now + spec.load, "step", r)

    def _log(self, r, st, spec):
        """The host's log copied into the run (deploy.detached.host_run)."""
        self.store.write(layout.log_key(JOB, f"sim-r{r}h0"), b"...")
        self.push(self.now + self.log_s, "log", r)

    def _status(self):
        """The launcher's poll: `actx status`'s listings (deploy.status.runstate)."""
        self.store.actor = "status"
        commit_lib.committed_partitions(self.store, len(self.w.manifest.partitions))
        heartbeat_lib.read_heartbeats(self.store, history=False)
        self.store.actor = ""
        if any(spec.beats and not (st["done"] or st["dead"])
               for st, spec in zip(self.state, self.specs)):
            self.push(self.now + STATUS_EVERY_S, "status", -1)

    def _beat(self, r, st, spec):
        self._write_heartbeat(r, st, "working" if st["steps"] else "starting")
        self.push(self.now + self.heartbeat_s, "beat", r)

    def _step(self, r, st, spec):
        if spec.stall and spec.stall[0] <= self.now < spec.stall[0] + spec.stall[1]:
            self.push(spec.stall[0] + spec.stall[1], "step", r)
            return
        self._finish_step(r, st)
        st["sleeping"] = False
        try:
            step = next(st["gen"])
        except StopIteration:
            st["done"] = True
            self._write_heartbeat(r, st, "done")
            return
        if st["sleeping"] and not any(p >= 0 for p in step.partitions):
            # Nothing in hand, nothing to take yet: the worker waits (partition_stream), no step.
            self.push(self.now + self.poll_s, "step", r)
            return
        if st["first"] is None:
            st["first"] = self.now
            for key in METADATA_KEYS:  # read, never written, by every other replica
                assert self.store.exists(key) or r == 0 or not self.specs[0].beats
        st["steps"] += 1
        st["in_flight"] = step
        self.push(self.now + spec.step_s, "step", r)

    def _finish_step(self, r, st):
        step = st.pop("in_flight", None)
        if step is None:
            return
        for pid, write in zip(step.partitions, step.write):
            if pid < 0:
                continue
            if write:
                st["left"][pid] -= 1
                st["rows"] += 1
                if st["left"][pid] == 0:
                    del st["left"][pid]
                    self._commit(r, st, pid)

    def _commit(self, r, st, pid):
        if self.store.create_json(layout.commit_key(pid), {"attempt": self._attempt(r)}):
            self.committed_by[pid] = r
            self.commit_at[pid] = self.now
            st["commits"] += 1
        else:
            self.duplicates += 1

    # -- what the worker does --------------------------------------------------------
    def _next_partition(self, r, st):
        """`partition_stream.PartitionStream._choose` on a one-host replica, one answer a call:
        a partition, NOT_YET (the free slots pad; or, with nothing in hand, it waits a
        poll interval) or None (no more)."""
        choice = st["choice"]
        pid = choice.choose(st["tried"], self._is_committed, idle=not st["left"],
                            rows_in_hand=sum(st["left"].values()))
        if pid is None:
            if not st["left"]:
                st["sleeping"] = True
                if choice.why_waiting:  # what keeps it waiting, numbers left out
                    st["reasons"].update(re.sub(r"\b\d+(?:\.\d+)?", "N", why).strip()
                                         for why in choice.why_waiting.split("; "))
            return schedule.NOT_YET
        if pid < 0:
            return None
        st["left"][pid] = self.rows[pid]
        self.claims.append((self.now, r, pid))
        if not st["claimed_any"]:  # as a worker's Progress.hold: the first is named at once
            st["claimed_any"] = True
            self._write_heartbeat(r, st, "working" if st["steps"] else "starting")
        return pid, self.w.chains[pid]

    def _is_committed(self, pid: int) -> bool:
        return self.store.exists(layout.commit_key(pid))

    def _attempt(self, r: int) -> str:
        return f"sim-r{r}h0-attempt"

    def _write_heartbeat(self, r, st, state):
        # The fields the choice reads, with the summary a GCS listing returns (a worker's
        # HeartbeatWriter adds its history; the choice reads none); the others keep
        # their defaults, as in a heartbeat of an older worker.
        host = f"sim-r{r}h0"
        text = json.dumps(dict(
            host=host, replica=r, process_index=0, state=state, attempt=self._attempt(r),
            updated_at=self.now, step=st["steps"], tokens_done=st["rows"] * self.w.seq_len,
            # As a worker's: tokens since its session began (after loading), per second.
            tokens_per_s=round(st["rows"] * self.w.seq_len / max(1.0, self.now - st["ready"]), 1),
            partitions_done=st["commits"], job=JOB, held=sorted(st["left"]),
            interval_s=self.heartbeat_s))
        self.store.write_with_summary(layout.heartbeat_key(host), text.encode(), text)

    # -- the yardstick ---------------------------------------------------------------
    def fluid(self) -> tuple[float, dict[int, float]]:
        """(ideal makespan, each replica's share in slot-steps)."""
        rates = []
        for spec in self.specs:
            ready = spec.start + spec.load
            end = math.inf if spec.dies_at is None else spec.dies_at
            pause = spec.stall or (0.0, 0.0)
            rates.append((ready, end, pause, self.slots / spec.step_s if spec.beats else 0.0))

        def done_by(t):
            total, per = 0.0, {}
            for r, (ready, end, pause, rate) in enumerate(rates):
                busy = max(0.0, min(t, end) - ready)
                busy -= max(0.0, min(t, pause[0] + pause[1]) - max(ready, pause[0]))
                per[r] = rate * max(0.0, busy)
                total += per[r]
            return total, per

        work = float(self.w.slot_steps)
        lo, hi = 0.0, 1.0
        while done_by(hi)[0] < work:
            hi *= 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if done_by(mid)[0] < work else (lo, mid)
        return hi, done_by(hi)[1]


def simulate(workload: Workload, replicas: list[Replica], slots: int = 8,
             stale_after_s: float = 60.0, start_grace_s: float = 60.0, poll_s: float = 2.0,
             heartbeat_s: float | None = None, fill_slots: bool | None = None,
             refresh_s: float = choice_policy.REFRESH_S,
             limit_s: float = 1e7) -> Outcome:
    """Runs the replicas to the end (every partition committed, or none left to take).
    heartbeat_s: None, a worker's: 2 s, longer on a pod (schemas.request_budget)."""
    fill = choice_policy.FILL_SLOTS if fill_slots is None else fill_slots
    if heartbeat_s is None:
        heartbeat_s = request_budget.heartbeat_interval_s(HEARTBEAT_S, len(replicas))
    sim = _Sim(workload, replicas, slots, stale_after_s, start_grace_s, poll_s, heartbeat_s,
               fill, refresh_s)
    sim.run(limit_s)
    ideal, share = sim.fluid()
    work = collections.Counter()
    for pid, r in sim.committed_by.items():
        work[r] += sim.cost[pid]
    return Outcome(
        makespan=max(sim.commit_at.values(), default=0.0), ideal=ideal,
        work={r: work[r] for r in range(len(replicas))}, share=share,
        committed_by=sim.committed_by, claims=sim.claims, duplicates=sim.duplicates,
        stolen={r: dict(st["choice"].stolen_from) for r, st in enumerate(sim.state)
                if st["choice"]},
        given_up={r: dict(st["choice"].given_up) for r, st in enumerate(sim.state)
                  if st["choice"]},
        first_step={r: st["first"] for r, st in enumerate(sim.state) if st["first"] is not None},
        idle_reasons={r: st["reasons"] for r, st in enumerate(sim.state)},
        looks={r: st["choice"].looks for r, st in enumerate(sim.state) if st["choice"]},
        holders_read={r: st["choice"].holders_read for r, st in enumerate(sim.state)
                      if st["choice"]},
        requests=sim.store.requests, writes_of=sim.store.writes_of,
        window_s=sim.store.window_s)


def mixed_replicas(n: int, seed: int = 0, stragglers: int = 2, deaths: int = 0,
                   die_at: float = 200.0) -> list[Replica]:
    """n replicas as a pod starts them: processes up within 20 s of each other, 20-90 s
    of loading and compiling, speeds within +-15%, `stragglers` at a third of the speed,
    one that stalls for 40 s, and `deaths` that die (silently) at `die_at`."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n):
        out.append(Replica(start=float(rng.uniform(0, 20)), load=float(rng.uniform(20, 90)),
                           step_s=float(rng.uniform(0.85, 1.15))))
    for r in rng.choice(n, size=stragglers + deaths + 1, replace=False).tolist():
        if stragglers:
            out[r] = dataclasses.replace(out[r], step_s=out[r].step_s * 3)
            stragglers -= 1
        elif deaths:
            out[r] = dataclasses.replace(out[r], dies_at=die_at)
            deaths -= 1
        else:
            out[r] = dataclasses.replace(out[r], stall=(150.0, 40.0))
    return out


def _figures() -> None:
    """The note's figures: 64, 16 and 2 replicas of the mix (`mixed_replicas`), with and
    without a death, both ways of filling slots, over a few seeds; then 64 replicas at
    partitions of 64 rows, 48 a replica (a run only ~8 long chains long)."""
    for seed in (0, 1, 2, 3):
        work = fineweb_like(64 * 96, partition_rows=32, seed=seed)
        for n in (64, 16, 2):
            part = subset(work, n * 96)
            for deaths in ((0, 1) if n > 2 else (0,)) if seed == 0 else (0,):
                for fill in (False, True) if seed == 0 else (True,):
                    out = simulate(part, mixed_replicas(n, seed=seed,
                                                        stragglers=min(2, n - 1),
                                                        deaths=deaths), fill_slots=fill)
                    print(f"seed {seed}: {n} replicas x 96 partitions of 32 rows, {deaths} "
                          f"dead, fill_slots={fill}: {out.summary()}", flush=True)
    for seed in (0, 1, 2, 3):
        out = simulate(fineweb_like(64 * 48, seed=seed), mixed_replicas(64, seed=seed))
        print(f"seed {seed}: 64 replicas x 48 partitions of 64 rows: {out.summary()}",
              flush=True)


if __name__ == "__main__":
    _figures()
