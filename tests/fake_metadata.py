"""The fake TPU hosts' metadata server, on loopback (a thread of the test process).

Answers GET /<tpu>/<worker>/<attribute> as a TPU VM's metadata server answers
/computeMetadata/v1/instance/attributes/<attribute>: agent-worker-number, and
worker-network-endpoints ("unknown:unknown:<ip>" per host, worker 0 first; all 127.0.0.1
here). Like the real one it refuses a request without `Metadata-Flavor: Google`.
"""

from __future__ import annotations

import http.server
import threading

from tests.fake_gcloud import FakeCloud


class MetadataServer:
    def __init__(self, cloud: FakeCloud):
        self.cloud = cloud
        cloud_ref = cloud

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, "Missing Metadata-Flavor:Google header.")
                parts = self.path.strip("/").split("/")
                tpu = cloud_ref.read()["tpus"].get(parts[0]) if len(parts) == 3 else None
                if tpu is None or not parts[1].isdigit() or int(parts[1]) >= tpu["hosts"]:
                    return self._send(404, "not found")
                if parts[2] == "agent-worker-number":
                    return self._send(200, parts[1])
                if parts[2] == "worker-network-endpoints":
                    return self._send(200, ",".join(["unknown:unknown:127.0.0.1"] * tpu["hosts"]))
                return self._send(404, "not found")

            def _send(self, code: int, body: str):
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> "MetadataServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
