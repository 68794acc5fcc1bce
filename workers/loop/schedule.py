"""Which partitions a replica extracts, and how a host walks its rows in fixed-shape steps.

Pure Python (no JAX): replicas never talk to each other, so a replica's own partitions are
a function of the manifest and its index, and what replicas share goes through the store
(claims here; the policy in workers.replicas.choice_policy). Within a multi-host replica
every host must run the same number of steps, so short slices are padded with masked rows.
The rows of a long document form a chain that runs through one batch slot in successive
steps, so the slot's KV cache carries the document from row to row (workers.attention.kv_cache).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Callable, Iterable, Iterator, Sequence

from actx.schemas import layout
from actx.schemas import manifest as manifest_lib


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits: replica `replica` of `replicas`, host `host_index` of the
    replica's `hosts_per_replica` hosts."""

    replicas: int = 1
    replica: int = 0
    hosts_per_replica: int = 1
    host_index: int = 0

    def __post_init__(self):
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"replica index {self.replica} is outside 0..{self.replicas - 1}")
        if not 0 <= self.host_index < self.hosts_per_replica:
            raise ValueError(
                f"host index {self.host_index} is outside 0..{self.hosts_per_replica - 1}")


def own_partitions(manifest: manifest_lib.Manifest, topo: Topology) -> list[int]:
    """Partition p belongs to replica p mod R."""
    return [p.id for p in manifest.partitions if p.id % topo.replicas == topo.replica]


