"""The run directory as one object, and opening it: the one way every stage (prepare,
workers, status, rerun, verify, the reader) finds a run, its keys, its extraction views, its
lease, markers, heartbeats and logs, and a prepared run's spec and manifest, with one error
when it is not one.

A command opens the run once (`RunDir.at`, or `open_run` once prepare has made it) and passes
the object down. A string stands for the run only where a process or a Beam pickle boundary
is crossed (a worker's argv, a DoFn's fields); `RunDir.at` turns it back at once on the
other side.

What a stage then checks about the run (a worker's fingerprint, model and numerics; the
reader's committed hooks) is its own admission; this module only says whether the
location holds a prepared actx run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import extraction_store
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import job_lease
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import object_store
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import uri as uri_lib

# Exceptions google-cloud-storage raises for a bucket that is missing or not ours, matched by
# name so that opening a local run never imports the client.
_ACCESS_ERRORS = ("NotFound", "Forbidden")


class RunDir:
    """A run directory, prepared or not (prepare makes one from nothing): where it is and
    its object store. Its methods answer what callers would otherwise compute from the
    run's string: where a key is, an extraction's view, the job lease, the commit markers,
    the heartbeats, the logs.

    location: the run's root (an extraction's view keeps the root's: messages name the run).
    store: its store, opened at first use (a bucket's client needs credentials, which a dry
      run or a launch on another cloud's machines may lack); for an extraction's view, the
      keys as that extraction sees them (schemas.extraction_store.ExtractionStore).
    """

    def __init__(self, location: uri_lib.Location, store: store_lib.ObjectStore | None = None):
        self.location = location
        self._store = store

    @classmethod
    def at(cls, run: "str | os.PathLike | uri_lib.Location | store_lib.ObjectStore | RunDir"
           ) -> "RunDir":
        """The run directory `run` names (the object itself when it is one); reads and
        opens nothing. A bad location raises ValueError."""
        if isinstance(run, RunDir):
            return run
        if isinstance(run, store_lib.ObjectStore):
            return RunDir(run.location, run)
        return RunDir(uri_lib.parse(run))

    @property
    def store(self) -> store_lib.ObjectStore:
        if self._store is None:
            self._store = store_lib.open_store(self.location)
        return self._store

    @store.setter
    def store(self, store: store_lib.ObjectStore) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"RunDir({self.uri!r})"

    @property
    def uri(self) -> str:
        """The run's location as a string: what crosses into a worker's argv or a Beam
        pickle, and what messages print."""
        return str(self.location)

    def uri_of(self, key: str) -> str:
        """Where one of the run's keys is, as messages show it."""
        return str(self.location.join(key))

    def log_uri(self, job: str, host: str = "<host>") -> str:
        """Where `job`'s log of `host` is (the placeholder `<host>`: the pattern of them)."""
        return self.uri_of(layout.log_key(job, host))

    def write_log(self, job: str, host: str, data: bytes) -> None:
        """Stores `job`'s log of `host` (a whole copy, replacing the last one)."""
        self.store.write(layout.log_key(job, host), data)

    def extraction(self, name: str | None) -> "RunDir":
        """The run as extraction `name` sees it ("" or None: the default, this run): its
        spec, activations, markers, claims and heartbeats are its own."""
        if not name:
            return self
        return RunDir(self.location, extraction_store.view(self.store, name))

    @property
    def extraction_name(self) -> str:
        """The extraction this view is of ("": the default, the run's root)."""
        store = self._store
        return store.name if isinstance(store, extraction_store.ExtractionStore) else ""

    def extraction_names(self) -> list[str]:
        """Every extraction of the run, the default ("") first when in use."""
        return extraction_store.names(self.store)

    def committed(self, n_partitions: int = 0) -> set[int]:
        """The ids of partitions with a commit marker (a listing, no reads)."""
        return commit_lib.committed_partitions(self.store, n_partitions)

    def heartbeats(self, history: bool = True) -> list:
        """Every host's last heartbeat (schemas.heartbeat.Heartbeat)."""
        return heartbeat_lib.read_heartbeats(self.store, history=history)

    def lease(self):
        """The run's job lease as stored (schemas.job_lease.JobLease), None when none is."""
        return job_lease.read(self.store)

    def spec_json(self) -> dict | None:
        """run.json as stored (None before prepare wrote it), not checked."""
        return self.store.read_json(runspec_lib.RUN_SPEC_KEY)

    def is_prepared_for(self, spec: runspec_lib.RunSpec, tokens_only: bool = False) -> bool:
        """Whether the run holds a finished prepare of `spec` (run.json with its
        fingerprint, and manifest.json, which prepare writes last). `tokens_only`: of the
        same token store, whatever model and capture run.json names. A damaged run.json
        (not JSON) is not a finished prepare: prepare says what it does with it
        (pipeline.prepare_refusals.check_run_dir)."""
        try:
            existing = self.spec_json()
        except object_store.DamagedObjectError:
            return False
        if existing is None:
            return False
        if tokens_only:
            same = runspec_lib.RunSpec.from_dict(existing).tokens_fingerprint \
                == spec.tokens_fingerprint
        else:
            same = existing.get("fingerprint") == spec.fingerprint
        return same and self.store.exists(layout.MANIFEST_KEY)

    def record_change(self, kind: str, detail: dict) -> str:
        """Records a change made after prepare (`record_change`); returns its key."""
        return record_change(self.store, kind, detail)

    def opened(self) -> "OpenedRun":
        """This run with its spec and manifest read (`open_run`)."""
        return self if isinstance(self, OpenedRun) else open_run(self)


@dataclasses.dataclass
class OpenedRun(RunDir):
    """A prepared run: where it is, its store, run.json and manifest.json."""

    location: uri_lib.Location
    # A field with no default; `field()` keeps RunDir's `store` property from being read
    # as one (the dataclass then removes it from this class, and the property serves).
    store: store_lib.ObjectStore = dataclasses.field()
    spec: runspec_lib.RunSpec
    manifest: manifest_lib.Manifest


def _run_json_lost(store, shown) -> str:
    """What to say of a run whose run.json alone is gone (deleted by hand) while its
    manifest.json and commit markers stand (pipeline.prepare_refusals.check_run_dir);
    "" otherwise."""
    if store.exists(runspec_lib.RUN_SPEC_KEY) or not any(
            extraction_store.view(store, name).list_names(layout.COMMITS_PREFIX)
            for name in extraction_store.names(store)):
        return ""
    fingerprint, resubmit = _resubmit(store)
    return (f"{shown}: run.json is gone, but manifest.json (fingerprint {fingerprint}) and "
            f"the commit markers stand: {resubmit}" if resubmit else "")


def _damaged_run_file(store, shown, location, error: Exception) -> str:
    """What to say where run.json or manifest.json is not JSON (damaged by hand or by a
    disk) and the other reads: what writes it again and keeps every committed partition
    (a prepare again from the inputs, checked against the markers); "" otherwise."""
    if not isinstance(error, object_store.DamagedObjectError):
        return ""
    where = f"{location.join(error.key)}: {error.what}"
    if error.key == layout.MANIFEST_KEY:
        return (f"{where}; `{advice.reprepare(location)}` writes it again from the run's "
                f"inputs (as they were when it was prepared), checked against what is "
                f"committed, and keeps every committed partition")
    if error.key != runspec_lib.RUN_SPEC_KEY:
        return ""
    _, resubmit = _resubmit(store)
    return f"{where}; {resubmit}" if resubmit else ""


def _resubmit(store) -> tuple[str, str]:
    """(manifest.json's fingerprint, the submit that writes a lost or damaged run.json
    again, with launch.json's config); ("", "") where the manifest cannot tell."""
    try:
        manifest = store.read_json(layout.MANIFEST_KEY)
        launch = store.read_json(layout.LAUNCH_KEY)
    except ValueError:
        return "", ""
    fingerprint = manifest.get("fingerprint") if isinstance(manifest, dict) else None
    if not fingerprint:
        return "", ""
    config = launch.get("config") if isinstance(launch, dict) else None
    last = f" (its last launch's was {config})" if isinstance(config, str) and config else ""
    return fingerprint, (
        f"`actx submit` with the config the run was made with{last}, whose spec has "
        f"fingerprint {fingerprint} (manifest.json's), prepares it again from its inputs, "
        f"checked against what is committed, writes run.json and keeps every committed "
        f"partition")


def _a_file_not_a_run(shown, path: str) -> str:
    """What to say of a file given where a run directory belongs: a submit config (the
    run directory is its `run:`, taken from the config file's directory as submit takes
    it), or some other file."""
    from actx.schemas import config as config_lib

    try:
        run = config_lib.load_file(path).get("run")
    except Exception:  # noqa: BLE001 - not a config: said as a file
        run = None
    if not isinstance(run, str) or not run:
        return f"{shown}: a file, not an actx run directory; give the run's directory"
    if uri_lib.parse(run).is_local and not os.path.isabs(run):
        run = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(path)), run))
    return (f"{shown}: a submit config, not a run directory; its run is {run}: give that "
            f"(e.g. `{advice.status(run)}`)")


