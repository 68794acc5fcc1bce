"""The outcome of `actx verify`: `verify/latest.json`, so status and the live page can show
which committed partitions failed verification without re-reading any activation data.

A verify of some partitions (`--only`) updates the record for those partitions and keeps
what earlier verifies said about the others.
"""

from __future__ import annotations

import dataclasses

from actx.schemas import advice
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
    """The record (None where verify never ran); ValueError where it is damaged."""
    data = store.read_json(layout.VERIFY_RECORD_KEY)
    if data is None:
        return None
    return config_lib.from_dict(VerificationRecord, data,
                                f"{store.location.join(layout.VERIFY_RECORD_KEY)}: ")


def damage(store, error: ValueError) -> str:
    """What to say of a damaged record (`read_record`'s error), in one line with the
    command that writes it anew: what the latest verify found cannot be told."""
    said = str(error).split("; the object is damaged")[0]  # the store's own advice aside
    where = str(store.location.join(layout.VERIFY_RECORD_KEY))
    said = said if said.startswith(where) else f"{where}: {said}"
    return (f"the record of the latest verify is damaged ({said}): which committed "
            f"partitions it found failing cannot be told; `{advice.verify(store.location)}` "
            f"checks them again and writes it anew")


@dataclasses.dataclass(frozen=True)
class DamagedRecord(VerificationRecord):
    """A record that cannot be read, as status and the reader show it (never written):
    `damage` says so with the command that writes it anew."""

    damage: str = ""


def read_record_or_damage(store) -> VerificationRecord | None:
    """The record as status and the reader show it: a damaged one as a DamagedRecord
    (a verify whose outcome cannot be told) rather than an error that stops them."""
    try:
        return read_record(store)
    except ValueError as e:  # config.ConfigError too
        said = damage(store, e)
        return DamagedRecord(at=0.0, checked=0, failed=(), problems=(said,), damage=said)


def update_record(store, at: float, checked: list[int], failed: list[int],
                  problems: list[str], repaired: list[int] = ()) -> VerificationRecord:
    """Merges one verify's outcome into the record and writes it (a partition checked
    now is no longer one repaired and unverified)."""
    try:
        previous = read_record(store)
    except ValueError:  # damaged: this verify's outcome replaces it (what it said is lost)
        previous = None
    earlier_failed = set(previous.failed) if previous else set()
    earlier_repaired = set(previous.repaired) if previous else set()
    record = VerificationRecord(
        at=at, checked=len(checked) if previous is None else max(previous.checked, len(checked)),
        failed=tuple(sorted((earlier_failed - set(checked)) | set(failed))),
        problems=tuple(problems[:MAX_PROBLEMS]),
        repaired=tuple(sorted((earlier_repaired - set(checked)) | set(repaired))))
    store.write_json(layout.VERIFY_RECORD_KEY, config_lib.to_dict(record))
    return record