def steal_order(manifest: manifest_lib.Manifest, topo: Topology) -> list[int]:
    """Other replicas' partitions, latest first (their owners start from the front). The
    worker's choice no longer uses it: it steals only from replicas that have started, the
    end of the longest list first (workers.replicas.choice_policy)."""
    others = [p.id for p in manifest.partitions if p.id % topo.replicas != topo.replica]
    return sorted(others, key=lambda pid: (-(pid // topo.replicas), pid))


def try_claim(store, job: str, partition_id: int, attempt: str, generation: int = 0) -> bool:
    """Create-only claim of a partition within one job; False if another attempt has it.

    Claims only steer work sharing inside a job (a rerun is a new job); correctness never
    depends on them, since the commit marker is create-only and the bytes deterministic.
    generation: 0 for the first claim; g + 1 takes over a claim of generation g whose
    attempt is dead (workers.replicas.choice_policy), create-only like the first.
    """
    key = claim_key(job, partition_id, generation)
    if store.create_json(key, {"attempt": attempt, "at": time.time()}):
        return True
    existing = store.read_json(key) or {}
    return existing.get("attempt") == attempt


def claim_key(job: str, partition_id: int, generation: int = 0) -> str:
    """`layout.claim_key`, or at generation g > 0 claims/<job>/p-00042.<g>.json."""
    key = layout.claim_key(job, partition_id)
    return key if generation == 0 else f"{key[:-len('.json')]}.{generation}.json"


def claims_folder(job: str) -> str:
    return layout.claim_key(job, 0)[:-len("p-00000.json")]


# The name of a claim in its folder: p-<partition>.json or p-<partition>.<generation>.json.
_CLAIM_NAME = re.compile(r"^p-(\d+)(?:\.(\d+))?\.json$", re.MULTILINE)


def claim_generations(names: Iterable[str]) -> dict[int, int]:
    """Partition -> the highest claim generation among claim names (one regex over all of
    them: a pod's claims are tens of thousands of names, read at every look)."""
    generations: dict[int, int] = {}
    for pid, generation in _CLAIM_NAME.findall("\n".join(names)):
        pid, generation = int(pid), int(generation or 0)
        if generation >= generations.get(pid, -1):
            generations[pid] = generation
    return generations


@dataclasses.dataclass(frozen=True)
class Step:
    """One fixed-shape step of one host: one row per batch slot.

    rows: the global row each slot runs (len == local batch). Padding slots repeat a real
      row; they are computed and never written.
    write: per slot, whether its output is stored. False for padding and for warm-up rows
      (the earlier rows of a document that began before this host's slice, run only so the
      slot's cache holds their keys and values).
    continues: per slot, whether its row continues the row the slot ran in the previous
      step (the same document): the slot keeps its KV cache. False: the cache is reset.
    """

    rows: tuple[int, ...]
    write: tuple[bool, ...]
    continues: tuple[bool, ...]
    partitions: tuple[int, ...] = ()  # per slot, when steps span partitions (`stream`)
    done: bool = False  # `stream` with pad_forever: no work is left, this step is padding

    @property
    def valid(self) -> int:
        """How many slots are written."""
        return sum(self.write)


@dataclasses.dataclass(frozen=True)
class Chain:
    """Rows that must run through one slot in order: a document's rows (one row when the
    row starts no long document). The first `warmup` rows are run but not written."""

    rows: tuple[int, ...]
    warmup: int = 0


def chains(lo: int, hi: int, continues_row: Sequence[bool] | None = None,
           first_positions: Sequence[int] = (), seq_len: int = 0,
           max_warmup_rows: int | None = None) -> list[Chain]:
    """Splits the slice [lo, hi) into chains, in row order.

    continues_row[i]: row lo + i continues the document of row lo + i - 1 (None: no row
      does; every row is its own chain). first_positions[0] / seq_len: when the slice's
      first row continues a document, that document's position at its column 0, which says
      how many earlier rows of the document (outside the slice) are run first as warm-up:
      all of them, or the last `max_warmup_rows` (`warmup_rows`: what the slice's values
      depend on through the layers' windows).
    """
    if continues_row is None:
        return [Chain((r,)) for r in range(lo, hi)]
    if len(continues_row) != hi - lo:
        raise ValueError(f"{len(continues_row)} continuation flags for rows {lo}..{hi}")
    out: list[list[int]] = []
    warmup = 0
    for i, cont in enumerate(continues_row):
        if i == 0 and cont:
            warmup = int(first_positions[0]) // seq_len
            if max_warmup_rows is not None:
                warmup = min(warmup, max_warmup_rows)
            out.append(list(range(lo - warmup, lo + 1)))
        elif cont:
            out[-1].append(lo + i)
        else:
            out.append([lo + i])
    return [Chain(tuple(rows), warmup if k == 0 else 0) for k, rows in enumerate(out)]


def warmup_rows(windows: Sequence[int], seq_len: int) -> int:
    """Rows of earlier context that make a slice starting inside a document exact.

    windows: per layer that runs, the tokens a query attends to (min of the model's window
    and max_context). An output of layer l at position p depends on the tokens back to
    p - sum(w_i - 1 for i <= l), so a warm-up that starts that far back (or at the
    document's first row) computes every value the slice uses exactly as a run from the
    document's start would: a block outside a query's window is masked whether it was
    computed or not.
    """
    lead_tokens = sum(w - 1 for w in windows)
    return -(-lead_tokens // seq_len)


def model_warmup_rows(window_per_layer: Sequence[int | None], layers_run: int,
                      max_context: int, seq_len: int) -> int:
    """`warmup_rows` of a model whose layers attend within `window_per_layer` (None: the
    whole context), of which the first `layers_run` run, at `max_context`."""
    return warmup_rows([min(w or max_context, max_context)
                        for w in window_per_layer[:layers_run]], seq_len)


def assign(chain_list: Sequence[Chain], local_batch: int, filler_row: int) -> list[Step]:
    """Steps that run every chain through one slot, in order.

    Chains of several rows go first, longest first (a step count is at least its longest
    chain, so a long chain started late would leave the other slots idle); then one-row
    chains in row order. Each chain goes to the slot with the least work so far (the
    lowest index on ties), so a slice of one-row chains fills slot 0, 1, ... in row order,
    as a plain walk over the rows would. The order is a function of the chains alone.
    """
    queues: list[list[tuple[int, bool, bool]]] = [[] for _ in range(local_batch)]
    for chain in by_length(chain_list):
        slot = min(range(local_batch), key=lambda j: (len(queues[j]), j))
        for k, row in enumerate(chain.rows):
            queues[slot].append((row, k >= chain.warmup, k > 0))
    n_steps = max((len(q) for q in queues), default=0)
    pad = (filler_row, False, False)
    steps = []
    for s in range(n_steps):
        entries = [q[s] if s < len(q) else pad for q in queues]
        steps.append(Step(tuple(e[0] for e in entries), tuple(e[1] for e in entries),
                          tuple(e[2] for e in entries)))
    return steps


def by_length(chain_list: Sequence[Chain]) -> list[Chain]:
    """Chains of several rows first, longest first, then one-row chains; row order on ties."""
    order = sorted(range(len(chain_list)), key=lambda i: (-len(chain_list[i].rows), i))
    return [chain_list[i] for i in order]


NOT_YET = "not yet"  # `stream`'s next_partition: no partition yet; ask again next step


def stream(next_partition: Callable[[], "tuple[int, list[Chain]] | None | str"],
           local_batch: int, pad_forever: bool = False) -> Iterator[Step]:
    """Steps over partitions taken one after another, with no barrier between them.

    A slot that finishes its chain takes the next one (`by_length` order within a
    partition), and when the partition in hand has none left, `next_partition()` is asked
    for another (partition id, chains), None (no more) or NOT_YET (a host of a multi-host
    replica whose leader has not chosen it yet: the free slots pad this step). So no slot
    idles while work remains, however long a partition's longest document: a partition ends
    when its last row is written. pad_forever: once the work is out, yield padding steps
    marked `done` until the consumer stops (the hosts of a multi-host replica step in
    lockstep until all are out).
    """
    queues: list[collections.deque] = [collections.deque() for _ in range(local_batch)]
    waiting: collections.deque = collections.deque()
    exhausted = False
    filler = None
    while True:
        not_yet = False
        for queue in queues:
            if queue:
                continue
            while not waiting and not exhausted and not not_yet:
                got = next_partition()
                if got is None:
                    exhausted = True
                elif got is NOT_YET:
                    not_yet = True
                else:
                    pid, chain_list = got
                    waiting.extend((pid, chain) for chain in by_length(chain_list))
            if waiting:
                pid, chain = waiting.popleft()
                queue.extend((row, k >= chain.warmup, k > 0, pid)
                             for k, row in enumerate(chain.rows))
                filler = chain.rows[0] if filler is None else filler
        if filler is None:  # nothing planned yet: any stored row pads
            filler = 0
        if not any(queues) and not not_yet:
            if not pad_forever:
                return
            while True:
                yield Step((filler,) * local_batch, (False,) * local_batch,
                           (False,) * local_batch, (-1,) * local_batch, done=True)
        entries = [q.popleft() if q else (filler, False, False, -1) for q in queues]
        yield Step(*(tuple(e[i] for e in entries) for i in range(4)))


def pad_steps(steps: list[Step], n_steps: int, local_batch: int, filler_row: int) -> list[Step]:
    """`steps` followed by all-padding steps up to n_steps (hosts run equal step counts)."""
    if len(steps) > n_steps:
        raise ValueError(f"{len(steps)} steps planned, more than the agreed {n_steps}")
    empty = Step((filler_row,) * local_batch, (False,) * local_batch, (False,) * local_batch)
    return steps + [empty] * (n_steps - len(steps))


def plan_steps(partition: manifest_lib.Partition, topo: Topology, rows_per_shard: int,
               local_batch: int) -> list[Step]:
    """This host's steps for a partition whose rows are independent (no row continues
    another); equal in count on every host of the replica."""
    slices = layout.host_row_slices(partition.row_start, partition.row_count,
                                    topo.hosts_per_replica, rows_per_shard)
    longest = max(hi - lo for lo, hi in slices)
    n_steps = -(-longest // local_batch)
    lo, hi = slices[topo.host_index]
    steps = assign(chains(lo, hi), local_batch, lo if hi > lo else partition.row_start)
    return pad_steps(steps, n_steps, local_batch, lo if hi > lo else partition.row_start)


def host_slice(partition: manifest_lib.Partition, topo: Topology,
               rows_per_shard: int) -> tuple[int, int]:
    return layout.host_row_slices(partition.row_start, partition.row_count,
                                  topo.hosts_per_replica, rows_per_shard)[topo.host_index]
