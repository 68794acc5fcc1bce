"""A loopback HTTP proxy in front of the GCS emulator that injects the faults real GCS has.

Both GCS clients (tensorstore's gcs driver through TENSORSTORE_GCS_HTTP_URL, and
google-cloud-storage through STORAGE_EMULATOR_HOST) are pointed at `FaultProxy.url`; every
request is forwarded to fake-gcs-server unless the proxy decides to fail it:

  "429" / "503"  answered by the proxy, never forwarded (the request is not applied)
  "reset"        forwarded, then the connection is reset halfway through the response body
  "slow"         forwarded, the response held back `slow_s` seconds
  "lost"         forwarded (applied), then the connection is reset with no response: a
                 client that retries a create-only write then meets its own object (412)

and, for rules only (they are not survivable, so never drawn at random), refusals GCS
gives a bucket that will not take writes, answered by the proxy:

  "403"          permission denied (the account may not create objects)
  "403-quota"    403 "quotaExceeded": the project's storage quota is used up
  "507"          insufficient storage

Decisions are reproducible: whether the n-th request of a client for one object fails, and
how, is a hash of (seed, client, method, object, n), whatever the threads' interleaving.
A client is the process that opened the connection, named by its `--host-name` flag
(worker processes) or "main" (this process), so faults can target one host.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import http.client
import http.server
import json
import os
import re
import socket
import struct
import threading
import time
import urllib.parse
from typing import Callable, Iterable

KINDS = ("429", "503", "reset", "slow", "lost")
REFUSALS = {  # kind -> (HTTP status, reason, GCS's JSON error: reason, message)
    "403": (403, "Forbidden", "forbidden", "actx-test@example.iam.gserviceaccount.com does "
            "not have storage.objects.create access to the Google Cloud Storage object. "
            "(fault proxy)"),
    "403-quota": (403, "Forbidden", "quotaExceeded", "The project's storage quota has been "
                  "exceeded. (fault proxy)"),
    "507": (507, "Insufficient Storage", "insufficientStorage", "Insufficient storage "
            "(fault proxy)"),
}

# Hop-by-hop headers, never forwarded (the proxy sets its own framing).
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "upgrade", "expect", "host", "content-length"}


@dataclasses.dataclass(frozen=True)
class Request:
    client: str
    method: str
    path: str  # with its query
    body: bytes
    agent: str = ""  # the GCS client library: "tensorstore" or "google-cloud-storage"

    @property
    def query(self) -> dict[str, str]:
        return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))

    @property
    def object_name(self) -> str:
        """The object the request is about ('' for bucket-level requests such as listings):
        from the path (/b/<bucket>/o/<name>), or a multipart upload's metadata part."""
        path = urllib.parse.urlsplit(self.path).path
        found = re.search(r"/b/[^/]+/o/([^/?]+)", path)
        if found:
            return urllib.parse.unquote(found.group(1))
        if "name" in self.query:
            return self.query["name"]
        found = re.search(rb'"name"\s*:\s*"([^"]+)"', self.body[:4096])
        return found.group(1).decode() if found else ""

    @property
    def is_create_only(self) -> bool:
        """An upload conditioned on the object not existing (a commit marker, a claim)."""
        return self.method in ("POST", "PUT") and self.query.get("ifGenerationMatch") == "0"


@dataclasses.dataclass
class Rule:
    """Fails the next `times` requests that `match` (every one when None) with `kind`."""

    kind: str
    match: Callable[[Request], bool]
    times: int | None = 1


