"""A loopback proxy in front of the GCS emulator that records every request it forwards
(bench/requests.py, tests/test_request_model.py): who sent it, the method, the object or
listing prefix, the HTTP status and when. No faults: it is tests/fault_proxy.py with a
rate of 0 and a ledger."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.parse

from tests import fault_proxy


@dataclasses.dataclass(frozen=True)
class Seen:
    """One forwarded request as the proxy saw it.

    client: the process (a worker's --host-name, or "main": the launcher and prepare).
    method: GET / POST / PUT / PATCH / DELETE / HEAD.
    name: the object's full name in the bucket ("" for a listing).
    prefix: a listing's prefix (its `prefix` query parameter), "" otherwise.
    is_listing / is_upload: what kind of JSON-API request it was.
    status: the emulator's answer.
    at: time.time() when the answer came.
    """

    client: str
    method: str
    name: str
    prefix: str
    is_listing: bool
    is_upload: bool
    status: int
    at: float


def _is_listing(req: fault_proxy.Request) -> bool:
    path = urllib.parse.urlsplit(req.path).path.rstrip("/")
    return req.method == "GET" and path.endswith("/o") and "/upload/" not in path


class CountingProxy(fault_proxy.FaultProxy):
    """Forwards every request to `upstream` and keeps a `Seen` for each in `seen`."""

    def __init__(self, upstream: str):
        super().__init__(upstream, rate=0.0)
        self.seen: list[Seen] = []
        self._ledger_lock = threading.Lock()

    def forward(self, req: fault_proxy.Request, headers):
        answer = super().forward(req, headers)
        listing = _is_listing(req)
        path = urllib.parse.urlsplit(req.path).path
        entry = Seen(req.client, req.method, "" if listing else req.object_name,
                     req.query.get("prefix", "") if listing else "", listing,
                     "/upload/" in path, answer[0], time.time())
        with self._ledger_lock:
            self.seen.append(entry)
        return answer

    def clear(self) -> None:
        with self._ledger_lock:
            self.seen.clear()
