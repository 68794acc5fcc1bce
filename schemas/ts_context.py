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


def configure(gcs_request_concurrency: int = 32, gcs_request_retries: int = 8,
              data_copy_concurrency: int | None = None) -> ts.Context:
    """Sets GCS limits for everything opened afterwards (memory stores and cache are kept)."""
    global _CONTEXT
    spec = {
        "gcs_request_concurrency": {"limit": gcs_request_concurrency},
        "gcs_request_retries": {"max_retries": gcs_request_retries},
    }
    if data_copy_concurrency:
        spec["data_copy_concurrency"] = {"limit": data_copy_concurrency}
    with _LOCK:
        # Resources a child does not define (the memory kvstore, the cache pool) resolve
        # to the parent's, so arrays already in memory:// stay visible.
        _CONTEXT = ts.Context(spec, parent=_root())
        return _CONTEXT


def get() -> ts.Context:
    with _LOCK:
        return _root()


def open_array(spec: dict) -> ts.TensorStore:
    """Opens a tensorstore spec in the process-wide context (blocking)."""
    return ts.open(spec, context=get()).result()


def open_kvstore(spec: dict) -> ts.KvStore:
    """Opens a kvstore spec in the process-wide context (blocking)."""
    return ts.KvStore.open(spec, context=get()).result()
