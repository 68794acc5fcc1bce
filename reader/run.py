"""The reader's front door: `open_run`, and a `Run`'s hand-over methods.

A `Run` is a `reader.snapshot.RunSnapshot` (hooks, committed partitions, checks, random
access) with the methods that hand the run to the modules above it: `document` and
`select` (reader.provenance), `batches` (reader.batches), `stream` (reader.streaming.stream),
`compute_stats` and `stats` (reader.stats), `generations` (a generating run's samples:
reader.generation_records). This module sits above all of them and none
imports it, so the reader has no import circle. The keywords of `stream` and `batches`
are sorted here into their option groups (reader.options).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Sequence

from actx.reader import batches as batches_lib
from actx.reader import errors
from actx.reader import generation_records
from actx.reader import options as options_lib
from actx.reader import provenance
from actx.reader import stats as stats_lib
from actx.reader import stored_stats
from actx.reader.streaming import follow as follow_lib
from actx.reader.streaming import stream as stream_lib
from actx.reader.snapshot import HookInfo, RunSnapshot
from actx.schemas import advice
from actx.schemas import errors as schemas_errors
from actx.schemas import hook_aliases
from actx.schemas import layout
from actx.schemas import run_dir
from actx.schemas import uri as uri_lib
from actx.schemas import verification

__all__ = ["HookInfo", "Run", "open_run"]


def open_run(uri: "str | os.PathLike | uri_lib.Location", extraction: str = "") -> "Run":
    """Opens a run directory (local path, gs://bucket/path or memory://name); `extraction`
    names one of its extractions (schemas.extraction; "" the default one). Several read
    together, token for token: reader.aligned."""
    from actx.schemas import extraction as extraction_lib

    try:
        opened = run_dir.open_run(uri)
        spec = extraction_lib.read_spec(opened, extraction)
    except (schemas_errors.NotARunError, extraction_lib.UnknownExtractionError,
            extraction_lib.ExtractionMismatch) as e:
        raise errors.NotARunError(str(e)) from None
    run = Run(opened.extraction(extraction).store, spec, opened.manifest,
              extraction=extraction)
    record = run.latest_verification()  # one listing (and a read where verify ran)
    if isinstance(record, verification.DamagedRecord):
        warnings.warn(f"{run.location}: {record.damage}", errors.FailedVerificationWarning,
                      stacklevel=2)
    failed = run.failed_in(record)
    if failed:
        names = ", ".join(layout.partition_name(p) for p in failed[:10])
        more = f" and {len(failed) - 10} more" if len(failed) > 10 else ""
        warnings.warn(
            f"{run.location}: the latest `actx verify` found {len(failed)} committed "
            f"partition(s) whose data is not what their markers say ({names}{more}): what "
            f"is read of them may be wrong (a changed object reads as its new bytes; one that is "
            f"gone is refused: reader.LostDataError). "
            f"`{advice.repair(run.location)}` turns them back into pending, then "
            f"`{advice.rerun(run.location)}` extracts them again",
            errors.FailedVerificationWarning, stacklevel=2)
    return run


class Run(RunSnapshot):
    """A run directory opened for reading. Build with `open_run`."""

    def describe(self) -> dict:
        """A plain summary: hooks (shape, dtype, and `transformer_lens`: the
        TransformerLens name of equal value the reader also accepts, None where there is
        none: schemas.hook_aliases), the model's architecture, partitions committed and not, the
        tokens each mask removes (reader.masks; None until `compute_stats` counted them)
        and, for a generating run (run.json's `generate`), what its committed partitions
        generated (None for any other run): prompts (distinct prompt documents), samples,
        generated_tokens (stop tokens included), stop_reasons ({"stop_token": n,
        "length": n}), partitions (records counted) and unreadable (committed partitions
        whose generated/ record could not be read: not counted; `generations()` says
        why)."""
        return {
            "location": str(self.location), "extraction": self.extraction,
            "fingerprint": self.spec.fingerprint,
            "seq_len": self.seq_len, "total_rows": self.total_rows,
            "hooks": {h: {"shape": list(i.shape), "dtype": i.dtype,
                          "transformer_lens": hook_aliases.transformer_lens_name(
                              h, self.architecture, self.transformer_lens_differs)}
                      for h, i in self.hooks.items()},
            "architecture": self.architecture,
            "committed": list(self.committed),
            "uncommitted": [p.id for p in self.uncommitted_partitions],
            "masks": stored_stats.load_masks(self),
            "generation": (None if self.spec.generate is None else generation_records.count(
                generation_records.read_records(self.store, self.committed))),
            "failed_verification": list(self.failed_verification),
        }

    @property
    def failed_verification(self) -> tuple[int, ...]:
        """Committed partitions whose data the latest `actx verify` found not as their
        markers say (verify/latest.json; () where it never ran or found none): what is
        read of them may be wrong until they are repaired and extracted again."""
        return self.failed_in(self.latest_verification())

    def latest_verification(self):
        """verify/latest.json as schemas.verification.read_record_or_damage gives it (None
        where verify never ran, or the store refused: the reads will say that)."""
        try:
            # A listing first: where verify never ran (most runs) a read of the missing
            # record would cost GCS a second request; a listing is one either way.
            if layout.VERIFY_RECORD_KEY not in self.store.list(layout.VERIFY_RECORD_KEY):
                return None
            return verification.read_record_or_damage(self.store)
        except Exception:  # noqa: BLE001 - the store's refusal: the reads will say it
            return None

    def failed_in(self, record) -> tuple[int, ...]:
        """The committed partitions a verification record (`latest_verification`) failed."""
        committed = set(self.committed)
        return tuple(p for p in (record.failed if record else ()) if p in committed)

    def generations(self, partitions: Sequence[int] | None = None) -> list[dict]:
        """The samples a generating run (run.json's `generate`) wrote in its committed
        partitions (`partitions`: these committed ids only), one dict per sample in
        doc_index order, as its worker recorded them (generated/p-NNNNN.json, the
        partition its document starts in): doc_index, sample, prompt_doc (the prompt's
        document: doc_index - sample), prompt_tokens, generated_tokens (stop token
        included), stop_reason ("stop_token" or "length"), generated_ids, text (decoded,
        special tokens kept), "arc" (an ARC task's verdict) where the prompt is one, and
        partition (the record's). Raises ReaderError for a run that does not generate or
        a committed partition whose record is missing or damaged."""
        return generation_records.committed_samples(self, self.committed_ids(partitions))

    # -- documents and provenance (see reader.provenance) -------------------------

    def document(self, doc: "int | str", hooks: Sequence[str] | None = None):
        """All tokens of one document (by doc_index or doc_id), across rows it continues
        into: a `provenance.Selection` with activations per hook."""
        self.require_commits()
        return provenance.document(self, doc, hooks)

    def select(self, hooks: "str | Sequence[str] | None" = None, **filters):
        """Tokens matching ARC provenance filters (see `provenance.select`)."""
        self.require_commits()
        return provenance.select(self, hooks, **filters)

    # -- batches and statistics ---------------------------------------------------

    def batches(self, hooks: "str | Sequence[str]", batch_size: int, *,
                resume: "stream_lib.StreamState | dict | None" = None, **keywords):
        """Batches in one exact global permutation of the valid tokens (see
        `reader.batches.TokenBatches`): reproducible token for token, slow from storage.
        Keywords: reader.options' groups, batches.ExactOptions and follow.FollowOptions:
        follow=True reads a live run as its partitions commit, each window of the commit
        order in one exact permutation (`reader.streaming.follow`), and resume= takes a
        saved `state(batch)` of such batches (without follow, start_step= resumes)."""
        tokens, order, output, exact, follow = options_lib.from_keywords(
            "batches", keywords, options_lib.TokenOptions, options_lib.OrderOptions,
            options_lib.OutputOptions, batches_lib.ExactOptions, follow_lib.FollowOptions)
        if follow.follow:
            return follow_lib.FollowStream(self, hooks, batch_size, tokens=tokens, order=order,
                                           output=output, follow=follow, exact=exact,
                                           resume=resume)
        if resume is not None:
            raise TypeError("resume: only with follow=True (exact batches of a complete run "
                            "resume with start_step=, the step after the last one taken)")
        _no_follow_options(follow)
        self.require_commits()
        return batches_lib.TokenBatches(self, hooks, batch_size, tokens=tokens, order=order,
                                        output=output, exact=exact)

    def stream(self, hooks: "str | Sequence[str]", batch_size: int, *,
               resume: "stream_lib.StreamState | dict | None" = None,
               _follower: "follow_lib.CommitFollower | None" = None, **keywords):
        """Shuffled batches at the speed of sequential reads, with a bounded buffer (see
        `reader.streaming.stream.ShuffledStream`): what training reads. Keywords: reader.options'
        groups, stream.ReadOptions and follow.FollowOptions; resume: a saved
        `state(batch)`. follow=True reads a live run as its partitions commit, every
        token once in its first epoch, and ends when the run is complete
        (`reader.streaming.follow.FollowStream`)."""
        tokens, order, output, reads, follow = options_lib.from_keywords(
            "stream", keywords, options_lib.TokenOptions, options_lib.OrderOptions,
            options_lib.OutputOptions, stream_lib.ReadOptions, follow_lib.FollowOptions)
        if follow.follow:
            return follow_lib.FollowStream(self, hooks, batch_size, tokens=tokens, order=order,
                                           output=output, reads=reads, follow=follow,
                                           resume=resume, follower=_follower)
        _no_follow_options(follow)
        self.require_commits()
        return stream_lib.ShuffledStream(self, hooks, batch_size, tokens=tokens, order=order,
                                         output=output, reads=reads, resume=resume)

    def compute_stats(self, hooks: Sequence[str] | None = None, **kwargs):
        """Streams every committed token once and stores per-hook statistics."""
        self.require_commits()
        return stats_lib.compute_stats(self, hooks, **kwargs)

    def stats(self, hook: str):
        """Stored statistics of a hook (computed by `compute_stats`)."""
        self.require_commits()
        return stored_stats.load_stats(self, self.resolve_hook(hook))


def _no_follow_options(follow: follow_lib.FollowOptions) -> None:
    """A follow keyword without follow=True would be ignored: say so instead."""
    given = [f.name for f in dataclasses.fields(follow)
             if getattr(follow, f.name) != f.default]
    if given:
        raise TypeError(f"{', '.join(given)}: only with follow=True (a stream that follows a "
                        f"live run's commits)")