class FaultProxy:
    """Forwards to `upstream`; fails a `rate` fraction of the requests of `clients` (None:
    every client) with one of `kinds`, plus whatever `rules` say."""

    def __init__(self, upstream: str, rate: float = 0.0, kinds: Iterable[str] = KINDS,
                 seed: int = 0, clients: Iterable[str] | None = None, slow_s: float = 0.3):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.rate = rate
        self.kinds = tuple(kinds)
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        self.seed = seed
        self.clients = None if clients is None else set(clients)
        self.slow_s = slow_s
        self.rules: list[Rule] = []
        self.injected: collections.Counter = collections.Counter()  # kind -> count
        self.injected_by_client: collections.Counter = collections.Counter()  # (client, kind)
        self.injected_by_agent: collections.Counter = collections.Counter()  # (library, kind)
        self.requests: collections.Counter = collections.Counter()  # client -> count
        # Create-only uploads as fake-gcs-server answered them: object -> [status, ...].
        # Two 200s for one object would be two commits.
        self.creates: dict[str, list[int]] = collections.defaultdict(list)
        self._seen: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._labels: dict[int, str] = {}
        self._server = _Server(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    # -- control -----------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="fault-proxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_rule(self, kind: str, match: Callable[[Request], bool], times: int | None = 1):
        if kind not in KINDS and kind not in REFUSALS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS}")
        with self._lock:
            self.rules.append(Rule(kind, match, times))

    def configure(self, rate: float | None = None, clients: Iterable[str] | None = ...,
                  kinds: Iterable[str] | None = None, rules: bool = True) -> None:
        """Changes the rate, the kinds or the targeted clients; `rules=False` drops every
        rule."""
        with self._lock:
            if rate is not None:
                self.rate = rate
            if kinds is not None:
                self.kinds = tuple(kinds)
            if clients is not ...:
                self.clients = None if clients is None else set(clients)
            if not rules:
                self.rules.clear()

    def duplicate_creates(self, contains: str = "") -> list[str]:
        """Objects (named with `contains`) created more than once under create-only.

        fake-gcs-server honours the precondition on multipart uploads only (google-cloud-
        storage's, as commit markers are written); tensorstore's media uploads of zarr
        metadata may show two 200s where GCS would have answered the second with 412.
        """
        return sorted(name for name, codes in self.creates.items()
                      if contains in name and codes.count(200) > 1)

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {self.injected[k]}" for k in KINDS if self.injected[k])
        return (f"{sum(self.injected.values())} faults injected ({kinds or 'none'}) in "
                f"{sum(self.requests.values())} requests")

    # -- decisions ---------------------------------------------------------------------
    def decide(self, req: Request) -> str | None:
        with self._lock:
            self.requests[req.client] += 1
            for rule in self.rules:
                if rule.times != 0 and rule.match(req):
                    if rule.times is not None:
                        rule.times -= 1
                    return self._count(req, rule.kind)
            if not self.rate or (self.clients is not None and req.client not in self.clients):
                return None
            key = f"{req.client}|{req.method}|{req.object_name}"
            self._seen[key] += 1
            digest = hashlib.sha256(f"{self.seed}|{key}|{self._seen[key]}".encode()).digest()
            draw = int.from_bytes(digest[:8], "big") / 2.0 ** 64
            if draw >= self.rate:
                return None
            return self._count(req, self.kinds[digest[8] % len(self.kinds)])

    def _count(self, req: Request, kind: str) -> str:
        self.injected[kind] += 1
        self.injected_by_client[(req.client, kind)] += 1
        self.injected_by_agent[(req.agent, kind)] += 1
        return kind

    def client_of(self, peer_port: int) -> str:
        """The name of the process whose socket is 127.0.0.1:`peer_port`."""
        pid = _pid_of_socket(peer_port, self._server.server_address[1])
        if pid is None:
            return "unknown"
        if pid == os.getpid():
            return "main"
        with self._lock:
            if pid in self._labels:
                return self._labels[pid]
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            argv = []
        label = (argv[argv.index("--host-name") + 1] if "--host-name" in argv[:-1]
                 else f"pid-{pid}")
        with self._lock:
            self._labels[pid] = label
        return label

    # -- forwarding --------------------------------------------------------------------
    def forward(self, req: Request, headers: list[tuple[str, str]]):
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port,
                                          timeout=120)
        try:
            conn.request(req.method, req.path, body=req.body or None,
                         headers={k: v for k, v in headers if k.lower() not in _HOP})
            resp = conn.getresponse()
            body = resp.read()
            out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
            return resp.status, resp.reason, out_headers, body
        finally:
            conn.close()

    def rewrite(self, req: Request, headers: list[tuple[str, str]], body: bytes):
        """Links the emulator hands out (upload sessions, media links) point back here."""
        up = f"{self.upstream.scheme}://{self.upstream.netloc}"
        headers = [(k, v.replace(up, self.url) if k.lower() == "location" else v)
                   for k, v in headers]
        if req.query.get("alt") != "media":
            body = body.replace(up.encode(), self.url.encode())
        return headers, body


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # Clients drop connections the proxy broke, or that they stopped using: not news.
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


