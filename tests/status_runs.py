"""Synthetic run directories at pod scale for status, the live page and bench/status.py.

Only the small objects that status reads (run.json, manifest.json, commit markers,
heartbeats, activations/actx.json, rejects) are written, in the exact form the real
writers produce (the schemas' own classes and `store.dumps`); no token or activation data.
`objects` yields (key, bytes) so the same run can go to local disk, to memory, or into a
fake-gcs-server data directory that the server loads at start.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from actx.schemas import commit, config, heartbeat, layout, manifest, runspec, store

PARTITION_ROWS = 4096
SEQ_LEN = 1024
HIDDEN = 896
SOURCES = ("fineweb", "arc")


def spec(name: str = "synthetic") -> runspec.RunSpec:
    return runspec.RunSpec.from_dict({
        "name": name,
        "model": {"path": "synthetic-model"},
        "tokenizer": {"path": "synthetic"},
        "sources": [{"kind": "text", "paths": ["a.jsonl"], "name": "fineweb"},
                    {"kind": "text", "paths": ["b.jsonl"], "name": "arc"}],
        "packing": {"mode": "segmented", "seq_len": SEQ_LEN},
        "capture": {"hooks": "layers.12.resid_post", "dtype": "bfloat16"},
        "layout": {"rows_per_shard": 512, "partition_rows": PARTITION_ROWS, "chunk_rows": 64},
    })


def partition_tokens(pid: int) -> int:
    """Deterministic, uneven token counts (96.0% .. 99.9% of the rows' capacity)."""
    return PARTITION_ROWS * SEQ_LEN * (960 + (pid * 7919) % 40) // 1000


def objects(n_partitions: int, n_hosts: int, committed: int, dead_hosts: int = 1,
            now: float = 1.8e9, started: float | None = None,
            history_samples: int = 60, job: str = "") -> Iterator[tuple[str, bytes]]:
    """A run in progress: partitions [0, committed) have markers; `n_hosts` heartbeats, the
    last `dead_hosts` of them silent for 10 minutes and holding a partition (stale).
    `dead_hosts=n_hosts` is a preempted slice: every host silent.

    Hosts work in lockstep: host h commits partitions h, h + n_hosts, ... at a steady rate,
    and its heartbeat carries that history. With a `job`, the heartbeats name it and each
    host has the log its launcher copies into the run (`logs/<job>/<host>.log`), which
    status reads for a silent host.
    """
    sp = spec()
    started = now - 3600.0 if started is None else started
    parts = tuple(manifest.Partition(id=p, row_start=p * PARTITION_ROWS,
                                     row_count=PARTITION_ROWS, tokens=partition_tokens(p),
                                     docs=1000 + p % 17) for p in range(n_partitions))
    rejected = {"fineweb": 37, "arc": 2}
    m = manifest.Manifest(
        fingerprint=sp.fingerprint, seq_len=SEQ_LEN, total_rows=n_partitions * PARTITION_ROWS,
        total_tokens=sum(p.tokens for p in parts), partitions=parts,
        sources={s: manifest.SourceCounts(read=sum(p.docs for p in parts) // 2 + rejected[s],
                                          accepted=sum(p.docs for p in parts) // 2,
                                          rejected=rejected[s]) for s in SOURCES},
        vocab_size=151936)
    yield runspec.RUN_SPEC_KEY, store.dumps(sp.to_json_obj())
    yield layout.MANIFEST_KEY, manifest.encode(m)
    yield layout.ACTIVATIONS_INFO_KEY, store.dumps({
        "dtype": "bfloat16", "fingerprint": sp.fingerprint,
        "hooks": {"layers.12.resid_post": HIDDEN}})
    for s in SOURCES:
        lines = [json.dumps({"source": s, "file": f"{s}.jsonl", "line": 17 * i + 3,
                             "reason": "empty text" if i % 3 else "not valid JSON: line 1",
                             "snippet": '{"text": ""}'}, sort_keys=True)
                 for i in range(rejected[s])]
        yield f"{layout.REJECTS_PREFIX}{s}-00000.jsonl", ("\n".join(lines) + "\n").encode()
    span = max(1.0, now - 600.0 - started)
    per_commit_s = span / max(1, -(-committed // max(1, n_hosts)))
    for p in range(committed):
        host = p % max(1, n_hosts)
        marker = commit.CommitMarker(
            partition=p, fingerprint=sp.fingerprint, row_start=p * PARTITION_ROWS,
            row_count=PARTITION_ROWS, tokens=partition_tokens(p), block_rows=512,
            checksums={"layers.12.resid_post": [f"{(p * 8 + k) * 2654435761 % 2**32:08x}"
                                                for k in range(8)]},
            dtypes={"layers.12.resid_post": "bfloat16"}, attempt=f"host-{host:03d}-1",
            hosts=(f"host-{host:03d}",), timings_s={"total": round(per_commit_s, 3)},
            code_version="0.1.0", created_at=started + (p // max(1, n_hosts) + 1) * per_commit_s)
        yield layout.commit_key(p), store.dumps(config.to_dict(marker))
    for h in range(n_hosts):
        dead = h >= n_hosts - dead_hosts
        mine = list(range(h, committed, n_hosts))
        tokens_done = sum(partition_tokens(p) for p in mine)
        updated = now - 600.0 if dead else now - 2.0
        in_hand = committed + h
        rate = tokens_done / max(1.0, updated - started)
        hist = []
        for i in range(history_samples):
            t = started + (updated - started) * (i + 1) / history_samples
            hist.append((round(t, 1), int(tokens_done * (i + 1) / history_samples)))
        hb = heartbeat.Heartbeat(
            host=f"host-{h:03d}", replica=h, process_index=0, state="working",
            attempt=f"host-{h:03d}-1", updated_at=updated,
            partition=in_hand if in_hand < n_partitions else None, step=3, steps=8,
            tokens_done=tokens_done, tokens_per_s=round(rate, 1), partitions_done=len(mine),
            history=tuple(hist), job=job)
        yield layout.heartbeat_key(hb.host), store.dumps(config.to_dict(hb))
        if job:
            yield layout.log_key(job, hb.host), host_log(h, dead).encode()


def host_log(h: int, dead: bool) -> str:
    """A worker host's log as its launcher copies it: the worker's lines, the launcher's
    own "[actx: ...]" notes, and for a dead host the reason it died last."""
    lines = [f"I1127 12:00:{s:02d} worker.py:88] host-{h:03d}: partition {s}, step 8/8"
             for s in range(40)]
    lines.append("[actx: log copied into the run]")
    if dead:
        lines.insert(-1, f"RuntimeError: host-{h:03d}: TPU slice preempted "
                         f"(maintenance event {h * 37 % 1000})")
    return "\n".join(lines) + "\n"


def write_local(root: str, exclude_prefix: str | None = None, **kwargs) -> str:
    """Writes `objects(**kwargs)` under directory `root` with plain file writes."""
    made = set()
    for key, data in objects(**kwargs):
        if exclude_prefix and key.startswith(exclude_prefix):
            continue
        path = os.path.join(root, *key.split("/"))
        parent = os.path.dirname(path)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        with open(path, "wb") as f:
            f.write(data)
    return root


def write_store(run_uri: str, only_prefix: str | None = None, **kwargs) -> str:
    """Writes `objects(**kwargs)` through the run's ObjectStore (memory://, gs://);
    heartbeats with their summary, as `heartbeat.HeartbeatWriter` writes them."""
    s = store.open_store(run_uri)
    for key, data in objects(**kwargs):
        if only_prefix and not key.startswith(only_prefix):
            continue
        if key.startswith(layout.WORKERS_PREFIX):
            hb = config.from_dict(heartbeat.Heartbeat, json.loads(data))
            s.write_with_summary(key, data, heartbeat.summary(hb))
        else:
            s.write(key, data)
    return run_uri
