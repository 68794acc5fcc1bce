"""`actx status RUN --serve [PORT]` and `--html FILE`: the live page, served or written once.

The server binds to 127.0.0.1 only and answers two paths: `/` (the page with the current
data embedded) and `/data.json` (what the page polls). A status is computed at most once
per refresh interval, however many viewers poll, so a page left open on a pod run costs
the store one status per interval.
"""

from __future__ import annotations

import http.server
import json
import threading
import time

from actx.deploy.page import data as ui_data
from actx.deploy.page import document as ui_page
from actx.deploy.status import runstate
from actx.schemas import errors
from actx.schemas import run_dir


class PageSource:
    """The page's data for one run, recomputed at most every `min_interval_s`. `extractions`:
    every extraction of the run the page lists ({name: handle}, `handle` among them), one
    line each, beside the one it shows in full."""

    def __init__(self, handle: run_dir.OpenedRun, stale_after_s: float,
                 min_interval_s: float = 1.0,
                 extractions: dict[str, run_dir.OpenedRun] | None = None):
        self.handle = handle
        self.extractions = extractions or {}
        self.stale_after_s = stale_after_s
        self.min_interval_s = min_interval_s
        # Rejects are written once by prepare: their samples are read once per page source.
        self.rejects = ui_data.read_reject_samples(handle.store, handle.manifest)
        self._lock = threading.Lock()
        self._data: dict | None = None
        self._at = 0.0

    def data(self) -> dict:
        with self._lock:
            if self._data is None or time.monotonic() - self._at >= self.min_interval_s:
                status = runstate.compute_status(self.handle, self.stale_after_s,
                                                 history=True)
                self._data = ui_data.page_data(status, self.rejects)
                shown = next((n for n, h in self.extractions.items() if h is self.handle), "")
                self._data["extractions"] = ui_data.extraction_lines({
                    name: status if name == shown else
                    runstate.compute_status(h, self.stale_after_s)
                    for name, h in self.extractions.items()}, shown)
                self._at = time.monotonic()
            return self._data


def write_html(handle: run_dir.OpenedRun, path: str, stale_after_s: float,
               extractions: dict[str, run_dir.OpenedRun] | None = None) -> dict:
    """Writes the page once, self-contained (no server, no refresh). Returns its data."""
    data = PageSource(handle, stale_after_s, extractions=extractions).data()
    with open(path, "w", encoding="utf-8") as f:
        f.write(ui_page.render_html(data, live_s=0))
    return data


def make_server(source: PageSource, port: int, refresh_s: float) -> http.server.HTTPServer:
    """A server on 127.0.0.1:`port` (0: any free port); call serve_forever() on it."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            try:
                if path in ("/", "/index.html"):
                    body = ui_page.render_html(source.data(), live_s=refresh_s).encode()
                    kind = "text/html; charset=utf-8"
                elif path == "/data.json":
                    body = json.dumps(source.data(), separators=(",", ":")).encode()
                    kind = "application/json"
                else:
                    self.send_error(404, f"{path}: the page is at / and its data at /data.json")
                    return
            except Exception as e:  # the store can fail (network): say so on the page
                self.send_error(503, f"cannot read the run: {e}")
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
            pass  # one line per poll would bury the terminal

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def page_command(handle: run_dir.OpenedRun, html_path: str | None, port: int | None,
                 refresh_s: float, stale_after_s: float, out,
                 extractions: dict[str, run_dir.OpenedRun] | None = None) -> int:
    """`actx status RUN --html FILE` and/or `--serve [PORT]`: the page of `handle`, listing
    the run's `extractions` too where it has several."""
    if refresh_s <= 0:
        raise errors.UserError(f"--refresh {refresh_s:g}: must be a positive number of "
                               f"seconds")
    if html_path is not None:
        data = write_html(handle, html_path, stale_after_s, extractions)
        print(f"wrote {html_path} ({data['counts']['committed']}/{data['partitions_total']} "
              f"partitions committed); open it in a browser", file=out, flush=True)
    if port is not None:
        return serve(handle, port, refresh_s, stale_after_s, out, extractions)
    return 0


def serve(handle: run_dir.OpenedRun, port: int, refresh_s: float, stale_after_s: float,
          out, extractions: dict[str, run_dir.OpenedRun] | None = None) -> int:
    """Serves the page until interrupted (Ctrl-C)."""
    source = PageSource(handle, stale_after_s, min_interval_s=min(refresh_s, 5.0),
                        extractions=extractions)
    try:
        server = make_server(source, port, refresh_s)
    except OSError as e:
        raise errors.UserError(f"--serve {port}: cannot listen on 127.0.0.1:{port} ({e}); "
                               f"choose another port, or 0 for any free one") from None
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    print(f"serving {handle.location} at {url} (refreshes every {refresh_s:g}s; Ctrl-C stops)",
          file=out, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
