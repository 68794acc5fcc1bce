"""What a job asks of its bucket before it runs (`actx submit --dry-run --estimate`): its
objects, bytes and requests by class (schemas.storage_requests), their price, and the
data's request rate at the target's speed against what a new GCS bucket takes.

Data requests follow the write layout: one write per stored shard object (each hook's
`rows_per_shard` rows: schemas.layout), one commit marker written and one read per
partition (and a generating run's sample record written beside the marker), a claim per
partition when replicas share work, the reads of the token arrays (`token_reads`), and the
two existence checks of run.json and activations/actx.json before each commit
(workers.write.commit); each host reads run.json, the manifest and the token arrays'
zarr.json at start. Control
requests follow the code's cadences (schemas.request_budget): a heartbeat a host every
`heartbeat_s` or longer on a pod, the replicas' looks at commits, claims and heartbeats at
most every `REFRESH_S` (longer on a pod) and once per partition taken
(workers.replicas.choice_policy), log copies every `log_every_s` a host (longer on a pod)
where the target ships logs, the metadata written once by process 0 of replica 0.
bench/requests.py measures the same classes; tests/test_request_bench.py holds this model
to a measured run.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from actx.schemas import layout
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
    warmup_rows: the rows before a partition that a document continued into it runs
      first (workers.preflight.warmup_rows); None where rows are independent.
    continued_from_rows: per partition (of the manifest, or of a sample of the inputs that
      stands for all `partitions`), the rows of the document continued into it that lie
      before it (manifest.Partition); None where not known (no warm-up counted).
    continuation_inputs / cache_bytes: workers.preflight.StorageCadences'.
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
    warmup_rows: int | None = None
    continued_from_rows: tuple[int, ...] | None = None
    continuation_inputs: tuple[str, ...] = ()
    cache_bytes: int = 0


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
    r: dict[tuple[str, str], float] = collections.Counter()
    r[("shards", "write")] = shards
    # Each partition's commit marker, and a generating run's sample record beside it.
    r[("markers", "write")] = job.partitions * (2 if job.generates else 1)
    r[("markers", "read")] = job.partitions  # before each claim: mostly 404
    sharing = job.steal and job.replicas > 1
    if sharing:
        r[("claims", "write")] = job.partitions
        r[("claims", "read")] = job.partitions  # the holder of a claim met
    r[("inputs", "read")] = (token_reads(job) + job.partitions  # + run.json before a commit
                             + job.hosts * (2 + 1 + len(job.step_inputs)))
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


def token_reads(job: Job) -> float:
    """Reads of the token arrays over the job. A partition's stored shard of each array
    (`partition_rows` rows, inner chunks of `rows_per_shard`) is read by the hosts of its
    replica whose slice of it is not empty (workers.loop.schedule: a host with none pads
    with a row it has read already): each reads the shard's index, then each inner chunk
    of its slice once (a process's cache keeps what it read, so a slot's rows read in
    several steps cost one fetch). A shard that is one inner chunk, and on one-host
    replicas of a model carrying context the `continuation_inputs` (read whole first), take
    one request.

    A document continued into a partition runs its `warmup_rows` earlier rows first (at
    most), on the host whose slice begins the partition, and they lie in other partitions'
    shards: each shard index and inner chunk they touch is read again by a first host that
    has not read it. While the token arrays fit in a process's cache, of n partitions
    touching it, spread evenly at random over the replicas, that is expected
    R x (1 - (1 - 1 / R)^n) first hosts of R replicas, one fewer where the replica that
    holds the unit read it with its first host (a shard's index, and the chunks of the
    first slice). Beyond the cache each touch is a read. (A host's slice that begins inside
    a document warms up on its neighbour's rows too: not counted.)"""
    chunks = math.ceil(job.partition_rows / job.rows_per_shard)
    per_replica = max(1, job.hosts // max(1, job.replicas))
    busy = len([1 for lo, hi in layout.host_row_slices(0, job.partition_rows, per_replica,
                                                       job.rows_per_shard) if hi > lo])
    whole = job.warmup_rows is not None and busy == 1
    own = sum(1 if chunks == 1 or (whole and name in job.continuation_inputs)
              else busy + chunks for name in job.step_inputs)
    reads = float(job.partitions * own)
    column = job.continued_from_rows
    if not job.warmup_rows or not column:
        return reads
    first_slice = layout.host_row_slices(0, job.partition_rows, per_replica,
                                         job.rows_per_shard)[0][1]
    # (unit, whether the first host of the replica holding it read it), partitions touching
    touches: collections.Counter = collections.Counter()
    for pid, continued in enumerate(column):
        start = pid * job.partition_rows  # every partition before the last is full
        first = start - min(continued, job.warmup_rows)
        if first >= start:
            continue
        for shard in range(first // job.partition_rows, (start - 1) // job.partition_rows + 1):
            touches[(("index", shard), True)] += 1
        for chunk in range(first // job.rows_per_shard, (start - 1) // job.rows_per_shard + 1):
            held = chunk * job.rows_per_shard % job.partition_rows < first_slice
            touches[(("chunk", chunk), held)] += 1
    token_bytes = job.rows * job.seq_len * 4 * len(job.step_inputs)
    if token_bytes <= job.cache_bytes:
        n = max(1, job.replicas)
        extra = sum((n - held) * (1 - (1 - 1 / n) ** count)
                    for (_, held), count in touches.items())
    else:
        extra = sum(touches.values())
    return reads + len(job.step_inputs) * extra * job.partitions / len(column)


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
    read_requests = sum(n for (_, op), n in p.requests.items() if op in ("read", "list"))
    reads_per_s = read_requests / job.seconds
    out.append(f"#   read rate: {reads_per_s:,.0f} reads and listings/s against a new "
               f"bucket's {INITIAL_READS_PER_S:,.0f}" + (
                   f": GCS needs about {ramp_s(reads_per_s, INITIAL_READS_PER_S) / 60:,.0f} "
                   f"min to take it" if reads_per_s > INITIAL_READS_PER_S else ": within it"))
    shard_bytes = p.data_bytes / max(1, p.requests[("shards", "write")])
    hooks = len(job.hook_bytes_per_row)
    # Data writes, and the token arrays' reads (an index and a chunk per busy host and
    # array, beside the rest: markers, metadata, listings), scale inversely with rows an
    # object and with hosts: where each meets the bucket's initial capacity.
    token_per_s = token_reads(job) / job.seconds
    other_reads = reads_per_s - token_per_s
    rows_for = {"writes": job.rows_per_shard * per_s / INITIAL_WRITES_PER_S,
                "reads": (job.rows_per_shard * token_per_s / (INITIAL_READS_PER_S - other_reads)
                          if other_reads < INITIAL_READS_PER_S else math.inf)}
    balance_rows = max(rows_for.values())
    balance_hosts = job.hosts * min(INITIAL_WRITES_PER_S / per_s,
                                    INITIAL_READS_PER_S / reads_per_s)
    # The time each class of requests takes at the bucket's ramp; the slower bounds the job.
    slowed = {}
    if per_s > INITIAL_WRITES_PER_S:
        slowed["writes"] = (writing_s(data_writes, per_s), ramp)
    if reads_per_s > INITIAL_READS_PER_S:
        slowed["reads"] = (writing_s(read_requests, reads_per_s, INITIAL_READS_PER_S),
                           ramp_s(reads_per_s, INITIAL_READS_PER_S))
    if not slowed:
        bound = "bound by compute"
    else:
        worst = max(slowed, key=lambda k: slowed[k][0])
        took, its_ramp = slowed[worst]
        bound = (f"bound by storage ({' and '.join(slowed)}): about {_minutes(took)} instead "
                 f"of {_minutes(job.seconds)} at compute's pace, "
                 + ("GCS's ramp reaching its rate before the end"
                    if its_ramp < took else "the job ending before GCS's ramp reaches its rate"))
    rows_said = (f"at {balance_rows:,.1f} rows an object "
                 f"({_bytes(shard_bytes * balance_rows / job.rows_per_shard)}), or "
                 if math.isfinite(balance_rows) else
                 f"at no object size (reads other than the token arrays', {other_reads:,.0f}/s, "
                 f"exceed them alone), but ")
    out.append(f"#   {bound}: objects of {job.rows_per_shard} rows "
               f"({_bytes(shard_bytes)} each, {hooks} hook(s)) balance the bucket's "
               f"initial writes and reads {rows_said}"
               f"at {balance_hosts:,.0f} host(s) with these objects")
    return out


def _minutes(s: float) -> str:
    return f"{s / 60:,.1f} min" if s < 3600 else f"{s / 3600:,.1f} h"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)
