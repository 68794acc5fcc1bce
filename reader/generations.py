"""A generating run's sample records (`generated/p-NNNNN.json`, layout.generated_key): what
each sample wrote, why it stopped and, for an ARC task, its answer's verdict; read for the
committed partitions only (a record is written before its partition's marker)."""

from __future__ import annotations

import json
from typing import Sequence

from actx.schemas import arc_answer
from actx.schemas import layout


def samples(run, partitions: Sequence[int]) -> list[dict]:
    """The records' samples of `partitions` (committed ones), in doc_index order."""
    out = []
    for pid in partitions:
        data = run.store.read(run.stored_key(layout.generated_key(pid)))
        if data is None:
            raise FileNotFoundError(
                f"{run.location.join(run.stored_key(layout.generated_key(pid)))}: missing "
                f"although partition {pid} is committed; run `actx verify`")
        record = json.loads(data)
        if record.get("version", 0) > layout.GENERATED_VERSION:
            raise ValueError(f"{run.location}: generation record version {record['version']} "
                             f"is newer than this actx reads ({layout.GENERATED_VERSION}); "
                             f"upgrade actx")
        out += record["samples"]
    return sorted(out, key=lambda s: s["doc_index"])


def documents_with_verdict(run, partitions: Sequence[int], verdict: str) -> list[int]:
    """The doc_index of every sample whose ARC answer has `verdict`."""
    if verdict not in arc_answer.VERDICTS:
        raise ValueError(f"arc_verdict: {verdict!r} is none of {', '.join(arc_answer.VERDICTS)}")
    return [s["doc_index"] for s in samples(run, partitions)
            if s.get("arc", {}).get("verdict") == verdict]