def open_run(run: "str | os.PathLike | uri_lib.Location | store_lib.ObjectStore | RunDir"
             ) -> OpenedRun:
    """Opens a prepared run, or raises errors.NotARunError saying what is missing or wrong.
    `run` may be its RunDir or store, opened already (by a command that made the run).

    Object-store failures (no credentials, no network) raise store_errors.StoreError.
    """
    if isinstance(run, OpenedRun):
        return run
    try:
        location = (run.location if isinstance(run, (store_lib.ObjectStore, RunDir))
                    else uri_lib.parse(run))
    except ValueError as e:
        raise errors.NotARunError(str(e)) from None
    # Messages name the run as it was given, or its location.
    shown = location if isinstance(run, (store_lib.ObjectStore, RunDir)) else run
    if location.is_local and not os.path.isdir(location.path):
        if os.path.isfile(location.path):
            raise errors.NotARunError(_a_file_not_a_run(shown, location.path))
        raise errors.NotARunError(f"{shown}: no such directory; not an actx run")
    store = (run.store if isinstance(run, RunDir)
             else run if isinstance(run, store_lib.ObjectStore) else store_lib.open_store(location))
    try:
        # Both reads at once: on GCS each is a round trip, and the manifest is the big one.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            manifest_f = pool.submit(manifest_lib.read_manifest, store)
            spec = runspec_lib.read_run_spec(store)
            manifest = manifest_f.result()
    except FileNotFoundError as e:
        store.check_reachable()  # a missing bucket says so, not "no run.json"
        if (store.exists(runspec_lib.RUN_SPEC_KEY) and store.exists(layout.PREPARE_ATTEMPT_KEY)
                and any(extraction_store.view(store, name).list_names(layout.COMMITS_PREFIX)
                        for name in extraction_store.names(store))):
            # A prepare again (a damaged token store's advice) writes manifest.json last:
            # stopped before, it left none (one that refused its inputs put it back).
            raise errors.NotARunError(
                f"{shown}: its manifest.json is not there: the run was being prepared "
                f"again (prepare/attempt.json) and that prepare did not finish; its "
                f"committed partitions stand. `{advice.reprepare(location)}`, with the "
                f"inputs as they were when the run was prepared, finishes it") from None
        lost = _run_json_lost(store, shown)
        if lost:
            raise errors.NotARunError(lost) from None
        if store.list_names(layout.COMMITS_PREFIX):
            # Markers without the files prepare writes: the directory was removed under a
            # job whose workers went on committing (or its files were, since).
            raise errors.NotARunError(
                f"{e}; yet {shown} holds commit markers: the run directory (or its "
                f"run.json and manifest.json) was removed while a job ran. Its data is "
                f"gone: `actx submit` with the run's config prepares it afresh (the "
                f"markers are cleared)") from None
        unfinished = _unfinished_prepare(store, shown)
        raise errors.NotARunError(unfinished or str(e)) from None
    except Exception as e:  # e.g. a bucket that does not exist, invalid JSON
        said = _damaged_run_file(store, shown, location, e)
        if said:
            raise errors.NotARunError(said) from None
        if type(e).__name__ in _ACCESS_ERRORS:
            raise errors.NotARunError(f"{shown}: cannot be read ({e}); not an actx run") from None
        if isinstance(e, ValueError):
            raise errors.NotARunError(f"{shown}: not a valid actx run: {e}") from None
        raise
    return OpenedRun(location, store, spec, manifest)


