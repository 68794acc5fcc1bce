"""The process-wide tensorstore Context: GCS request concurrency and retries, a cache pool,
and the shared memory:// kvstore.

tensorstore keeps one in-memory store per Context, so every stage of one process opens
arrays and kvstores through `get()`; `configure()` derives a child context (new limits,
same memory store and cache) instead of replacing it, so nothing written to memory:// is
lost when a worker sets its GCS limits.
"""

from __future__ import annotations

import threading

import tensorstore as ts

from actx.schemas import chunk_checksums
from actx.schemas import store_errors

_CONTEXT: ts.Context | None = None
_LOCK = threading.Lock()

# Shard indexes and recently decoded chunks: repeated small reads (token rows of one shard,
# shuffled gathers) then cost one fetch, not one per read.
DEFAULT_CACHE_BYTES = 256 << 20


def _root() -> ts.Context:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": DEFAULT_CACHE_BYTES}})
    return _CONTEXT


# tensorstore's GCS back-off: the first retry after about 1 s, doubling up to 32 s.
RETRY_INITIAL_DELAY_S = 1.0
RETRY_MAX_DELAY_S = 32.0


def retry_budget_s(retries: int) -> float:
    """Seconds of back-off that `retries` retries of one request can take; the bound given
    to google-cloud-storage too, so one setting bounds both clients (8 retries: ~2 min)."""
    return max(5.0, sum(min(RETRY_INITIAL_DELAY_S * 2 ** k, RETRY_MAX_DELAY_S)
                        for k in range(retries)))


def configure(gcs_request_concurrency: int = 32, gcs_request_retries: int = 8,
              data_copy_concurrency: int | None = None) -> ts.Context:
    """Sets GCS limits for everything opened afterwards (memory stores and cache are kept).

    Retries are bounded: tensorstore gives up after `gcs_request_retries` retries of a
    request (429, 5xx, a dropped connection) and raises; google-cloud-storage calls (the
    run's small objects) give up after the same back-off time.
    """
    global _CONTEXT
    from actx.schemas import store_errors

    spec = {
        "gcs_request_concurrency": {"limit": gcs_request_concurrency},
        "gcs_request_retries": {"max_retries": gcs_request_retries,
                                "initial_delay": f"{RETRY_INITIAL_DELAY_S:g}s",
                                "max_delay": f"{RETRY_MAX_DELAY_S:g}s"},
    }
    if data_copy_concurrency:
        spec["data_copy_concurrency"] = {"limit": data_copy_concurrency}
    store_errors.set_retry_budget(retry_budget_s(gcs_request_retries))
    with _LOCK:
        # Resources a child does not define (the memory kvstore, the cache pool) resolve
        # to the parent's, so arrays already in memory:// stay visible.
        _CONTEXT = ts.Context(spec, parent=_root())
        return _CONTEXT


def get() -> ts.Context:
    with _LOCK:
        return _root()


def open_array(spec: dict, context: ts.Context | None = None) -> ts.TensorStore:
    """Opens a tensorstore spec in the process-wide context (blocking); a store that
    refuses (a bucket that takes no writes, a full disk) is one StoreError. An array whose
    chunks carry checksums (schemas.chunk_checksums) is opened so that a missing
    chunk fails its read instead of reading as the fill value."""
    with store_errors.tensorstore_errors():
        return strict_if_checksummed(ts.open(spec, context=context or get()).result(), spec,
                                     context)


def strict_if_checksummed(array: ts.TensorStore, spec: dict,
                          context: ts.Context | None = None) -> ts.TensorStore:
    """`array` (opened by `spec`) again with chunk_checksums.READ_NO_MISSING_CHUNK where
    its chunks carry checksums: it was written with every chunk stored, so a missing one
    is lost."""
    if spec.get("driver") != "zarr3" or spec.get("create"):
        return array  # a writer's: it reads nothing
    metadata = array.spec().to_json().get("metadata", {})
    if not chunk_checksums.in_metadata(metadata):
        return array
    # The metadata just read, not read again (one request per array and process, as before).
    return ts.open({**spec, "metadata": metadata, "assume_metadata": True,
                    **chunk_checksums.READ_NO_MISSING_CHUNK}, context=context or get()).result()


def strict_reader(array: ts.TensorStore) -> ts.TensorStore:
    """A read-only view of an opened array whose chunks carry checksums (a writer's among
    them, which `strict_if_checksummed` leaves as it is) that fails a read of a chunk
    missing from it, as lost, rather than reading the fill value. No request: the
    metadata is the array's own; no cache: it reads what is stored."""
    spec = array.spec().to_json()
    for key in ("create", "open", "delete_existing"):
        spec.pop(key, None)
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}}, parent=get())
    return ts.open({**spec, "assume_metadata": True, **chunk_checksums.READ_NO_MISSING_CHUNK},
                   context=context, read=True).result()


def open_array_as_stored(specs: list[dict], context: ts.Context | None = None
                         ) -> ts.TensorStore:
    """Opens (or creates) one array by the first of `specs` (its layouts, newest first:
    layout.ArrayLayout.specs) whose codecs an existing array has: a writer continuing a
    run an earlier actx wrote opens its arrays as they are stored. A missing array is
    created by the first; any other refusal is raised as `open_array` raises it."""
    for spec in specs[:-1]:
        try:
            return open_array(spec, context)
        except ValueError as e:
            if 'Mismatch in "codecs"' not in str(e):
                raise
    return open_array(specs[-1], context)


def open_kvstore(spec: dict) -> ts.KvStore:
    """Opens a kvstore spec in the process-wide context (blocking)."""
    with store_errors.tensorstore_errors():
        return ts.KvStore.open(spec, context=get()).result()
