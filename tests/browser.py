"""Real headless Chromium for page tests: the DOM after scripts ran, and screenshots.

Debian's `chromium` package (installed by .ci/run). Running as root needs --no-sandbox;
every launch gets a fresh profile directory, and nothing reaches beyond loopback.
"""

from __future__ import annotations

import html
import html.parser
import os
import re
import shutil
import subprocess
import tempfile

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def require_chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("Chromium is not installed, so the page cannot be opened in a real "
                    "browser here: `apt-get install -y chromium` (as .ci/run does)")
    return path


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="actx-chromium-") as profile:
        cmd = [require_chromium(), *FLAGS, f"--user-data-dir={profile}", *args]
        res = subprocess.run(cmd, capture_output=True, timeout=timeout_s)
    if res.returncode != 0:
        raise AssertionError(f"chromium exited {res.returncode}: "
                             f"{res.stderr.decode(errors='replace')[-2000:]}")
    return res


def dump_dom(url: str, budget_ms: int = 3000, timeout_s: float = 120) -> str:
    """The serialized DOM once scripts have run for `budget_ms` of virtual time."""
    res = _run([f"--virtual-time-budget={budget_ms}", "--dump-dom", url], timeout_s)
    return res.stdout.decode()


_HARNESS = """<!doctype html><html><body>%s<script>
// Each page's DOM once its scripts rendered, copied out as text (file:// frames are
// readable with --allow-file-access-from-files).
function grab() {
  const frames = [...document.querySelectorAll("iframe")];
  const docs = frames.map((f) => f.contentDocument);
  if (docs.some((d) => !d || !d.body || !d.body.dataset.rendered)) { setTimeout(grab, 50); return; }
  docs.forEach((d, i) => {
    const pre = document.createElement("pre"); pre.id = "dump-" + i;
    pre.textContent = d.documentElement.outerHTML; document.body.appendChild(pre);
  });
}
grab();
</script></body></html>"""


def dump_doms(paths: list[str], budget_ms: int = 4000, timeout_s: float = 120,
              width: int = 1300, height: int = 1500) -> list[str]:
    """The DOMs of several local HTML files after their scripts ran, from one Chromium
    start (each page in a frame of `width` x `height`): a module's pages cost one launch."""
    frames = "".join(f'<iframe src="file://{os.path.abspath(p)}" width="{width}" '
                     f'height="{height}"></iframe>' for p in paths)
    with tempfile.TemporaryDirectory(prefix="actx-harness-") as d:
        harness = os.path.join(d, "harness.html")
        with open(harness, "w") as f:
            f.write(_HARNESS % frames)
        res = _run(["--allow-file-access-from-files", f"--virtual-time-budget={budget_ms}",
                    "--dump-dom", f"file://{harness}"], timeout_s)
    out = res.stdout.decode()
    doms = []
    for i in range(len(paths)):
        found = re.search(rf'<pre id="dump-{i}">(.*?)</pre>', out, re.S)
        assert found, f"{paths[i]}: the page never rendered in Chromium"
        doms.append(html.unescape(found.group(1)))
    return doms


def screenshot(url: str, path: str, width: int = 1300, height: int = 1500,
               budget_ms: int = 3000, timeout_s: float = 120) -> str:
    _run([f"--virtual-time-budget={budget_ms}", f"--window-size={width},{height}",
          f"--screenshot={os.path.abspath(path)}", url], timeout_s)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    return path


class Elements(html.parser.HTMLParser):
    """Elements with an id or one of the data- attributes of KEYS: attributes and text."""

    KEYS = ("id", "data-host", "data-source", "data-mask", "data-reject", "data-command",
            "data-failed-host", "data-extraction")

    def __init__(self, markup: str):
        super().__init__()
        self.by_key: dict[str, dict] = {}
        self._open: list[tuple[str, dict | None]] = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        if tag in ("td", "th", "br", "div", "tr"):
            self.handle_data(" ")  # cells and lines read as separate words
        attrs = dict(attrs)
        entry = None
        for k in self.KEYS:
            if attrs.get(k) is not None:
                entry = {"tag": tag, "attrs": attrs, "text": ""}
                self.by_key[f"{k}={attrs[k]}" if k != "id" else attrs[k]] = entry
                break
        if tag not in ("br", "meta", "input", "img", "hr"):
            self._open.append((tag, entry))

    def handle_endtag(self, tag):
        while self._open:
            open_tag, _ = self._open.pop()
            if open_tag == tag:
                break

    def handle_data(self, data):
        for _, entry in self._open:
            if entry is not None:
                entry["text"] += data

    def text(self, key: str) -> str:
        return " ".join(self.by_key[key]["text"].split())

    def attr(self, key: str, name: str) -> str | None:
        return self.by_key[key]["attrs"].get(name)
