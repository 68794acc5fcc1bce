"""The outcome of `actx verify`: `verify/latest.json`, so status and the live page can show
which committed partitions failed verification without re-reading any activation data.

A verify of some partitions (`--only`) updates the record for those partitions and keeps
what earlier verifies said about the others.
"""

from __future__ import annotations

import dataclasses

from actx.schemas import config as config_lib
from actx.schemas import layout

MAX_PROBLEMS = 100  # the record keeps the first problems; `actx verify` prints them all


@dataclasses.dataclass(frozen=True)
class VerificationRecord:
    """at: unix time of the latest verify; checked: partitions verified so far (count);
    failed: ids of committed partitions whose data did not match their marker (or could
    not be read); problems: the first problems of the latest verify, as it printed them;
    repaired: partitions a verify failed and `--repair` turned back into pending, not
    verified since (absent in records written before it was kept: none)."""

    at: float
    checked: int
    failed: tuple[int, ...]
    problems: tuple[str, ...] = ()
    repaired: tuple[int, ...] = ()


def read_record(store) -> VerificationRecord | None:
    data = store.read_json(layout.VERIFY_RECORD_KEY)
    if data is None:
        return None
    return config_lib.from_dict(VerificationRecord, data,
                                f"{store.location.join(layout.VERIFY_RECORD_KEY)}: ")


def update_record(store, at: float, checked: list[int], failed: list[int],
                  problems: list[str], repaired: list[int] = ()) -> VerificationRecord:
    """Merges one verify's outcome into the record and writes it (a partition checked
    now is no longer one repaired and unverified)."""
    previous = read_record(store)
    earlier_failed = set(previous.failed) if previous else set()
    earlier_repaired = set(previous.repaired) if previous else set()
    record = VerificationRecord(
        at=at, checked=len(checked) if previous is None else max(previous.checked, len(checked)),
        failed=tuple(sorted((earlier_failed - set(checked)) | set(failed))),
        problems=tuple(problems[:MAX_PROBLEMS]),
        repaired=tuple(sorted((earlier_repaired - set(checked)) | set(repaired))))
    store.write_json(layout.VERIFY_RECORD_KEY, config_lib.to_dict(record))
    return record
