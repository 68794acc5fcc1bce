"""Extractions: several models' activations over one token store (schemas.layout).

A run's root is its default extraction (today's layout, the root run.json's model). A
named extraction (`base`, `chat`, ...) is the run's spec with another model and capture,
kept at `extractions/<name>/run.json` beside its own activations, numerics record,
commit markers, claims and statistics. Everything that reads or writes one extraction
goes through its view of the run's store (`schemas.extraction_store`). This module holds
what an extraction's spec is: reading it, adding one, a run scoped to one.
"""

from __future__ import annotations

import dataclasses

from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import object_store
from actx.schemas import run_dir
from actx.schemas.extraction_store import named, names, view
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib


class UnknownExtractionError(errors.UserError, KeyError):
    """A name that is not one of the run's extractions."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ExtractionMismatch(errors.UserError, ValueError):
    """An extraction spec that cannot share the run's token store."""


def shown(name: str) -> str:
    """How messages name an extraction."""
    return f"extraction {name!r}" if name else "the default extraction"


def read_spec(opened: run_dir.OpenedRun, name: str) -> runspec_lib.RunSpec:
    """The RunSpec of extraction `name` of an opened run ("" the root run.json), checked
    to share the run's token store."""
    if not name:
        return opened.spec
    ext_store = view(opened.store, name)
    try:
        spec = runspec_lib.read_run_spec(ext_store)
    except object_store.DamagedObjectError as e:
        raise ExtractionMismatch(
            f"{opened.location.join(layout.extraction_key(name, runspec_lib.RUN_SPEC_KEY))}: "
            f"{e.what}: extraction {name!r}'s spec is damaged; `actx submit` with the run's "
            f"config (its `extractions` table names {name!r}) writes it again, and keeps "
            f"what the extraction committed where the config's spec is the one its commit "
            f"markers record") from None
    except FileNotFoundError:
        known = ", ".join(repr(n) for n in named(opened.store)) or "none"
        raise UnknownExtractionError(
            f"{opened.location}: no extraction {name!r} (named extractions: {known}); add it "
            f"to the `extractions` table of the run's submit config and `actx submit` it "
            f"(the prepared tokens are kept), or schemas.extraction.add") from None
    # The tokens are the run's, so is the record of the tokenizer that made them (an
    # extraction recorded before its run was prepared has none of its own).
    spec = dataclasses.replace(spec, tokenizer_identity=opened.spec.tokenizer_identity)
    if spec.tokens_fingerprint != opened.spec.tokens_fingerprint:
        raise ExtractionMismatch(
            f"{opened.location.join(layout.extraction_key(name, runspec_lib.RUN_SPEC_KEY))}: "
            f"its token settings differ from the run's run.json; the file was edited by "
            f"hand. Restore it, or add the extraction again")
    return spec


def spec_for(run_spec: runspec_lib.RunSpec, model: runspec_lib.ModelSpec,
             capture: runspec_lib.CaptureConfig) -> runspec_lib.RunSpec:
    """The spec of an extraction of `run_spec`'s token store with `model` and `capture`."""
    return dataclasses.replace(run_spec, model=model, capture=capture)


