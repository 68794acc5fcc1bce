"""Object-store failures as one clear error, and bounded, logged retries.

google-cloud-storage reports a missing credential, a missing bucket, a refused request or
an unreachable endpoint as a chain of library exceptions, after retrying a lost network
for up to two minutes. `StoreError` says which of these it was, where, and what to do.
Every GCS call of `schemas.store` retries what GCS asks clients to retry (429, 5xx, a
dropped connection) with one policy: each retry is logged, and the whole call is bounded
by `set_retry_budget` (workers: the same bound as tensorstore's retries) or, tighter,
`set_deadline`, so `actx status` answers within seconds either way.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os

from actx.schemas import errors

log = logging.getLogger("actx.store")
# Retries show where the process configured logging (workers, prepare); an interactive
# command prints its one line of outcome, not Python's last-resort echo of each retry.
log.addHandler(logging.NullHandler())

# Seconds that interactive commands (status, verify, rerun) give one GCS request, retries
# included, before reporting the store unreachable.
INTERACTIVE_DEADLINE_S = 10.0
# Seconds that other callers (workers, prepare) give one request, retries included:
# google-cloud-storage's own default, which rides out real GCS hiccups.
DEFAULT_RETRY_BUDGET_S = 120.0

_deadline_s: float | None = None
_retry_budget_s = DEFAULT_RETRY_BUDGET_S


class StoreError(errors.UserError, RuntimeError):
    """The object store could not be reached or refused the request (no credentials, no
    such bucket, permission denied, no network, retries ran out); the message names the
    location and what to do. Every command prints it as one line and exits 2."""


def set_deadline(seconds: float | None) -> None:
    """Bounds every later GCS call (retries included) to `seconds`, with short per-request
    timeouts; None restores the retry budget alone."""
    global _deadline_s
    _deadline_s = seconds


@contextlib.contextmanager
def deadline(seconds: float | None):
    """`set_deadline(seconds)` for a block; the bound before it comes back after."""
    global _deadline_s
    previous = _deadline_s
    _deadline_s = seconds
    try:
        yield
    finally:
        _deadline_s = previous


def set_retry_budget(seconds: float) -> None:
    """Bounds every later GCS call, retries included, to `seconds` (when no tighter
    deadline is set)."""
    global _retry_budget_s
    _retry_budget_s = seconds


def _log_retry(error: BaseException) -> None:
    log.warning("GCS request failed, retrying (at most %.0f s in all): %s",
                _deadline_s or _retry_budget_s, _reason(error))


def _reason(e: BaseException) -> str:
    """'HTTP 503: ...' or '[Errno 104] Connection reset by peer', for one log line."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(status, int):  # the media client's InvalidResponse
        return f"HTTP {status}"
    if isinstance(getattr(e, "code", None), int):  # api_core's GoogleAPICallError
        return f"HTTP {e.code}: {_message(e)}"
    return _network_reason(e)


def _retry():
    from google.api_core import retry as api_retry
    from google.cloud.storage import retry as storage_retry

    # The storage client's own predicate (429, 408, 5xx, dropped connections), with a log
    # line per retry and this module's bound; an interactive command does not retry a host
    # name that does not resolve (no network, a wrong endpoint): it says so at once.
    def should_retry(error: BaseException) -> bool:
        if _deadline_s is not None and _unknown_host(error):
            return False
        return storage_retry._should_retry(error)

    return api_retry.Retry(predicate=should_retry, on_error=_log_retry,
                           timeout=_deadline_s or _retry_budget_s)


