"""Opening a run directory: the one way every stage (workers, status, rerun, verify, the
reader) finds a prepared run's spec and manifest, with one error when it is not one.

What a stage then checks about the run (a worker's fingerprint, model and numerics; the
reader's committed hooks) is its own admission; this module only says whether the
location holds a prepared actx run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import uri as uri_lib

# Exceptions google-cloud-storage raises for a bucket that is missing or not ours, matched by
# name so that opening a local run never imports the client.
_ACCESS_ERRORS = ("NotFound", "Forbidden")


@dataclasses.dataclass
class OpenedRun:
    """A prepared run: where it is, its store, run.json and manifest.json."""

    location: uri_lib.Location
    store: store_lib.ObjectStore
    spec: runspec_lib.RunSpec
    manifest: manifest_lib.Manifest


def open_run(run: "str | os.PathLike | uri_lib.Location | store_lib.ObjectStore") -> OpenedRun:
    """Opens a prepared run, or raises errors.NotARunError saying what is missing or wrong.
    `run` may be its store, opened already (by a command that made the run).

    Object-store failures (no credentials, no network) raise store_errors.StoreError.
    """
    try:
        location = run.location if isinstance(run, store_lib.ObjectStore) else uri_lib.parse(run)
    except ValueError as e:
        raise errors.NotARunError(str(e)) from None
    if location.is_local and not os.path.isdir(location.path):
        shown = location if isinstance(run, store_lib.ObjectStore) else run
        raise errors.NotARunError(f"{shown}: no such directory; not an actx run")
    store = run if isinstance(run, store_lib.ObjectStore) else store_lib.open_store(location)
    try:
        # Both reads at once: on GCS each is a round trip, and the manifest is the big one.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            manifest_f = pool.submit(manifest_lib.read_manifest, store)
            spec = runspec_lib.read_run_spec(store)
            manifest = manifest_f.result()
    except FileNotFoundError as e:
        store.check_reachable()  # a missing bucket says so, not "no run.json"
        raise errors.NotARunError(str(e)) from None
    except Exception as e:  # e.g. a bucket that does not exist, invalid JSON
        if type(e).__name__ in _ACCESS_ERRORS:
            raise errors.NotARunError(f"{run}: cannot be read ({e}); not an actx run") from None
        if isinstance(e, ValueError):
            raise errors.NotARunError(f"{run}: not a valid actx run: {e}") from None
        raise
    return OpenedRun(location, store, spec, manifest)


class CommittedRunError(errors.UserError):
    """A change to a run that already holds committed partitions."""


def record_change(store, kind: str, detail: dict) -> str:
    """Records a change made to a run after it was prepared (one object under
    layout.CHANGES_PREFIX, never overwritten); returns its key."""
    import time
    import uuid

    at = time.time()
    # Names sort by time (milliseconds), so a listing reads as the run's history.
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z"
    key = layout.change_key(f"{stamp}-{kind}-{uuid.uuid4().hex[:6]}")
    store.create_json(key, {"kind": kind, "at": at, **detail})
    return key


def switch_extraction_spec(store, spec: runspec_lib.RunSpec) -> list[str] | None:
    """Makes a prepared run `spec`'s when only extraction settings differ (model, capture)
    and nothing is committed: the token store stays, run.json and the manifest's
    fingerprint become `spec`'s, what earlier extraction attempts left (activations/,
    claims/) goes, and the change is recorded. Returns the changed keys, or None when the
    run is not prepared, is already `spec`'s, or holds another token store.

    Raises CommittedRunError when partitions are committed: their activations belong to the
    old settings. Safe to repeat after a crash: the manifest is rewritten before run.json.
    """
    existing = store.read_json(runspec_lib.RUN_SPEC_KEY)
    if existing is None or not store.exists(layout.MANIFEST_KEY):
        return None
    old = runspec_lib.RunSpec.from_dict(existing)
    if old.fingerprint == spec.fingerprint or old.tokens_fingerprint != spec.tokens_fingerprint:
        return None
    changed = old.extraction_changes(spec)
    # The tokens stay, so does the record of the tokenizer they were made with.
    spec = dataclasses.replace(spec, tokenizer_identity=old.tokenizer_identity)
    committed = commit_lib.committed_partitions(store)
    if committed:
        raise CommittedRunError(
            f"{store.location}: {len(committed)} partition(s) are committed with the earlier "
            f"{', '.join(changed)}; activations of two settings would mix. Extract into a new "
            f"run directory, or go back to the settings the run was made with")
    manifest = manifest_lib.read_manifest(store)
    record_change(store, "extraction-spec", {
        "from_fingerprint": old.fingerprint, "to_fingerprint": spec.fingerprint,
        "changed": changed,
        "before": {k: existing.get(k) for k in runspec_lib.EXTRACTION_ONLY_FIELDS}})
    for prefix in (f"{layout.ACTIVATIONS_GROUP}/", layout.CLAIMS_PREFIX):
        store.delete_prefix(prefix)
    manifest_lib.write_manifest(store, dataclasses.replace(manifest, fingerprint=spec.fingerprint))
    store.write_json(runspec_lib.RUN_SPEC_KEY, spec.to_json_obj())
    return changed
