"""The live page's HTML: one self-contained document (inline CSS and JS, no network).

The data (see `deploy.page.data`) is embedded as JSON, so `--html FILE` is complete on its
own; a served page also polls `data.json`. The partition map is drawn on a canvas (one
cell per partition; 150k partitions are 150k rectangles, not 150k DOM nodes), then read
back pixel by pixel into `#map[data-drawn]`, so a test can check what was drawn.
"""

from __future__ import annotations

import html
import json

from actx.deploy.page import script as ui_script

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#1d2430;background:#f6f7f9}
h1{font-size:20px;margin:0 0 2px} h2{font-size:15px;margin:20px 0 6px}
.sub{color:#5a6473;font-size:12px;word-break:break-all}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin-top:12px}
.card{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:8px 12px;min-width:140px}
.card .k{font-size:11px;color:#5a6473;text-transform:uppercase}
.card .v{font-size:18px;font-weight:600}
.legend span{display:inline-block;margin-right:14px}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
canvas{background:#fff;border:1px solid #dde1e7;border-radius:4px}
table{border-collapse:collapse;background:#fff;font-size:12px}
td,th{border-bottom:1px solid #eceef2;padding:3px 8px;text-align:left;white-space:nowrap}
td.num{text-align:right} tr.dead td{color:#b42318} tr.slow td{color:#b54708}
.bar{display:inline-block;height:8px;background:#2e90fa;vertical-align:middle}
code{background:#eef1f5;padding:2px 6px;border-radius:4px}
.grid2{display:flex;flex-wrap:wrap;gap:16px}
.phase{margin-top:10px;padding:8px 12px;border-radius:6px;font-weight:600;background:#eef4ff}
.phase-finished{background:#e7f7ee;color:#05603a} .phase-failed{background:#fef3f2;color:#b42318}
.phase-stopped{background:#fffaeb;color:#b54708} .phase-starting{background:#f4f3ff;color:#5925dc}
.ok{color:#05603a;font-weight:600} .bad{color:#b42318;font-weight:600}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:6px 0;
 background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:8px 12px;font-size:13px}
dl.facts dt{color:#5a6473} dl.facts dd{margin:0;word-break:break-all}
#failures div{color:#b42318;margin:2px 0} #history div{color:#5a6473;margin:2px 0}
td.msg{white-space:normal;max-width:560px;word-break:break-word} tr.shown td{font-weight:600}
"""

_BODY = """
<h1>actx run <span id="name"></span></h1>
<div class="sub"><span id="run"></span> &middot; fingerprint <span id="fingerprint"></span>
 &middot; as of <span id="at"></span> &middot; <span id="live"></span></div>
<div id="phase" class="phase"></div><div id="failures"></div><div id="history"></div>
<div id="extractions"></div>
<div class="cards">
 <div class="card"><div class="k">committed</div><div class="v"><span id="n-committed"></span>
  / <span id="n-total"></span></div></div>
 <div class="card"><div class="k">in progress</div><div class="v" id="n-in_progress"></div></div>
 <div class="card"><div class="k">stale</div><div class="v" id="n-stale"></div></div>
 <div class="card"><div class="k">pending</div><div class="v" id="n-pending"></div></div>
 <div class="card"><div class="k">tokens</div><div class="v"><span id="tokens-done"></span>
  / <span id="tokens-total"></span> (<span id="tokens-pct"></span>)</div></div>
 <div class="card"><div class="k">activation bytes</div><div class="v"><span id="bytes-done">
  </span> / <span id="bytes-total"></span></div></div>
 <div class="card"><div class="k" id="rate-label"></div><div class="v" id="tokens-per-s">
  </div></div>
 <div class="card"><div class="k" id="eta-label"></div><div class="v" id="eta"></div></div>
 <div class="card" id="card-hosts-live"><div class="k">hosts live</div><div class="v">
  <span id="hosts-live"></span> / <span id="hosts-total"></span></div></div>
 <div class="card" id="card-hosts-done" hidden><div class="k">hosts done</div><div class="v">
  <span id="hosts-done"></span> / <span id="hosts-total-done"></span></div></div>
</div>
<div class="grid2">
 <div><h2>Run</h2><dl class="facts" id="identity"></dl></div>
 <div><h2>Latest verify</h2><div id="verify"></div><div id="reference" hidden></div></div>
</div>
<h2>Partitions</h2><div class="legend" id="legend"></div><canvas id="map"></canvas>
<div class="grid2">
 <div><h2>Tokens over time (all hosts)</h2><canvas id="chart-tokens" width="560" height="220">
 </canvas></div>
 <div><h2>Throughput (tokens/s)</h2><canvas id="chart-rate" width="560" height="220"></canvas>
 </div>
</div>
<h2>Hosts</h2>
<table><thead><tr><th>host</th><th>state</th><th>last heartbeat</th><th>partition</th>
<th>step</th><th>tokens/s</th><th></th><th>tokens done</th><th>partitions</th>
<th>what it is doing / why it stopped</th></tr></thead><tbody id="hosts"></tbody></table>
<div class="grid2">
 <div><h2>Inputs per source</h2>
 <table><thead><tr><th>source</th><th>rejected</th><th>read</th></tr></thead>
 <tbody id="rejects"></tbody></table></div>
 <div><h2>Rejects by reason <span class="sub" id="reject-note"></span></h2>
 <table><thead><tr><th>source</th><th>reason</th><th>count</th><th>first one</th></tr></thead>
 <tbody id="reject-groups"></tbody></table></div>
</div>
<h2>Token masks (what the reader's exclude= leaves out) <span class="sub" id="masks-positions">
</span></h2>
<table><thead><tr><th>mask</th><th>tokens</th><th>share</th></tr></thead>
<tbody id="masks"></tbody></table>
<h2>Commands</h2><div id="commands"></div>
"""


def render_html(data: dict, live_s: float = 0) -> str:
    """The page with `data` embedded; `live_s` > 0 polls data.json every `live_s` seconds."""
    # "</" inside a script element would end it: JSON allows the escaped form "<\\/".
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>actx: {html.escape(str(data.get('name', '')))}</title>"
            f"<style>{_CSS}</style></head>\n<body id=\"page\">{_BODY}"
            f"<script id=\"actx-data\" type=\"application/json\">{payload}</script>\n"
            f"<script>const LIVE_S = {float(live_s)!r};\n{ui_script.SCRIPT}</script>"
            f"</body></html>\n")
