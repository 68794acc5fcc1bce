"""A work unit's documents, tokenized once, as flat numpy arrays: what prepare's first pass
stores for its second (`prepare/units/<unit id>.npz` in the run directory, removed when the
run is prepared), and the small summary that the global plan sees instead.

Token data never travels through the pipeline: the first pass writes it here, the plan
moves only `UnitSummary` (one int32 per document), and the partition writers read it back.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import io
import json
from typing import Iterable

import numpy as np

from actx.pipeline import arc_render
from actx.pipeline import generation_docs
from actx.pipeline import sources
from actx.pipeline import tokenize
from actx.pipeline import units as units_lib
from actx.schemas import runspec as runspec_lib

UNITS_PREFIX = "prepare/units/"
ENCODE_BATCH_DOCS = 512  # documents per tokenizer call (its threads split a batch)
ENCODE_BATCH_CHARS = 4 << 20  # ... or fewer, so a batch of long documents stays small
ENCODERS = 2  # batches in the tokenizer at once (each call spreads over all cores)


def cache_key(unit_id: str) -> str:
    return f"{UNITS_PREFIX}{unit_id}.npz"


@dataclasses.dataclass
class UnitTokens:
    """lengths: int32 [docs] tokens per document; token_ids: int32 [sum(lengths)], the
    documents back to back; arc_attrs: int32 [len(CHAR_ATTRS), sum(lengths)] (ARC units
    only); variants: int32 [docs]; task_ids / metas: per document (None / doc-table fields).
    """

    lengths: np.ndarray
    token_ids: np.ndarray
    arc_attrs: np.ndarray | None
    variants: np.ndarray
    task_ids: list
    metas: list

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    def to_bytes(self) -> bytes:
        arrays = {"lengths": self.lengths, "token_ids": self.token_ids,
                  "variants": self.variants,
                  "json": np.frombuffer(json.dumps({"task_ids": self.task_ids,
                                                    "metas": self.metas}).encode(), np.uint8)}
        if self.arc_attrs is not None:
            arrays["arc_attrs"] = self.arc_attrs
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "UnitTokens":
        with np.load(io.BytesIO(data)) as z:
            extra = json.loads(z["json"].tobytes())
            return cls(z["lengths"], z["token_ids"],
                       z["arc_attrs"] if "arc_attrs" in z.files else None, z["variants"],
                       extra["task_ids"], extra["metas"])


@dataclasses.dataclass(frozen=True)
class UnitSummary:
    """All the plan learns of a unit. records: distinct input records with documents (an
    ARC task with all its variants is one); lengths: int32 [docs]; task_ids: sorted."""

    unit: units_lib.WorkUnit
    records: int
    lengths: np.ndarray
    task_ids: tuple[str, ...]

    @property
    def docs(self) -> int:
        return len(self.lengths)


def _batches(items: Iterable, max_docs: int, max_chars: int):
    batch, chars = [], 0
    for item in items:
        batch.append(item)
        chars += len(item.text) if isinstance(item, sources.TextRecord) else 4096
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_unit(loaded: tokenize.LoadedTokenizer, spec: runspec_lib.RunSpec,
                  unit: units_lib.WorkUnit, limit: int | None, rejects: list
                  ) -> tuple[UnitTokens, UnitSummary]:
    """Reads and tokenizes one unit in batches; its rejects are appended to `rejects`."""
    source = spec.sources[unit.source_index]

    def documents():
        for record in units_lib.read_unit(spec, unit, limit):
            if isinstance(record, sources.Reject):
                rejects.append(record)
            elif isinstance(record, sources.ArcTaskRecord):
                yield from tokenize.expand_arc_variants(record, source)
            else:
                yield record

    ids, attrs, lengths, variants, task_ids, metas, lines = [], [], [], [], [], [], set()
    prompts = []  # a generating run's documents, expanded into samples once all are read

    def store(docs):
        for doc in docs:
            ids.append(doc.token_ids)
            lengths.append(len(doc.token_ids))
            variants.append(doc.variant)
            task_ids.append(doc.task_id)
            metas.append(doc.meta)
            lines.add(doc.key[2])
            if doc.arc_attrs is not None:
                attrs.append(doc.arc_attrs)

    collect = store if spec.generate is None else prompts.extend
    # Batches encode in helper threads (the tokenizer releases the GIL) while this thread
    # reads the next batch and collects the ones before. Two encoders, so that one batch's
    # Python part (ids to arrays, records) never leaves the tokenizer's cores idle: the
    # other batch is in the tokenizer meanwhile.
    with concurrent.futures.ThreadPoolExecutor(ENCODERS) as encoder:
        pending: collections.deque = collections.deque()
        for batch in _batches(documents(), ENCODE_BATCH_DOCS, ENCODE_BATCH_CHARS):
            pending.append(encoder.submit(tokenize.encode_batch, loaded, spec, batch))
            if len(pending) > ENCODERS:
                collect(pending.popleft().result())
        while pending:
            collect(pending.popleft().result())
    if spec.generate is not None:
        store(generation_docs.sample_documents(prompts, spec, rejects))
    if attrs and len(attrs) != len(ids):
        raise ValueError(f"{unit.path}: ARC and text documents in one unit")
    n_attrs = len(arc_render.CHAR_ATTRS)
    tokens = UnitTokens(
        np.asarray(lengths, np.int32),
        np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32),
        np.concatenate(attrs, axis=1).astype(np.int32, copy=False) if attrs
        else (np.zeros((n_attrs, 0), np.int32) if source.kind == "arc" else None),
        np.asarray(variants, np.int32), task_ids, metas)
    summary = UnitSummary(unit, len(lines), tokens.lengths,
                          tuple(sorted({t for t in task_ids if t is not None})))
    return tokens, summary
