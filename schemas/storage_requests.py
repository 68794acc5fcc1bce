"""What a storage request is for, by the run-directory key it names: the classes the
request bench (bench/requests.py) counts and `actx submit --dry-run --estimate` predicts,
and the GCS billing class of each operation.

A request is classified by its object name (or a listing's prefix) alone, so the count
stays right whatever process sent it and however often: data (`shards`, `markers`),
control (`claims`, `heartbeats`, `logs`, `lease`), `metadata` (the numerics record and
each array's zarr.json), `inputs` (what prepare writes and workers read: tokens, manifest,
run.json, docs) and `other`.
"""

from __future__ import annotations

from actx.schemas import layout

CLASSES = ("shards", "markers", "claims", "heartbeats", "logs", "metadata", "inputs",
           "lease", "other")
OPERATIONS = ("write", "read", "list", "delete")
# GCS bills writes and listings as Class A operations, reads (of data or metadata) as
# Class B; deletes are free (cloud.google.com/storage/pricing#operations-pricing).
GCS_CLASS = {"write": "A", "list": "A", "read": "B", "delete": "free"}

_INPUT_PREFIXES = (f"{layout.TOKENS_GROUP}/", layout.DOCS_PREFIX, layout.REJECTS_PREFIX,
                   "prepare/", layout.CHANGES_PREFIX, layout.EXTRACTION_NAMES_PREFIX)
_INPUT_KEYS = (layout.MANIFEST_KEY, "run.json")
_LEASE = (layout.JOB_LEASE_KEY, layout.JOB_LEASE_TAKEOVERS_PREFIX, layout.LAUNCH_KEY)


def run_key(name: str, run_prefix: str) -> str | None:
    """An object name (or listing prefix) of the bucket as a key of the run at `run_prefix`
    (its path in the bucket, "" for a run at the bucket's root), without a named
    extraction's prefix; None when it is outside the run."""
    prefix = run_prefix.strip("/")
    if prefix:
        if name == prefix:
            return ""
        if not name.startswith(prefix + "/"):
            return None
        name = name[len(prefix) + 1:]
    if name.startswith(layout.EXTRACTIONS_PREFIX) and not name.startswith(
            layout.EXTRACTION_NAMES_PREFIX):
        rest = name[len(layout.EXTRACTIONS_PREFIX):]
        name = rest.split("/", 1)[1] if "/" in rest else ""
    return name


def object_class(key: str) -> str:
    """The class (one of CLASSES) of a run-directory key or listing prefix."""
    activations = f"{layout.ACTIVATIONS_GROUP}/"
    if key.startswith(activations):
        if key == layout.ACTIVATIONS_INFO_KEY or key.endswith("zarr.json"):
            return "metadata"
        rest = key[len(activations):]
        return "shards" if f"/{layout.SHARD_OBJECTS}" in f"/{rest}" else "metadata"
    if key.startswith(layout.COMMITS_PREFIX) or key.startswith(layout.GENERATED_PREFIX):
        return "markers"
    if key.startswith(layout.CLAIMS_PREFIX):
        return "claims"
    if key.startswith(layout.WORKERS_PREFIX):
        return "heartbeats"
    if key.startswith(layout.LOGS_PREFIX):
        return "logs"
    if key in _INPUT_KEYS or key.startswith(_INPUT_PREFIXES):
        return "inputs"
    if key.startswith(_LEASE):
        return "lease"
    return "other"


def operation(method: str, is_listing: bool) -> str:
    """The operation (one of OPERATIONS) of a JSON-API request: a GET of the bucket's object
    collection lists, a GET or HEAD of an object reads, DELETE deletes, the rest (uploads,
    PATCH, copy, compose) write."""
    if is_listing:
        return "list"
    if method in ("GET", "HEAD"):
        return "read"
    if method == "DELETE":
        return "delete"
    return "write"
