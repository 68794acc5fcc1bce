"""The process-wide tensorstore Context: GCS request concurrency and retries, and the
shared memory:// kvstore (memory stores are per Context, so every stage of one process
must open arrays through this one)."""

from __future__ import annotations

import threading

import tensorstore as ts

_CONTEXT: ts.Context | None = None
_LOCK = threading.Lock()


def configure(gcs_request_concurrency: int = 32, gcs_request_retries: int = 8,
              data_copy_concurrency: int | None = None) -> ts.Context:
    """Sets the process-wide context (call before opening arrays; later calls replace it)."""
    global _CONTEXT
    spec = {
        "gcs_request_concurrency": {"limit": gcs_request_concurrency},
        "gcs_request_retries": {"max_retries": gcs_request_retries},
    }
    if data_copy_concurrency:
        spec["data_copy_concurrency"] = {"limit": data_copy_concurrency}
    with _LOCK:
        _CONTEXT = ts.Context(spec)
        return _CONTEXT


def get() -> ts.Context:
    with _LOCK:
        if _CONTEXT is not None:
            return _CONTEXT
    return configure()


def open_array(spec: dict) -> ts.TensorStore:
    """Opens a tensorstore spec in the process-wide context (blocking)."""
    return ts.open(spec, context=get()).result()