def _unfinished_prepare(store: store_lib.ObjectStore, shown) -> str:
    """Why a directory where a prepare began cannot be opened: the inputs its prepare
    refused (its staged summary: what it read, accepted and rejected, why, and where the
    rejected inputs are), or a prepare that did not finish; "" where no prepare began (or
    its records cannot be read)."""
    try:
        summary = store.read_json(layout.PREPARE_SUMMARY_KEY)
        if summary is None and not store.exists(layout.PREPARE_ATTEMPT_KEY):
            return ""
        has_spec = store.exists(runspec_lib.RUN_SPEC_KEY)
        sources = (summary or {}).get("sources") or {}
        counts = [(int(c.get("read", 0)), int(c.get("accepted", 0)), c.get("reasons") or {})
                  for c in sources.values()]
    except Exception:  # noqa: BLE001 - damaged records: the plain message says enough
        return ""
    again = "then run `actx submit` with the run's config again (it prepares the run)"
    what = ("run.json but no manifest.json" if has_spec else "no run.json")
    read = sum(n for n, _, _ in counts)
    accepted = sum(n for _, n, _ in counts)
    if isinstance(summary, dict) and read == 0:
        return (f"{shown}: not prepared: its prepare read no input document and left "
                f"{what}; check the sources' paths and formats, {again}")
    rerun = "`actx submit` with the run's config, run again, prepares it"
    if not isinstance(summary, dict) or read <= accepted:
        return (f"{shown}: not prepared: a prepare began here and left {what} (it was "
                f"stopped, or is still running); {rerun}")
    reasons: dict[str, int] = {}
    for _, _, theirs in counts:
        for reason, n in theirs.items():
            reasons[str(reason)] = reasons.get(str(reason), 0) + int(n)
    top = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
    why = "; ".join(f"{reason}: {n}" for reason, n in top)
    return (f"{shown}: not prepared: its prepare left {what}, having accepted {accepted} of "
            f"{read} input document(s)" + (f" ({why})" if why else "")
            + f"; the rejected inputs, each with its reason, are in "
              f"{store.location.join(layout.REJECTS_PREFIX)}. Fix the inputs (or raise "
              f"max_reject_fraction), {again}")


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
    try:
        existing = store.read_json(runspec_lib.RUN_SPEC_KEY)
    except object_store.DamagedObjectError:  # prepare's own check says what is done
        return None
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
            f"run directory, or go back to the settings the run was made with; to have both "
            f"over this run's tokens, give the new settings as a named extraction "
            f"(`extractions:` in the config, docs/several-models.md)")
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
