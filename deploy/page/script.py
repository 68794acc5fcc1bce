"""The live page's script: it fills the page from the embedded data (and, served, from
`data.json` every LIVE_S seconds), draws the partition map and the charts on canvases.

Apart from `deploy.page.document` (the HTML, the CSS and `render_html`) because it is a
program in another language, about as long as the rest of the page together; `render_html` inlines
it, so the page stays one self-contained file. It reads `LIVE_S`, which `render_html`
defines before it.
"""

SCRIPT = r"""
const COLORS = {"C": [18, 183, 106], "W": [46, 144, 250], "S": [240, 68, 56],
                "F": [122, 90, 248], ".": [208, 213, 221]};
const NAMES = {"C": "committed", "W": "in progress", "S": "stale",
               "F": "failed verification", ".": "pending"};
const $ = (id) => document.getElementById(id);
const int = (n) => Number(n).toLocaleString("en-US", {maximumFractionDigits: 0});
const dec1 = (n) => Number(n).toLocaleString("en-US",
  {minimumFractionDigits: 1, maximumFractionDigits: 1});
function size(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[i];
}
function duration(s) {
  if (s === null || s === undefined) return "unknown";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  const p = (x) => String(x).padStart(2, "0");
  return h ? `${h}h${p(m)}m${p(sec)}s` : (m ? `${m}m${p(sec)}s` : `${sec}s`);
}
function hhmm(t) { return new Date(t * 1000).toISOString().slice(11, 19); }
function set(id, text, value) {
  const el = $(id); el.textContent = text;
  if (value !== undefined) el.dataset.value = value === null ? "null" : String(value);
}

function drawMap(map) {
  const canvas = $("map"), n = map.length;
  const width = Math.min(1200, Math.max(300, document.body.clientWidth - 60));
  const cell = Math.max(2, Math.min(16, Math.floor(Math.sqrt(width * 420 / Math.max(1, n)))));
  const cols = Math.max(1, Math.floor(width / cell)), rows = Math.max(1, Math.ceil(n / cols));
  canvas.width = cols * cell; canvas.height = rows * cell;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(canvas.width, canvas.height);
  const px = img.data, W = canvas.width;
  for (let i = 0; i < n; i++) {
    const c = COLORS[map[i]] || [0, 0, 0];
    const x0 = (i % cols) * cell, y0 = Math.floor(i / cols) * cell;
    const inner = cell > 3 ? cell - 1 : cell;  // a gap between cells when they are large
    for (let y = y0; y < y0 + inner; y++) {
      for (let x = x0; x < x0 + inner; x++) {
        const o = (y * W + x) * 4;
        px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255;
      }
    }
  }
  ctx.putImageData(img, 0, 0);
  // Read back what was drawn: the colour at each cell's top-left pixel.
  const back = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
  const drawn = {}, odd = [];
  for (let i = 0; i < n; i++) {
    const o = (Math.floor(i / cols) * cell * W + (i % cols) * cell) * 4;
    let found = "?";
    for (const k in COLORS) {
      const c = COLORS[k];
      if (back[o] === c[0] && back[o + 1] === c[1] && back[o + 2] === c[2]) { found = k; break; }
    }
    drawn[found] = (drawn[found] || 0) + 1;
    if ((found === "S" || found === "W" || found === "F") && odd.length < 50) odd.push(i);
  }
  canvas.dataset.drawn = JSON.stringify(drawn);
  canvas.dataset.flagged = JSON.stringify(odd);
  canvas.dataset.cell = cell; canvas.dataset.cols = cols;
  canvas.onmousemove = (e) => {
    const r = canvas.getBoundingClientRect();
    const i = Math.floor((e.clientY - r.top) / cell) * cols +
              Math.floor((e.clientX - r.left) / cell);
    canvas.title = i < n ? `p-${String(i).padStart(5, "0")}: ${NAMES[map[i]]}` : "";
  };
}

function niceStep(range, target) {
  const raw = range / Math.max(1, target), mag = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
  return 10 * mag;
}
function timeStep(span) {  // seconds between x ticks: whole seconds, minutes or hours
  const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800,
                 21600, 43200, 86400];
  return steps.find((x) => span / x <= 6) || 86400 * Math.ceil(span / 86400 / 6);
}
function tickTime(s) {  // 0s, 45s, 10m, 1h30m: ticks fall on whole units
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return m ? `${h}h${m}m` : `${h}h`;
  if (m) return sec ? `${m}m${sec}s` : `${m}m`;
  return `${sec}s`;
}
function short(n) {  // 12,500 -> 12.5k; tick labels stay narrow
  const a = Math.abs(n);
  for (const [d, u] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (a >= d) return Number((n / d).toFixed(2)) + u;
  }
  return String(Number(n.toFixed(2)));
}

// A line chart with labelled axes: y ticks in `unit`, x ticks as time since `t0` (the
// run's first sample); the span before the first non-zero value is shaded "start-up".
function drawLine(id, points, unit, t0) {
  const canvas = $(id), ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 62, B = 34, T = 12, R = 14;
  ctx.clearRect(0, 0, W, H); ctx.font = "11px sans-serif"; ctx.fillStyle = "#5a6473";
  canvas.dataset.points = points.length;
  if (points.length < 2) {
    ctx.fillText("no history yet (a worker's heartbeats draw it)", L, H / 2);
    canvas.dataset.xticks = "[]"; canvas.dataset.yticks = "[]"; return;
  }
  const t1 = points[points.length - 1][0];
  let vmax = 0; for (const p of points) vmax = Math.max(vmax, p[1]);
  // Tokens and tokens/s in whole numbers: with nothing yet the axis still reads 0..4.
  const ystep = Math.max(1, niceStep(vmax || 4, 4)), ytop = Math.max(ystep, Math.ceil(vmax / ystep) * ystep);
  const span = Math.max(1e-9, t1 - t0);
  const X = (t) => L + (W - L - R) * (t - t0) / span;
  const Y = (v) => H - B - (H - B - T) * v / ytop;
  const firstWork = points.find((p) => p[1] > 0);
  const startup = firstWork ? firstWork[0] - t0 : span;
  if (startup > 0) {
    ctx.fillStyle = "#f4f3ff"; ctx.fillRect(L, T, X(t0 + startup) - L, H - B - T);
    ctx.fillStyle = "#5925dc";
    if (X(t0 + startup) - L > 50) ctx.fillText("start-up", L + 4, T + 12);
  }
  canvas.dataset.startupS = startup.toFixed(1);
  ctx.strokeStyle = "#eceef2"; ctx.fillStyle = "#5a6473"; ctx.textAlign = "right";
  const yticks = [];
  for (let v = 0; v <= ytop + 1e-9; v += ystep) {
    const y = Y(v); ctx.beginPath(); ctx.moveTo(L, y); ctx.lineTo(W - R, y); ctx.stroke();
    const label = short(v); yticks.push(label); ctx.fillText(label, L - 6, y + 4);
  }
  ctx.textAlign = "center";
  const xstep = timeStep(span), xticks = [];
  for (let x = 0; x <= span + 1e-9; x += xstep) {
    const px = X(t0 + x); ctx.beginPath(); ctx.moveTo(px, H - B); ctx.lineTo(px, H - B + 4);
    ctx.stroke(); const label = tickTime(x); xticks.push(label);
    ctx.fillText(label, px, H - B + 15);
  }
  ctx.fillText(`time since the first heartbeat (started ${hhmm(t0)} UTC)`, L + (W - L - R) / 2,
               H - 3);
  ctx.save(); ctx.translate(11, T + (H - B - T) / 2); ctx.rotate(-Math.PI / 2);
  ctx.fillText(unit, 0, 0); ctx.restore();
  ctx.strokeStyle = "#98a2b3"; ctx.beginPath(); ctx.moveTo(L, T); ctx.lineTo(L, H - B);
  ctx.lineTo(W - R, H - B); ctx.stroke();
  ctx.strokeStyle = "#2e90fa"; ctx.lineWidth = 2; ctx.beginPath();
  points.forEach((p, i) => i ? ctx.lineTo(X(p[0]), Y(p[1])) : ctx.moveTo(X(p[0]), Y(p[1])));
  ctx.stroke(); ctx.lineWidth = 1; ctx.textAlign = "start";
  canvas.dataset.xticks = JSON.stringify(xticks); canvas.dataset.yticks = JSON.stringify(yticks);
}

function when(t) { return new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) +
                          " UTC"; }
function renderIdentity(d) {
  const i = d.identity || {}, rows = [];
  const hooks = i.hooks ? Object.entries(i.hooks).map(([h, w]) => `${h} (${int(w)})`).join(", ")
    : `${i.hooks_requested} (resolved when a worker starts)`;
  const facts = [["model", i.model + (i.model_dtype ? ` (computes in ${i.model_dtype})` : "")],
    ["hooks", hooks], ["stored dtype", i.dtype], ["seq_len", int(i.seq_len)],
    ["packing", `${i.packing} (overflow: ${i.overflow})`],
    ["max_context", i.max_context ? int(i.max_context) : "none (rows are seen alone)"],
    ["tokens", `${int(i.tokens)} in ${int(i.rows)} rows`], ["activations", i.activations],
    ...(d.generation_facts || [])];  // a generating run's settings and counts
  for (const [k, v] of facts) {
    rows.push(`<dt>${esc(k)}</dt><dd id="id-${k.replace(/[ _]/g, "-")}">${esc(v)}</dd>`);
  }
  $("identity").innerHTML = rows.join("");
  const v = d.verification, el = $("verify");
  if (!v) {
    el.className = ""; el.dataset.state = "none";
    el.innerHTML = `not run yet: <code>${esc(d.commands.verify)}</code> re-reads the data ` +
                   `against its commit markers`;
  } else if (v.ok) {
    el.className = "ok"; el.dataset.state = "passed";
    el.textContent = `passed at ${when(v.at)} (${int(v.checked)} partitions checked)`;
  } else if (!v.failed && !v.repaired) {  // a problem of no one partition
    el.className = "bad"; el.dataset.state = "failed";
    el.textContent = `FAILED at ${when(v.at)}: no partition failed its check` +
      (v.problems.length ? ` (${v.problems[0]})` : "") + `: ${d.commands.verify} checks ` +
      `the run again`;
  } else if (!v.failed) {
    el.className = "bad"; el.dataset.state = "repaired";
    el.textContent = `FAILED at ${when(v.at)}; its ${int(v.repaired)} failed partition(s) ` +
      `were repaired, not verified since: ${d.commands.verify} checks them`;
  } else {
    el.className = "bad"; el.dataset.state = "failed";
    el.textContent = `FAILED at ${when(v.at)}: ${int(v.failed)} committed partition(s) did ` +
      `not match their marker` + (v.problems.length ? ` (${v.problems[0]})` : "");
  }
  const r = d.reference, ref = $("reference");
  ref.hidden = !r;
  if (r) {
    ref.className = r.ok ? "ok" : "bad"; ref.dataset.state = r.ok ? "passed" : "failed";
    ref.textContent = r.at ? `${r.summary} (${when(r.at)})` : r.summary;
  }
}

function render(d) {
  document.title = `actx: ${d.name} (${d.phase})`;
  set("name", d.name); set("run", d.run); set("fingerprint", d.fingerprint);
  set("at", when(d.at), d.at);
  const phase = $("phase"); phase.className = "phase phase-" + d.phase.replace(" ", "-");
  phase.dataset.phase = d.phase; phase.textContent = `${d.phase}: ${d.phase_note}`;
  const failures = d.hosts.filter((h) => h.dead && h.message);
  $("failures").innerHTML = (d.problem ? `<div data-problem>${esc(d.problem)}</div>` : "") +
    failures.map((h) =>
    `<div data-failed-host="${esc(h.host)}">${esc(h.host)}: ${esc(h.message)}</div>`).join("");
  // What went wrong on the way to a complete run: history, in the page's plain colour.
  $("history").innerHTML = (d.history || []).map((line) =>
    `<div data-history>history: ${esc(line)}</div>`).join("");
  renderIdentity(d);
  const ex = d.extractions || [];  // a run with several models: a line per extraction
  $("extractions").innerHTML = ex.length ? "<h2>Extractions over this token store</h2>" +
    "<table><thead><tr><th>extraction</th><th>committed</th><th>in progress</th><th>stale" +
    "</th><th>pending</th><th>phase</th></tr></thead><tbody>" + ex.map((e) =>
    `<tr data-extraction="${esc(e.name)}"${e.shown ? ' class="shown"' : ""}><td>${esc(e.name)}` +
    `${e.shown ? " (this page)" : ""}</td><td class="num">${e.committed} / ${e.partitions}` +
    `</td><td class="num">${e.in_progress}</td><td class="num">${e.stale}</td>` +
    `<td class="num">${e.pending}</td><td>${esc(e.phase)}</td></tr>`).join("") +
    "</tbody></table>" : "";
  for (const k of ["committed", "in_progress", "stale", "pending"]) {
    set("n-" + k, int(d.counts[k]), d.counts[k]);
  }
  set("n-total", int(d.partitions_total), d.partitions_total);
  set("tokens-done", int(d.tokens_done), d.tokens_done);
  set("tokens-total", int(d.tokens_total), d.tokens_total);
  set("tokens-pct", (100 * d.tokens_done / Math.max(1, d.tokens_total)).toFixed(1) + "%");
  set("bytes-done", size(d.bytes_done), d.bytes_done);
  set("bytes-total", size(d.bytes_total), d.bytes_total);
  const finished = d.phase === "finished";
  // A finished run: its average rate and elapsed time; no live-host count to alarm anyone.
  set("rate-label", finished ? "tokens/s (average)" : "tokens/s (live hosts)");
  if (finished) set("tokens-per-s", dec1(d.average_tokens_per_s || 0), d.average_tokens_per_s);
  else set("tokens-per-s", dec1(d.tokens_per_s), d.tokens_per_s);
  set("eta-label", finished ? "took" : "ETA");
  set("eta", finished ? duration(d.elapsed_s) :
      (d.eta_s === null && d.hosts_live ? "estimating" : duration(d.eta_s)),
      finished ? d.elapsed_s : d.eta_s);
  set("hosts-live", int(d.hosts_live), d.hosts_live);
  set("hosts-total", int(d.hosts.length), d.hosts.length);
  set("hosts-done", int(d.hosts.filter((h) => h.state === "done").length));
  set("hosts-total-done", int(d.hosts.length));
  $("card-hosts-live").hidden = finished; $("card-hosts-done").hidden = !finished;
  drawMap(d.map);
  const legend = [];
  for (const k of ["C", "W", "S", "F", "."]) {
    const n = [...d.map].filter((c) => c === k).length;
    if (k === "F" && !n) continue;
    legend.push(`<span><i class="sw" style="background:rgb(${COLORS[k]})"></i>` +
                `${NAMES[k]} ${int(n)}</span>`);
  }
  $("legend").innerHTML = legend.join("");
  const t0 = d.series_tokens.length ? d.series_tokens[0][0] : 0;
  drawLine("chart-tokens", d.series_tokens, "tokens", t0);
  drawLine("chart-rate", d.series_tokens_per_s, "tokens/s", t0);
  const maxRate = Math.max(1, ...d.hosts.map((h) => h.tokens_per_s));
  const order = [...d.hosts].sort((a, b) => (b.dead - a.dead) || (b.slow - a.slow) ||
                                           a.host.localeCompare(b.host));
  $("hosts").innerHTML = order.map((h) => `<tr data-host="${esc(h.host)}" data-live="${h.live}"
      class="${h.dead ? "dead" : (h.slow ? "slow" : "")}"><td>${esc(h.host)}</td>
      <td class="state">${esc(h.starting ? "starting" : h.state)}</td>
      <td class="num">${duration(h.age_s)} ago</td>
      <td>${h.partition || "-"}</td><td class="num">${h.steps ? h.step + "/" + h.steps : h.step}</td>
      <td class="num rate">${dec1(h.tokens_per_s)}</td>
      <td><span class="bar" style="width:${Math.round(120 * h.tokens_per_s / maxRate)}px">
      </span></td>
      <td class="num">${int(h.tokens_done)}</td><td class="num">${h.partitions_done}</td>
      <td class="msg">${esc(h.message)}${h.slow ? " (slow: under half the median)" : ""}${
        h.did ? `<div class="did">${esc(h.did)}</div>` : ""}</td>
      </tr>`).join("") || `<tr><td colspan="10">no worker has reported yet</td></tr>`;
  const rj = [];
  for (const [src, r] of Object.entries(d.rejects)) {
    rj.push(`<tr data-source="${esc(src)}"><td>${esc(src)}</td>
      <td class="num">${int(r.rejected)}</td><td class="num">${int(r.read)}</td></tr>`);
  }
  $("rejects").innerHTML = rj.join("") || "<tr><td>no sources</td></tr>";
  $("reject-groups").innerHTML = d.reject_groups.map((g) => {
    const s = g.sample || {};
    return `<tr data-reject="${esc(g.source + "|" + g.reason)}"><td>${esc(g.source)}</td>
      <td>${esc(g.reason)}</td><td class="num">${int(g.count)}</td>
      <td>${esc(s.file || "")}:${s.line ?? ""} ${esc(s.reason || "")}
      ${s.snippet ? "<code>" + esc(String(s.snippet).slice(0, 120)) + "</code>" : ""}</td></tr>`;
  }).join("") || `<tr><td colspan="4">no input was rejected</td></tr>`;
  $("reject-note").textContent = d.reject_groups_complete ? "" :
    "(counted from the first 32 MB of rejects/)";
  const m = d.token_masks;
  const mk = [];
  if (m) {
    const share = (n) => m.positions ? (100 * n / m.positions).toFixed(2) + "%" : "-";
    for (const [name, n] of Object.entries(m.removed)) {
      mk.push(`<tr data-mask="${esc(name)}"><td>${esc(name)}</td><td class="num">${int(n)}</td>
        <td class="num">${share(n)}</td></tr>`);
    }
    for (const [hook, n] of Object.entries(m.outlier)) {
      mk.push(`<tr data-mask="outlier:${esc(hook)}"><td>outlier (${esc(hook)}, norm &gt;
        ${m.outlier_factor} x median)</td><td class="num">${int(n)}</td>
        <td class="num">${share(n)}</td></tr>`);
    }
  }
  $("masks").innerHTML = mk.join("") ||
    "<tr><td>not counted yet: actx.open_run(run).compute_stats(hooks) counts them</td></tr>";
  $("masks-positions").textContent = m ? `of ${int(m.positions)} token positions in ` +
    `${m.partitions.length} partitions` : "";
  $("commands").innerHTML = Object.entries(d.commands)
    .map(([k, c]) => `<div data-command="${esc(k)}"><code>${esc(c)}</code></div>`).join("");
  document.body.dataset.rendered = Number(document.body.dataset.rendered || 0) + 1;
}
function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                  '"': "&quot;", "'": "&#39;"}[c]));
}
const DATA = JSON.parse($("actx-data").textContent);
render(DATA);
if (LIVE_S > 0) {
  $("live").textContent = `live: refreshes every ${LIVE_S}s`;
  const poll = () => fetch("data.json", {cache: "no-store"}).then((r) => r.json()).then((d) => {
    render(d); document.body.dataset.polls = Number(document.body.dataset.polls || 0) + 1;
  }).catch((e) => { $("live").textContent = "live: last refresh failed (" + e + ")"; });
  poll(); setInterval(poll, LIVE_S * 1000);
} else {
  $("live").textContent = "snapshot (written by actx status --html)";
}
"""