def _handler_for(proxy: FaultProxy):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real clients use it

        def setup(self):
            super().setup()
            self.client_name = proxy.client_of(self.client_address[1])

        def log_message(self, *args):  # quiet
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _handle(self):
            req = Request(self.client_name, self.command, self.path, self._body(),
                          _library(self.headers.get("User-Agent", "")))
            kind = proxy.decide(req)
            if kind in REFUSALS:
                status, reason, why, message = REFUSALS[kind]
                self._send(status, reason, [("Content-Type", "application/json")],
                           json.dumps({"error": {"code": status, "message": message,
                                                 "errors": [{"reason": why,
                                                             "message": message}]}}).encode())
                return
            if kind in ("429", "503"):
                status = int(kind)
                self._send(status, "Too Many Requests" if status == 429 else
                           "Service Unavailable", [("Content-Type", "application/json")],
                           json.dumps({"error": {"code": status, "message":
                                                 f"injected {status} (fault proxy)"}}).encode())
                return
            status, reason, headers, body = proxy.forward(req, list(self.headers.items()))
            if req.is_create_only:
                with proxy._lock:
                    proxy.creates[req.object_name].append(status)
            headers, body = proxy.rewrite(req, headers, body)
            if kind == "lost":
                self._reset()
            elif kind == "reset":
                self._send(status, reason, headers, body, cut=True)
            else:
                if kind == "slow":
                    time.sleep(proxy.slow_s)
                self._send(status, reason, headers, body)

        def _send(self, status, reason, headers, body, cut: bool = False):
            self.send_response_only(status, reason)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body[:len(body) // 2] if cut else body)
            if cut:
                self.wfile.flush()
                self._reset()

        def _reset(self):
            # SO_LINGER 0: close() sends RST, as a dropped connection looks to the client.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = lambda self: self._handle()

        def finish(self):
            try:
                super().finish()
            except OSError:
                pass

    return Handler


def _library(user_agent: str) -> str:
    if user_agent.startswith("tensorstore"):
        return "tensorstore"
    if "gcloud-python" in user_agent or "gccl/" in user_agent:
        return "google-cloud-storage"
    return user_agent.split("/")[0] or "unknown"


def _pid_of_socket(peer_port: int, proxy_port: int) -> int | None:
    """The process holding the loopback socket 127.0.0.1:peer_port -> 127.0.0.1:proxy_port,
    from /proc/net/tcp (its inode) and /proc/<pid>/fd (who holds that inode)."""
    local, remote = f"0100007F:{peer_port:04X}", f"0100007F:{proxy_port:04X}"
    inode = None
    try:
        with open("/proc/net/tcp") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 9 and parts[1] == local and parts[2] == remote:
                    inode = parts[9]
                    break
    except OSError:
        return None
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in [os.getpid()] + sorted(_descendants(os.getpid())):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return pid
            except OSError:
                continue
    return None


def _descendants(root: int) -> set[int]:
    """Processes below `root` (the workers a test's `actx submit` starts)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                parent[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found
