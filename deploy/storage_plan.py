"""What a job asks of its bucket before it runs (`actx submit --dry-run --estimate`): its
objects, bytes and requests by class (schemas.storage_requests), their price, and the
data's request rate at the target's speed against what a new GCS bucket takes.

Data requests follow the write layout: one write per stored shard object (each hook's
`rows_per_shard` rows: schemas.layout), one commit marker written and one read per
partition (and a generating run's sample record written beside the marker), a claim per
partition when replicas share work, and per partition the reads of the token arrays each
step reads (workers.loop.prefetch.STEP_INPUTS: each array's
shard index and each inner chunk of `rows_per_shard` rows), plus the two existence checks
of run.json and activations/actx.json before each commit (workers.write.commit). Control
requests follow the code's cadences (schemas.request_budget): a heartbeat a host every
`heartbeat_s` or longer on a pod, the replicas' looks at commits, claims and heartbeats at
most every `REFRESH_S` (longer on a pod) and once per partition taken
(workers.replicas.choice_policy), log copies every `log_every_s` a host (longer on a pod)
where the target ships logs, the metadata written once by process 0 of replica 0. bench/requests.py measures the same classes; the test
tests/test_storage_plan.py holds this model to a measured run.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from actx.schemas import request_budget
from actx.schemas import storage_requests as sr

# A new bucket's request rate before GCS scales it, and how fast it scales under load
# (cloud.google.com/storage/docs/request-rate: "approximately 1000 object write requests
# per second and 5000 object read requests per second", doubling "every 20 minutes").
INITIAL_WRITES_PER_S = 1000.0
INITIAL_READS_PER_S = 5000.0
DOUBLING_S = 20 * 60.0
LIST_PAGE = 1000  # objects a listing page holds (GCS's maximum, as actx asks)


@dataclasses.dataclass(frozen=True)
class Job:
    """What the plan needs of a job.

    rows / partitions / seq_len: the run's, from the manifest or a dry prepare.
    hook_bytes_per_row: each hook's uncompressed bytes a row (dry_run.hook_bytes_per_row).
    rows_per_shard / partition_rows: the layout.
    hosts / replicas: the target's; steal: replicas share partitions (claims).
    heartbeat_s: the workers' heartbeat interval; log_every_s: the target's log copies
      (None: logs are copied once, at the end, by a launcher on the hosts' machine).
    step_inputs: the token arrays a step reads; refresh_s: the chooser's listing reuse
      (workers.preflight.storage_cadences).
    seconds: the job's time; tokens_per_s: the pod's speed (the estimate's).
    generates: a generating run, whose workers write each partition's sample record
      (generated/p-NNNNN.json, a marker-class object) before its commit marker.
    """

    rows: int
    partitions: int
    seq_len: int
    hook_bytes_per_row: dict[str, int]
    rows_per_shard: int
    partition_rows: int
    hosts: int
    replicas: int
    steal: bool
    heartbeat_s: float
    log_every_s: float | None
    step_inputs: tuple[str, ...]
    refresh_s: float
    seconds: float
    tokens_per_s: float
    generates: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    objects: int
    data_bytes: float
    requests: dict[tuple[str, str], float]  # (class, operation) -> requests in the job

    def gcs(self, gcs_class: str) -> float:
        return sum(n for (_, op), n in self.requests.items() if sr.GCS_CLASS[op] == gcs_class)


def _pages(objects: float) -> int:
    return max(1, math.ceil(objects / LIST_PAGE))


def plan(job: Job) -> Plan:
    """The job's objects, bytes and requests by (class, operation), by the rules in this
    module's docstring."""
    hooks = len(job.hook_bytes_per_row)
    shards = hooks * math.ceil(job.rows / job.rows_per_shard)
    chunks = math.ceil(job.partition_rows / job.rows_per_shard)
    r: dict[tuple[str, str], float] = collections.Counter()
    r[("shards", "write")] = shards
    # Each partition's commit marker, and a generating run's sample record beside it.
    r[("markers", "write")] = job.partitions * (2 if job.generates else 1)
    r[("markers", "read")] = job.partitions  # before each claim: mostly 404
    sharing = job.steal and job.replicas > 1
    if sharing:
        r[("claims", "write")] = job.partitions
        r[("claims", "read")] = job.partitions  # the holder of a claim met
    r[("inputs", "read")] = (job.partitions * (len(job.step_inputs) * (1 + chunks) + 1)
                             + 2 * job.hosts)  # + run.json and the manifest at start
    # The others read what process 0 of replica 0 wrote (at least once each).
    r[("metadata", "read")] = job.partitions + job.hosts * (1 + hooks)
    # Process 0 of replica 0 alone writes the numerics record (activations/actx.json) and
    # every array's zarr.json (workers.write.metadata): once a name.
    r[("metadata", "write")] = 1 + hooks
    heartbeat_s = request_budget.heartbeat_interval_s(job.heartbeat_s, job.hosts)
    r[("heartbeats", "write")] = job.hosts * (job.seconds / heartbeat_s + 2)
    if sharing:
        # A replica lists at most once per partition it takes and once per refresh_s,
        # and, once nothing is left to take, every refresh_s until the last partition
        # is committed: about one partition's time (the tail).
        # A look lists commits, claims and heartbeats at most every look_s: refresh_s,
        # or longer on a pod (request_budget.tail_look_interval_s), shortened by up to a
        # quarter at random (7/8 on average).
        pages_a_look = 2 * _pages(job.partitions / 2) + _pages(job.hosts)
        look_s = 0.875 * request_budget.tail_look_interval_s(job.refresh_s, job.replicas,
                                                             pages_a_look)
        partition_s = job.seconds * job.replicas / job.partitions
        refreshes = job.replicas * (min(job.seconds / look_s,
                                        job.partitions / job.replicas + 1)
                                    + partition_s / look_s)
        # + each host's listing of the commits at start (what is left to do)
        r[("markers", "list")] = (refreshes + job.hosts) * _pages(job.partitions / 2)
        r[("claims", "list")] = refreshes * _pages(job.partitions / 2)
        r[("heartbeats", "list")] = refreshes * _pages(job.hosts)
    r[("logs", "write")] = (
        job.hosts * job.seconds / request_budget.log_interval_s(job.log_every_s, job.hosts)
        if job.log_every_s else job.hosts)
    objects = (shards + hooks + 1 + job.partitions * (1 + sharing + job.generates)
               + 2 * job.hosts)
    data_bytes = job.rows * sum(job.hook_bytes_per_row.values())
    return Plan(objects, data_bytes, dict(r))


def ramp_s(rate: float, initial: float) -> float:
    """Seconds of sustained load GCS needs before a bucket takes `rate` requests/s."""
    return 0.0 if rate <= initial else DOUBLING_S * math.log2(rate / initial)


def writing_s(writes: float, compute_per_s: float, initial: float = INITIAL_WRITES_PER_S
              ) -> float:
    """Seconds to make `writes` requests at `compute_per_s` a second where the bucket takes
    `initial` a second at first, doubling every DOUBLING_S under load: capacity(t) =
    initial x 2^(t / DOUBLING_S), so the writes it takes by t are its integral,
    initial x DOUBLING_S / ln 2 x (2^(t / DOUBLING_S) - 1), until it reaches compute_per_s
    (after `ramp_s`); from then on compute sets the pace."""
    ramp = ramp_s(compute_per_s, initial)
    by_ramp = initial * DOUBLING_S / math.log(2) * (2 ** (ramp / DOUBLING_S) - 1)
    if writes <= by_ramp:
        return DOUBLING_S * math.log2(1 + writes * math.log(2) / (initial * DOUBLING_S))
    return ramp + (writes - by_ramp) / compute_per_s


def lines(job: Job, prices) -> list[str]:
    """The estimate's storage lines (each starts with "# "). prices: the config's
    StoragePrices."""
    p = plan(job)
    a, b = p.gcs("A"), p.gcs("B")
    dollars_ops = a / 1e4 * prices.class_a_per_10k + b / 1e4 * prices.class_b_per_10k
    month = p.data_bytes / 2**30 * prices.storage_per_gib_month
    out = [f"# storage: {p.objects:,} objects, {_bytes(p.data_bytes)} of activations "
           f"uncompressed, for {job.hosts:,} host(s) in {job.replicas:,} replica(s)"]
    by_class = collections.defaultdict(list)
    for (cls, op), n in sorted(p.requests.items()):
        if n:
            by_class[cls].append(f"{n:,.0f} {op}s")
    for cls in sr.CLASSES:
        if cls in by_class:
            out.append(f"#   {cls}: {', '.join(by_class[cls])}")
    out.append(f"#   requests: {a:,.0f} Class A (writes, listings) + {b:,.0f} Class B "
               f"(reads) = ${dollars_ops:,.2f}; storage ${month:,.2f} a month "
               f"uncompressed, at list prices ({prices.source}; set `prices` in the config "
               f"for yours)")
    if job.tokens_per_s <= 0 or job.seconds <= 0:
        return out
    data_writes = sum(n for (cls, op), n in p.requests.items()
                      if op == "write" and cls in ("shards", "markers", "claims"))
    per_s = data_writes / job.seconds
    bytes_per_s = p.data_bytes / job.seconds
    ramp = ramp_s(per_s, INITIAL_WRITES_PER_S)
    out.append(f"#   write rate at {job.tokens_per_s:,.0f} tokens/s: {per_s:,.0f} data "
               f"writes/s ({_bytes(bytes_per_s)}/s) against a new bucket's "
               f"{INITIAL_WRITES_PER_S:,.0f} writes/s" + (
                   f": GCS needs about {ramp / 60:,.0f} min of sustained load (doubling "
                   f"every {DOUBLING_S / 60:.0f} min) to take it" if ramp else ": within it"))
    reads_per_s = sum(n for (_, op), n in p.requests.items()
                      if op in ("read", "list")) / job.seconds
    out.append(f"#   read rate: {reads_per_s:,.0f} reads and listings/s against a new "
               f"bucket's {INITIAL_READS_PER_S:,.0f}" + (
                   f": GCS needs about {ramp_s(reads_per_s, INITIAL_READS_PER_S) / 60:,.0f} "
                   f"min to take it" if reads_per_s > INITIAL_READS_PER_S else ": within it"))
    shard_bytes = p.data_bytes / max(1, p.requests[("shards", "write")])
    hooks = len(job.hook_bytes_per_row)
    # Writes a second scale with hosts and inversely with rows an object: these are
    # where data writes equal the bucket's initial capacity.
    balance_rows = job.rows_per_shard * per_s / INITIAL_WRITES_PER_S
    balance_hosts = job.hosts * INITIAL_WRITES_PER_S / per_s
    if per_s <= INITIAL_WRITES_PER_S:
        bound = "bound by compute"
    else:
        slowed = writing_s(data_writes, per_s)
        bound = (f"bound by storage: about {_minutes(slowed)} instead of "
                 f"{_minutes(job.seconds)} at compute's pace, "
                 + ("GCS's ramp reaching its rate before the end"
                    if ramp < slowed else "the job ending before GCS's ramp reaches its rate"))
    out.append(f"#   {bound}: objects of {job.rows_per_shard} rows "
               f"({_bytes(shard_bytes)} each, {hooks} hook(s)) balance the bucket's "
               f"initial writes at {balance_rows:,.1f} rows an object "
               f"({_bytes(shard_bytes * balance_rows / job.rows_per_shard)}), or at "
               f"{balance_hosts:,.0f} host(s) with these objects")
    return out


def _minutes(s: float) -> str:
    return f"{s / 60:,.1f} min" if s < 3600 else f"{s / 3600:,.1f} h"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)
