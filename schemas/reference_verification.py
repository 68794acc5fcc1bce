"""The outcome of `actx verify --reference`: `verify/reference.json` (in a named
extraction, under its own verify/), so status and the live page can say whether stored
values were recomputed with the model and matched, without recomputing anything.

Each reference verify replaces the record: it is the latest check of a sample, not a
per-partition state (`verify/latest.json`, schemas.verification, holds that).
"""

from __future__ import annotations

import dataclasses

from actx.schemas import config as config_lib

REFERENCE_RECORD_KEY = "verify/reference.json"
MAX_FAILURES = 100  # the record keeps the first; `actx verify --reference` prints them all


@dataclasses.dataclass(frozen=True)
class CheckedDocument:
    """One recomputed unit: a document (`doc_id`, its doc_index) or, in `concat` runs, a
    row (one causal stream). partition: where it starts; tokens: stored tokens compared;
    past_max_context: how many of them did not see their document from its start;
    worst: per hook, the worst relative error of its tokens."""

    what: str
    partition: str
    tokens: int
    past_max_context: int
    worst: dict[str, float]


@dataclasses.dataclass(frozen=True)
class ReferenceRecord:
    """at: unix time; ok: every compared value within `tolerance`; reference: what
    recomputed them (e.g. "transformers 5.2.0 on torch 2.13.0 (cpu), float32"); seed and
    sample: how the documents were chosen; hooks: per hook, the worst relative error over
    the sample; tolerance: the bound for the run's stored and compute dtypes; documents:
    what was recomputed; failures: "document d7 (partition p-00002), hook ...: relative
    error 0.41 > tolerance 0.0001" lines; not_recomputed: stored hooks the reference has no
    counterpart for, left out of the comparison (a mixture of experts' router hooks: HF
    transformers' forward gives no expert choice to compare with; absent in records
    written before it existed)."""

    at: float
    ok: bool
    reference: str
    seed: int
    sample: int
    tolerance: float
    hooks: dict[str, float]
    documents: tuple[CheckedDocument, ...] = ()
    failures: tuple[str, ...] = ()
    not_recomputed: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line, as status shows it."""
        tokens = sum(d.tokens for d in self.documents)
        worst = max(self.hooks.values(), default=0.0)
        head = (f"{units(self)}, {tokens:,} tokens recomputed with "
                f"{self.reference}; worst relative error {worst:.2g} (tolerance "
                f"{self.tolerance:.2g})")
        if self.ok:
            return f"reference: OK: {head}"
        return f"reference: FAILED: {self.failures[0] if self.failures else head}"


def units(record: ReferenceRecord) -> str:
    """"4 document(s)", or "3 row(s)" for a concat run's rows."""
    rows = all(d.what.startswith("row ") for d in record.documents) and record.documents
    return f"{len(record.documents)} {'row' if rows else 'document'}(s)"


def read_record(store) -> ReferenceRecord | None:
    data = store.read_json(REFERENCE_RECORD_KEY)
    if data is None:
        return None
    return config_lib.from_dict(ReferenceRecord, data,
                                f"{store.location.join(REFERENCE_RECORD_KEY)}: ")


def write_record(store, record: ReferenceRecord) -> None:
    record = dataclasses.replace(record, failures=record.failures[:MAX_FAILURES])
    store.write_json(REFERENCE_RECORD_KEY, config_lib.to_dict(record))
