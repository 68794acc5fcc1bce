"""Object-store failures through the real command line (subprocesses, the real
google-cloud-storage client): no credentials, an unknown bucket (GCS emulator), permission
denied (a loopback server answering as GCS does), no network (a
closed port). Each is one line on stderr with exit 2 within 15 s, or, where the failure is
retried until the interactive deadline, well before the workers' retry budget. A pipe that
closes early (`actx status RUN | head -1`) is no error."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from actx.schemas import store_errors
from tests import token_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = 15.0


def _actx(*args, env=None, timeout=60):
    env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "actx.deploy.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


# A failure an interactive command retries (a dropped connection, a refused one) ends at
# its deadline (10 s), not at the workers' 120 s budget. How far past 10 s the process
# ends is the machine's: on CI's (four test processes on two cores) a refresh retried to
# the deadline ended after 15.4, 21.7 and 24.9 s where it takes 9 s here, though the
# process started in 1.2 s. The bound for those says which of the two applied.
RETRIED_LIMIT_S = store_errors.DEFAULT_RETRY_BUDGET_S / 2


def _one_error_line(proc, seconds, *expected, limit_s: float = LIMIT_S):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert seconds < limit_s, seconds
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _closed_port():
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_credentials(tmp_path):
    # No emulator, no key file, no gcloud config, and no metadata server to ask.
    env = {"STORAGE_EMULATOR_HOST": None, "GOOGLE_APPLICATION_CREDENTIALS": None,
           "HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(tmp_path), "NO_GCE_CHECK": "True"}
    proc, seconds = _actx("status", "gs://some-bucket/runs/r1", env=env)
    _one_error_line(proc, seconds, "gs://some-bucket/runs/r1: no Google Cloud credentials found",
                    "gcloud auth application-default login")


def test_user_credentials_without_a_project(tmp_path):
    """What `gcloud auth application-default login` writes: user credentials naming no
    project. Reading a bucket needs none, so the client is built without one (it used to
    end in a traceback, "Project was not passed and could not be determined from the
    environment"); here the token refresh then cannot reach Google, said in one line.
    The refresh goes through a proxy on a closed loopback port, so it fails at once on any
    machine: left to the machine's own DNS, a resolver that times out instead of refusing
    (CI's) took 15.4 s to say Google's name does not resolve."""
    adc = tmp_path / "application_default_credentials.json"
    adc.write_text(json.dumps({"type": "authorized_user", "client_id": "id.apps",
                               "client_secret": "secret", "refresh_token": "token"}))
    env = {"STORAGE_EMULATOR_HOST": None, "GOOGLE_CLOUD_PROJECT": None,
           "GCLOUD_PROJECT": None, "GOOGLE_APPLICATION_CREDENTIALS": str(adc),
           "HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(tmp_path), "NO_GCE_CHECK": "True",
           "HTTPS_PROXY": f"http://127.0.0.1:{_closed_port()}", "https_proxy": None,
           "NO_PROXY": None, "no_proxy": None}
    for command in ("status", "verify"):
        proc, seconds = _actx(command, "gs://some-bucket/runs/r1", env=env)
        line = _one_error_line(proc, seconds, "gs://some-bucket/runs/r1/run.json: ",
                               limit_s=RETRIED_LIMIT_S)
        assert "Project was not passed" not in line and "project" not in line.lower(), line


@pytest.mark.parametrize("command", ["status", "verify", "rerun"])
def test_unknown_bucket(gcs_emulator_server, command):
    proc, seconds = _actx(command, "gs://actx-no-such-bucket/runs/r1")
    _one_error_line(proc, seconds, "bucket actx-no-such-bucket does not exist (404)")


def test_prepare_into_an_unknown_bucket(gcs_emulator_server, tmp_path, qwen_tokenizer_dir):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"text": "one document"}) + "\n")
    proc, seconds = _actx("prepare", "--out", "gs://actx-no-such-bucket/r", "--tokenizer",
                          qwen_tokenizer_dir, "--text", str(data), "--runner=FnApiRunner")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "bucket actx-no-such-bucket does not exist (404)" in proc.stdout


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every request as GCS answers a refused one (JSON error body)."""

    code = 403

    def _answer(self):
        message = ("actx-sa@p.iam.gserviceaccount.com does not have storage.objects.get "
                   "access to the Google Cloud Storage object.")
        body = json.dumps({"error": {"code": self.code, "message": message,
                                     "errors": [{"message": message}]}}).encode()
        self.send_response(self.code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_server(request):
    handler = type("Handler", (_Refusing,), {"code": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("refusing_server", [403], indirect=True)
@pytest.mark.parametrize("command", ["status", "verify"])
def test_permission_denied(refusing_server, command):
    proc, seconds = _actx(command, "gs://locked/runs/r1",
                          env={"STORAGE_EMULATOR_HOST": refusing_server})
    _one_error_line(proc, seconds, "gs://locked/runs/r1", "permission denied on bucket locked",
                    "does not have storage.objects.get access", "roles/storage.objectViewer")


def test_no_network():
    port = _closed_port()
    proc, seconds = _actx("status", "gs://b/runs/r1",
                          env={"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"})
    _one_error_line(proc, seconds, f"cannot reach http://127.0.0.1:{port}",
                    "Connection refused", "check the network", limit_s=RETRIED_LIMIT_S)


def test_pipe_closed_early_is_no_error(tmp_path):
    """`actx status RUN | head -1`: the reader closes before status writes."""
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(tmp_path / "model"), n_rows=64, partition_rows=1,
                               rows_per_shard=1)
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before the child starts: every write meets a closed pipe
    proc = subprocess.run([sys.executable, "-m", "actx.deploy.cli", "status", run], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, stdout=write_end,
                          stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_an_interactive_command_does_not_retry_a_host_that_does_not_resolve():
    """`status` and `verify` under their 10 s deadline: a host name that does not resolve
    (what a machine without network, or a wrong endpoint, gives) is final at once; a
    temporary failure of name resolution is retried like a dropped connection, and the
    workers (no deadline, a 120 s budget) retry both."""
    import requests
    from google.auth import exceptions as auth

    from actx.schemas import store_errors

    def refresh_failure(errno: int) -> BaseException:
        # google-auth's refresh over requests/urllib3: the gaierror survives as text only.
        gai = socket.gaierror(errno, "resolution failed")
        cause = requests.exceptions.ConnectionError(
            f"HTTPSConnectionPool(host='oauth2.googleapis.com', port=443): Max retries "
            f"exceeded (Caused by NameResolutionError(\"Failed to resolve: {gai}\"))")
        try:
            raise auth.TransportError(cause) from cause
        except auth.TransportError as e:
            return e

    unknown, temporary = (refresh_failure(socket.EAI_NONAME),
                          refresh_failure(socket.EAI_AGAIN))
    with store_errors.deadline(store_errors.INTERACTIVE_DEADLINE_S):
        retried = store_errors.read_options()["retry"]._predicate
        assert not retried(unknown)
        assert retried(temporary)
        assert retried(requests.exceptions.ConnectionError("connection reset"))
    workers = store_errors.read_options()["retry"]._predicate
    assert workers(unknown) and workers(temporary)


def test_a_write_into_an_immutable_folder_is_one_line_not_a_traceback(tmp_path):
    """A fault audit made a run's folders immutable (chattr +i: EPERM, for root too) while
    a worker wrote: tensorstore's `PERMISSION_DENIED ... Operation not permitted` ended the
    worker in a traceback, where EACCES, EROFS and ENOSPC were one line."""
    import shutil
    import subprocess

    import tensorstore as ts

    from actx.schemas import store_errors

    folder = tmp_path / "frozen"
    folder.mkdir()
    if not shutil.which("chattr") or subprocess.run(
            ["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("needs chattr +i (root, a file system that has it)")
    try:
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                         "path": str(folder / "a")},
                         "metadata": {"shape": [4], "data_type": "int32"},
                         "create": True}, create=True)
        with pytest.raises(store_errors.StoreError) as refused:
            with store_errors.tensorstore_errors(str(folder / "a")):
                array.result()[...].write([1, 2, 3, 4]).result()
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    said = str(refused.value)
    assert "cannot write (Operation not permitted); this user may not write there: choose a " \
           "writable run directory, or fix its permissions, then run the same command " \
           "again" in said, said
