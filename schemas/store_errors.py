"""Object-store failures as one clear error, and a time bound for interactive commands.

google-cloud-storage reports a missing credential, a missing bucket, a refused request or
an unreachable endpoint as a chain of library exceptions, after retrying a lost network
for up to two minutes. `StoreError` says which of these it was, where, and what to do;
`set_deadline` bounds the retries, so `actx status` answers within seconds either way.
"""

from __future__ import annotations

import contextlib
import functools
import os

# Seconds that interactive commands (status, verify, rerun) give one GCS request, retries
# included, before reporting the store unreachable. Workers and prepare keep the client's
# own policy (about two minutes), which rides out real GCS hiccups.
INTERACTIVE_DEADLINE_S = 10.0

_deadline_s: float | None = None


class StoreError(RuntimeError):
    """The object store could not be reached or refused the request (no credentials, no
    such bucket, permission denied, no network); the message names the location and what
    to do."""


def set_deadline(seconds: float | None) -> None:
    """Bounds every later GCS read, listing and delete (retries included) to `seconds`;
    None restores the client's default policy."""
    global _deadline_s
    _deadline_s = seconds


def read_options() -> dict:
    """Keyword arguments for idempotent calls (reads, listings, deletes): the retry and
    per-request timeout of the current deadline; empty when none is set."""
    if _deadline_s is None:
        return {}
    from google.cloud.storage.retry import DEFAULT_RETRY

    return {"retry": DEFAULT_RETRY.with_timeout(_deadline_s),
            "timeout": (min(3.0, _deadline_s), _deadline_s)}


def write_options() -> dict:
    """For writes: the per-request timeout only (whether a write may be retried depends on
    its preconditions, which the client decides)."""
    return {} if _deadline_s is None else {"timeout": (min(3.0, _deadline_s), _deadline_s)}


@contextlib.contextmanager
def translated(where: str, bucket: str):
    """Raises the failures that `translate` knows as StoreError (the original chained)."""
    try:
        yield
    except Exception as e:
        error = translate(where, bucket, e)
        if error is e:
            raise
        raise error from e


def gcs_errors(method):
    """A GcsStore method (its first argument a key or prefix) whose library failures
    become one StoreError naming the object."""

    @functools.wraps(method)
    def wrapped(self, key: str = "", *args, **kwargs):
        with translated(str(self.location.join(key)), self.location.bucket):
            return method(self, key, *args, **kwargs)
    return wrapped


def _endpoint() -> str:
    return os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"


def translate(where: str, bucket: str, e: BaseException) -> BaseException:
    """`e` as a StoreError naming `where` when it is one of the failures above; `e`
    itself otherwise (a bug, or something the caller handles, such as a 412)."""
    try:
        from google.api_core import exceptions as api
        from google.auth import exceptions as auth
    except ImportError:  # no google-cloud-storage: `e` says how to install it
        return e

    cause = e.cause if isinstance(e, api.RetryError) and e.cause is not None else e
    if isinstance(cause, auth.DefaultCredentialsError):
        return StoreError(
            f"{where}: no Google Cloud credentials found; run `gcloud auth application-default "
            f"login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file")
    if isinstance(cause, (auth.RefreshError, auth.TransportError)):
        return StoreError(f"{where}: the credentials could not be refreshed ({_first_line(cause)}"
                          f"); run `gcloud auth application-default login` again")
    if isinstance(cause, api.Unauthorized):
        return StoreError(f"{where}: the credentials were rejected (401); run `gcloud auth "
                          f"application-default login` again, or check the key file")
    if isinstance(cause, api.Forbidden):
        return StoreError(f"{where}: permission denied on bucket {bucket} (403: "
                          f"{_message(cause)}); grant this account roles/storage.objectViewer "
                          f"(objectAdmin to write) on it, or use another account")
    if isinstance(cause, api.NotFound):
        return StoreError(f"{where}: bucket {bucket} does not exist (404); check the name "
                          f"(`gcloud storage buckets list`)")
    if _is_network(cause) or isinstance(e, api.RetryError):
        return StoreError(f"{where}: cannot reach {_endpoint()} ({_network_reason(cause)}); "
                          f"check the network, proxy or STORAGE_EMULATOR_HOST")
    if isinstance(cause, (api.TooManyRequests, api.ServiceUnavailable, api.InternalServerError)):
        return StoreError(f"{where}: GCS kept failing ({_message(cause)}); try again later")
    return e


def _is_network(e: BaseException) -> bool:
    import requests

    return isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                          ConnectionError, TimeoutError))


def _network_reason(e: BaseException) -> str:
    """'[Errno 111] Connection refused' rather than urllib3's nested repr."""
    import re

    found = re.findall(r"\[Errno -?\d+\] [^'\")\]]+", str(e))
    if found:
        return found[-1].strip()
    if "timed out" in str(e).lower() or isinstance(e, TimeoutError):
        return "timed out"
    return _first_line(e)


def _message(e: BaseException) -> str:
    return getattr(e, "message", None) or _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
