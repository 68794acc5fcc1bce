"""A generating run's sample records (`generated/p-NNNNN.json`, layout.generated_key) read
for many partitions at once, and the counts `run.describe()`, `actx status` and the live
page show of them: prompts, samples, generated tokens and why the samples stopped.

A record holds the samples whose documents start in its partition and is written before
that partition's commit marker, so the records of the committed partitions hold every
committed sample once. Reads go through `store.read_many` (parallel where a read is a
round trip, as for heartbeats). Depends only on schemas, so deploy's status counts with
the code the reader uses.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

from actx.reader import errors
from actx.schemas import arc_answer
from actx.schemas import extraction_store
from actx.schemas import layout

# What stopped a sample (the worker's `stop_reason`), in the order counts list them.
STOP_REASONS = ("stop_token", "length")


def read_records(store, partitions: Iterable[int]) -> dict[int, "dict | str"]:
    """{partition id: its record, or why it cannot be read (missing, not JSON, a newer
    version)}, for `partitions` (the caller's committed ones), read in parallel."""
    ids = sorted(set(partitions))
    keys = [layout.generated_key(pid) for pid in ids]
    out: dict[int, dict | str] = {}
    for pid, key, data in zip(ids, keys, store.read_many(keys) if keys else []):
        where = _stored_at(store, key)
        if data is None:
            out[pid] = (f"{where}: missing, but partition {pid} is committed (its worker "
                        f"writes it before the marker): delete "
                        f"{_stored_at(store, layout.commit_key(pid))} and `actx rerun` the "
                        f"run")
            continue
        try:
            record = json.loads(data)
            version = record["version"]
            record["samples"]
        except (ValueError, TypeError, KeyError) as e:
            out[pid] = f"{where}: not a generation record ({type(e).__name__}: {e})"
            continue
        if version > layout.GENERATED_VERSION:
            out[pid] = (f"{where}: generation record version {version} is newer than this "
                        f"actx reads ({layout.GENERATED_VERSION}); upgrade actx")
            continue
        out[pid] = record
    return out


def _stored_at(store, key: str) -> str:
    """Where `key` of an extraction's view (schemas.extraction) lies, for messages."""
    name = store.name if isinstance(store, extraction_store.ExtractionStore) else ""
    return str(store.location.join(layout.extraction_key(name, key)))


def samples(records: dict[int, "dict | str"]) -> list[dict]:
    """Every sample of `records` (read_records' readable ones), each with its "partition"
    added, in doc_index order."""
    out = [{**s, "partition": pid} for pid, record in records.items()
           if isinstance(record, dict) for s in record["samples"]]
    return sorted(out, key=lambda s: s["doc_index"])


def count(records: dict[int, "dict | str"]) -> dict:
    """What the readable `records` hold: prompts (distinct prompt documents), samples,
    generated_tokens (stop tokens included), stop_reasons ({reason: samples}, each of
    STOP_REASONS present, 0 or more), partitions (records counted) and unreadable (the
    partition ids whose record could not be read: not counted)."""
    return _total({pid: _summary(r) if isinstance(r, dict) else r
                   for pid, r in records.items()})


class CountCache:
    """`count` over a run's committed partitions, each record read once per process: a
    status that polls (a launcher's progress line, `actx status --follow`, the live page)
    reads only the records of partitions committed since its last poll, not every one at
    every poll (100k partitions every 5 s would pass a bucket's 5,000 reads a second).

    A record does not change while its partition stays committed (written before the
    marker; only a repair, which deletes the marker, lets a rerun write it again), so a
    partition that leaves the committed set is forgotten. An unreadable record is read
    again at the next poll."""

    def __init__(self):
        self._summaries: dict[int, tuple] = {}

    def count(self, store, committed: Iterable[int]) -> dict:
        committed = set(committed)
        for pid in set(self._summaries) - committed:
            del self._summaries[pid]
        found = {}
        for pid, record in read_records(store, committed - set(self._summaries)).items():
            if isinstance(record, dict):
                self._summaries[pid] = _summary(record)
            else:
                found[pid] = record
        return _total({**self._summaries, **found})


def _summary(record: dict) -> tuple:
    """What `count` needs of one readable record: (its prompt documents, samples,
    generated tokens, {stop reason: samples})."""
    entries = record["samples"]
    reasons: dict[str, int] = {}
    for e in entries:
        reasons[e["stop_reason"]] = reasons.get(e["stop_reason"], 0) + 1
    return (frozenset(e["prompt_doc"] for e in entries), len(entries),
            sum(e["generated_tokens"] for e in entries), reasons)


def _total(summaries: dict[int, "tuple | str"]) -> dict:
    """`count`'s result from per-partition summaries (a str: the record was unreadable)."""
    readable = [s for s in summaries.values() if not isinstance(s, str)]
    reasons = dict.fromkeys(STOP_REASONS, 0)
    for _, _, _, theirs in readable:
        for reason, n in theirs.items():
            reasons[reason] = reasons.get(reason, 0) + n
    prompts: set = set()
    for docs, _, _, _ in readable:
        prompts |= docs
    return {"prompts": len(prompts), "samples": sum(s[1] for s in readable),
            "generated_tokens": sum(s[2] for s in readable), "stop_reasons": reasons,
            "partitions": len(readable),
            "unreadable": sorted(pid for pid, s in summaries.items() if isinstance(s, str))}


def committed_samples(run, partitions: Sequence[int]) -> list[dict]:
    """Every sample of `partitions` (committed ids of `run`, a reader snapshot) as
    `samples` gives them; ReaderError for a run that does not generate or a committed
    partition whose record cannot be read."""
    if run.spec.generate is None:
        raise errors.ReaderError(f"{run.location}: this run does not generate (its "
                                 f"run.json has no generate section): it holds no samples")
    records = read_records(run.store, partitions)
    bad = [why for why in records.values() if isinstance(why, str)]
    if bad:
        raise errors.ReaderError(f"{len(bad)} committed partition(s) have no readable "
                                 f"generation record: {bad[0]}")
    return samples(records)


def documents_with_verdict(run, partitions: Sequence[int], verdict: str) -> list[int]:
    """The doc_index of every sample of `partitions` whose ARC answer has `verdict`."""
    if verdict not in arc_answer.VERDICTS:
        raise ValueError(f"arc_verdict: {verdict!r} is none of {', '.join(arc_answer.VERDICTS)}")
    return [s["doc_index"] for s in committed_samples(run, partitions)
            if s.get("arc", {}).get("verdict") == verdict]