def _unknown_host(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is a host name that does not resolve
    (EAI_NONAME: "Name or service not known"), not a temporary failure of name resolution
    (EAI_AGAIN), which is retried like any dropped connection."""
    import socket

    # A gaierror's text, which urllib3 keeps in its own error's message (not as a cause).
    mark = f"[Errno {socket.EAI_NONAME}]"
    for _ in range(8):  # the chain: auth's TransportError, requests', urllib3's
        if error is None:
            return False
        if mark in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def read_options() -> dict:
    """Keyword arguments for idempotent calls (reads, listings, deletes): the retry
    policy, and short per-request timeouts under a deadline."""
    if _deadline_s is None:
        return {"retry": _retry()}
    return {"retry": _retry(), "timeout": (min(3.0, _deadline_s), _deadline_s)}


def write_options() -> dict:
    """For uploads: the same. Retrying a whole-object upload is safe: an unconditional
    write rewrites the same bytes, and a create-only one that was applied before its
    response was lost meets its own object (see `GcsStore.create`)."""
    return read_options()


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
        return StoreError(f"{where}: the credentials could not be refreshed ({errors.first_line(cause)}"
                          f"); run `gcloud auth application-default login` again")
    if isinstance(cause, api.Unauthorized):
        return StoreError(f"{where}: the credentials were rejected (401); run `gcloud auth "
                          f"application-default login` again, or check the key file")
    refused = _refusal(where, bucket, cause)
    if refused is not None:
        return refused
    if isinstance(cause, api.Forbidden):
        return _permission_denied(where, bucket, _message(cause))
    if isinstance(cause, api.NotFound):
        return StoreError(f"{where}: bucket {bucket} does not exist (404); check the name "
                          f"(`gcloud storage buckets list`)")
    if isinstance(cause, (api.TooManyRequests, api.ServiceUnavailable, api.InternalServerError,
                          api.BadGateway, api.GatewayTimeout)):
        # Before the network case: retries that ran out on 429/5xx are GCS's answer.
        return StoreError(f"{where}: GCS kept failing after {_deadline_s or _retry_budget_s:.0f}"
                          f" s of retries ({cause.code}: {_message(cause)}); try again later")
    if _is_network(cause) or isinstance(e, api.RetryError):
        return StoreError(f"{where}: cannot reach {_endpoint()} ({_network_reason(cause)}); "
                          f"check the network, proxy or STORAGE_EMULATOR_HOST")
    if isinstance(cause, api.GoogleAPICallError) and isinstance(cause.code, int) and (
            cause.code >= 400 and not isinstance(cause, (api.PreconditionFailed,
                                                         api.NotFound))):
        # Any other answer that refuses the request: GCS's own words, where, what next.
        return StoreError(f"{where}: GCS refused the request ({cause.code}: "
                          f"{_message(cause)}); check the bucket and this account's access "
                          f"to it, then run the same command again")
    return e


# A bucket that will not take more: what GCS says (its error reasons and words), and what
# to do. Checked before permission, since a used-up quota also answers 403.
_NO_ROOM = ("quotaexceeded", "quota exceeded", "storage quota", "insufficientstorage",
            "insufficient storage")


def _refusal(where: str, bucket: str, cause: BaseException) -> StoreError | None:
    code = getattr(cause, "code", None)
    said = " ".join([_message(cause), *(str(e.get("reason", "")) for e in
                                        (getattr(cause, "errors", None) or [])
                                        if isinstance(e, dict))])
    return _no_room(where, bucket, code, _message(cause), said)


def _permission_denied(where: str, bucket: str, message: str) -> StoreError:
    return StoreError(f"{where}: permission denied on bucket {bucket} (403: {message}); "
                      f"grant this account roles/storage.objectViewer (objectAdmin to write) "
                      f"on it, or use another account")


def _no_room(where: str, bucket: str, code, message: str, said: str) -> StoreError | None:
    if code == 507 or (isinstance(code, int) and code >= 400 and any(
            w in said.lower() for w in _NO_ROOM)):
        return StoreError(f"{where}: bucket {bucket} has no room for it ({code}: "
                          f"{message}); free space or raise the project's storage "
                          f"quota, or choose a run directory in another bucket, then run the "
                          f"same command again")
    return None


# tensorstore's words for what `_DISK_FAULTS` lists (its file driver reports strerror).
_DISK_WORDS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
               "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES,
               "Operation not permitted": errno.EPERM}  # EPERM: an immutable folder


_RETRIED = (408, 429, 500, 502, 503, 504)  # what tensorstore retries, as GCS asks


def from_tensorstore(e: BaseException, where: str = "", retried: bool = False
                     ) -> BaseException:
    """tensorstore's error (a ValueError whose text carries GCS's HTTP answer, or the
    file system's words) as the StoreError that google-cloud-storage's or a local write's
    failure of the same kind gives: one line naming the object and what to do. An answer
    tensorstore retries (429, 5xx) only with `retried` (else the caller says it, as the
    shard writer does, naming the rows); anything else (a bug, a 404 or 412 its caller
    expects) comes back unchanged."""
    import json
    import re

    text = str(e).split(" [tensorstore_spec=")[0]
    named = re.search(r"Error (?:writing|reading|deleting|opening)(?: local file)? "
                      r"\"?((?:gs://|/)[^\s\"]+?)\"?: ", text)
    where = named.group(1) if named else where
    code = re.search(r"http_response_code='(\d+)'", text)
    if code is None:
        for words, number in _DISK_WORDS.items():
            if words in text:
                return StoreError(f"{where}: cannot write ({words}); {_DISK_FAULTS[number]}, "
                                  f"then run the same command again")
        return e
    code = int(code.group(1))
    if code < 400 or code in (404, 412) or (code in _RETRIED and not retried):
        return e
    body = re.search(r"http_response_body='(.*?)'\]", text, re.S)
    message, said = text.split(": ", 2)[-1].split(" [http_")[0], body.group(1) if body else ""
    try:
        message = json.loads(said.encode().decode("unicode_escape"))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    bucket = where[len("gs://"):].split("/")[0] if where.startswith("gs://") else "?"
    refused = _no_room(where, bucket, code, message, said + " " + message)
    if refused is not None:
        return refused
    if code == 401:
        return StoreError(f"{where}: the credentials were rejected (401); run `gcloud auth "
                          f"application-default login` again, or check the key file")
    if code == 403:
        return _permission_denied(where, bucket, message)
    if code in _RETRIED:
        return StoreError(f"{where}: GCS kept failing after tensorstore's retries ({code}: "
                          f"{message}); try again later")
    return StoreError(f"{where}: GCS refused the request ({code}: {message}); check the "
                      f"bucket and this account's access to it, then run the same command "
                      f"again")


@contextlib.contextmanager
def tensorstore_errors(where: str = ""):
    """Raises what `from_tensorstore` knows as a StoreError, without the library's chain."""
    try:
        yield
    except ValueError as e:
        error = from_tensorstore(e, where, retried=True)
        if error is e:
            raise
        raise error from None


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
    found = re.findall(r"Error\((-?\d+), '([^']+)'\)", str(e))  # ConnectionResetError(104, ..)
    if found:
        return f"[Errno {found[-1][0]}] {found[-1][1]}"
    if "timed out" in str(e).lower() or isinstance(e, TimeoutError):
        return "timed out"
    return errors.first_line(e)


def _message(e: BaseException) -> str:
    """GCS's words, without the request line google-cloud-storage puts first (the caller
    names the object already)."""
    import re

    text = getattr(e, "message", None) or errors.first_line(e)
    # An upload's refusal carries GCS's JSON answer verbatim: its message says it.
    said = re.search(r'"message":\s*"((?:[^"\\]|\\.)*)"', text)
    if said:
        return said.group(1)
    return re.sub(r"^[A-Z]+ https?://\S+: ", "", text)


# What the environment, not the input, refuses on a local disk, and what to do about it.
_DISK_FAULTS = {
    errno.ENOSPC: "the disk is full: free space, or choose a run directory on another disk",
    errno.EDQUOT: "the disk quota is used up: free space, or choose another run directory",
    errno.EROFS: "the file system is read-only: choose a writable run directory",
    errno.EACCES: "this user may not write there: choose a writable run directory, or fix "
                  "its permissions",
    errno.EPERM: "this user may not write there: choose a writable run directory, or fix "
                 "its permissions",
}


@contextlib.contextmanager
def local_write(path: str, tmp: str | None = None):
    """Turns a full or read-only disk into one StoreError naming the path and what to do
    (then running the same command again goes on); the temporary file goes, on any
    failure or a stop signal (SIGINT, SIGTERM: `schemas.stop_signals`) alike."""
    try:
        yield
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if not isinstance(e, OSError) or e.errno not in _DISK_FAULTS:
            raise
        raise StoreError(f"{path}: cannot write ({e.strerror}); {_DISK_FAULTS[e.errno]}, "
                         f"then run the same command again") from None