def add(store: store_lib.ObjectStore, run_spec: runspec_lib.RunSpec, name: str,
        spec: runspec_lib.RunSpec) -> bool:
    """Records extraction `name` of a prepared run (`run_spec` its root run.json) with
    `spec` (a RunSpec that differs from it in model and capture only). True when written
    now; False when the run already has it with this spec. An extraction with another spec
    is replaced while it has committed nothing, else refused (CommittedRunError)."""
    layout.check_extraction_name(name)
    if spec.tokens_fingerprint != run_spec.tokens_fingerprint:
        raise ExtractionMismatch(
            f"{store.location}: extraction {name!r} differs from the run in more than model "
            f"and capture; an extraction shares the run's tokens, so only model.* and "
            f"capture.* may differ. Prepare a new run for other token settings")
    # The tokens are the run's, so is the record of the tokenizer that made them.
    spec = dataclasses.replace(spec, tokenizer_identity=run_spec.tokenizer_identity)
    ext_store = view(store, name)
    try:
        existing = ext_store.read_json(runspec_lib.RUN_SPEC_KEY)
    except object_store.DamagedObjectError:
        # Damaged (not JSON): written again where what the extraction committed is this
        # spec's (its markers record the fingerprint), or where it committed nothing.
        existing = None
        committed = sorted(commit_lib.committed_partitions(ext_store))
        recorded = next(commit_lib.readable_markers(ext_store, committed), None)
        if recorded is not None and recorded.fingerprint != spec.fingerprint:
            raise run_dir.CommittedRunError(
                f"{store.location}: extraction {name!r}'s run.json is damaged, and its "
                f"commit markers are of fingerprint {recorded.fingerprint}, not this spec's "
                f"({spec.fingerprint}); add the extraction under another name, or submit "
                f"the config its partitions were extracted with") from None
        if not committed:
            # Nothing committed: what an earlier attempt left (its activations record,
            # which names the spec it was written for, and its claims) goes, as when an
            # uncommitted extraction's readable spec is replaced; a worker would refuse
            # that record for this spec.
            run_dir.record_change(store, "extraction-spec", {
                "extraction": name, "from_fingerprint": None,
                "to_fingerprint": spec.fingerprint, "changed": ["run.json (damaged)"]})
            _clear_uncommitted(ext_store)
    if existing is not None:
        old = runspec_lib.RunSpec.from_dict(existing)
        if old.fingerprint == spec.fingerprint:
            # Its name too, in case an earlier call stopped between the two writes.
            store.create_json(layout.extraction_name_key(name), {"name": name})
            return False
        changed = old.extraction_changes(spec)
        committed = commit_lib.committed_partitions(ext_store)
        if committed:
            raise run_dir.CommittedRunError(
                f"{store.location}: extraction {name!r} has {len(committed)} committed "
                f"partition(s) with the earlier {', '.join(changed)}; activations of two "
                f"settings would mix. Add it under another name")
        run_dir.record_change(store, "extraction-spec", {
            "extraction": name, "from_fingerprint": old.fingerprint,
            "to_fingerprint": spec.fingerprint, "changed": changed})
        _clear_uncommitted(ext_store)
    ext_store.write_json(runspec_lib.RUN_SPEC_KEY, spec.to_json_obj())
    store.create_json(layout.extraction_name_key(name), {"name": name})  # after its spec
    return True


def _clear_uncommitted(ext_store: store_lib.ObjectStore) -> None:
    """Deletes what an extraction that committed nothing holds besides its spec."""
    for prefix in (f"{layout.ACTIVATIONS_GROUP}/", layout.CLAIMS_PREFIX):
        ext_store.delete_prefix(prefix)


def scoped(opened: run_dir.OpenedRun, name: str) -> run_dir.OpenedRun:
    """The opened run as extraction `name` sees it: its spec and store view, the shared
    manifest (what status, rerun and verify take)."""
    if not name:
        return opened
    return run_dir.OpenedRun(opened.location, view(opened.store, name),
                             read_spec(opened, name), opened.manifest)


def parse(text: str | None) -> list[str]:
    """The extractions a comma-separated list names, in order, "" for the default one
    (written "default", or nothing: None names the default alone); not checked against a
    run (`select` does that)."""
    return ["" if n.strip() in ("", "default") else n.strip() for n in (text or "").split(",")]


def joined(names) -> str:
    """The comma-separated list that `parse` reads back ("default" for "")."""
    return ",".join(name or "default" for name in names)


def select(store: store_lib.ObjectStore, wanted: str | None) -> list[str]:
    """The extractions a command names: None or "all" every one of the run (`names`),
    else a comma-separated list ("default" or "" names the root one), each checked."""
    if wanted in (None, "all"):
        return names(store)
    chosen = parse(wanted)
    known = named(store)
    for name in chosen:
        if name and name not in known:
            raise UnknownExtractionError(
                f"{store.location}: no extraction {name!r} (named extractions: "
                f"{', '.join(known) or 'none'})")
    return chosen


def scoped_all(opened: run_dir.OpenedRun, wanted: str | None) -> dict[str, run_dir.OpenedRun]:
    """{name: the run as that extraction sees it} for the extractions `wanted` names
    (`select`; None: every one of the run), in order; "" is the default extraction."""
    return {name: scoped(opened, name) for name in select(opened.store, wanted)}
