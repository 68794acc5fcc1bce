"""What a run directory says about its progress: `actx status`, and what rerun selects.

Reads only small objects (run.json, manifest.json, the commits/ listing, heartbeats,
activations/actx.json), never activation data, and imports neither jax nor Beam.
Partition states: committed (a marker exists: the only thing that counts as done),
in progress (a live worker holds it), stale (its worker stopped beating, failed or was
preempted) and pending (nobody holds it).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time

from actx.deploy import run_facts
from actx.schemas import activations_info as info_lib
from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import run_dir
from actx.schemas import config as schemas_config
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import layout as layout_lib
from actx.schemas import token_masks as token_masks_lib
from actx.schemas import verification as verification_lib

DEFAULT_STALE_AFTER_S = 60.0
COMMITTED, IN_PROGRESS, STALE, PENDING = "committed", "in_progress", "stale", "pending"
MAP_CHARS = {COMMITTED: "C", IN_PROGRESS: "W", STALE: "S", PENDING: "."}
FAILED_CHAR = "F"  # committed, but its data failed the latest `actx verify`
LIVE_STATES = ("starting", "working", "idle")  # a heartbeat in these states claims a live worker


# A run is opened one way for every stage (schemas.run_dir); these names are where deploy's
# callers have always found it.
RunError = errors.NotARunError
RunHandle = run_dir.OpenedRun
open_run = run_dir.open_run


@dataclasses.dataclass(frozen=True)
class HostState:
    host: str
    state: str
    live: bool
    age_s: float
    partition: int | None
    step: int
    steps: int
    tokens_per_s: float
    tokens_done: int
    message: str
    partitions_done: int = 0
    # (unix time, tokens done) samples of this attempt, oldest first (see schemas.heartbeat).
    history: tuple[tuple[float, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """A snapshot of a run's progress (what `actx status --json` prints)."""

    run: str
    name: str
    fingerprint: str
    partitions: dict[int, str]
    counts: dict[str, int]
    tokens_done: int
    tokens_total: int
    bytes_done: int | None
    bytes_total: int | None
    tokens_per_s: float
    eta_s: float | None
    hosts: tuple[HostState, ...]
    stale_after_s: float
    at: float
    # Committed partitions whose data failed the latest `actx verify` (verify/latest.json).
    failed_verification: tuple[int, ...] = ()
    # Stored tokens of committed partitions that attended to their whole document up to
    # themselves (manifest full_context_tokens, from tokens/context_start).
    full_context_tokens_done: int = 0
    # Seconds from the first reporting worker's start to now (while one is live) or to the
    # last heartbeat; tokens those workers processed per second of it; and the live
    # workers' rate over their latest heartbeat interval. None: no worker has reported.
    elapsed_s: float | None = None
    average_tokens_per_s: float | None = None
    current_tokens_per_s: float = 0.0
    # What the reader's token masks leave out (stats.json, written by compute_stats); None
    # before it ran.
    token_masks: token_masks_lib.MaskCounts | None = None
    # The run's settings, the latest `actx verify` and one phase word (deploy.run_facts).
    identity: dict = dataclasses.field(default_factory=dict)
    verification: dict | None = None
    phase: str = ""

    @property
    def complete(self) -> bool:
        # A run without partitions (its prepare accepted no document) holds nothing.
        return bool(self.partitions) and self.counts[COMMITTED] == len(self.partitions)

    def ids(self, state: str) -> list[int]:
        return [p for p, s in sorted(self.partitions.items()) if s == state]

    def to_json_obj(self) -> dict:
        # Not dataclasses.asdict: it deep-copies 150k partition entries one by one.
        obj = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        # A host's history is for the page (`--serve`, `--html`); here it would be 90% of it.
        obj["hosts"] = [{f.name: getattr(h, f.name) for f in dataclasses.fields(h)
                         if f.name != "history"} for h in self.hosts]
        obj["counts"] = dict(self.counts)
        name = layout_lib.partition_name
        obj["partitions"] = {name(p): s for p, s in sorted(self.partitions.items())}
        obj["failed_verification"] = [name(p) for p in self.failed_verification]
        obj["complete"] = self.complete
        obj["eta"] = "unknown" if self.eta_s is None else round(self.eta_s, 1)
        obj["map"] = partition_map(self)
        obj["token_masks"] = (None if self.token_masks is None
                              else schemas_config.to_dict(self.token_masks))
        return obj


def _read_info_for_status(store) -> info_lib.ActivationsInfo | None:
    """activations/actx.json, or None when absent or damaged: status only derives byte
    rates from it, and `actx verify` reports the damage."""
    try:
        return info_lib.read_info(store)
    except schemas_config.ConfigError:
        return None


def bytes_per_row(handle: RunHandle) -> int | None:
    """Stored activation bytes per row (all hooks), from activations/actx.json."""
    info = _read_info_for_status(handle.store)
    return info.bytes_per_row(handle.manifest.seq_len) if info else None


def _read_progress(handle: RunHandle, history: bool):
    """Commit ids, heartbeats, activations/actx.json and the verification record, read
    concurrently (each is one or more round trips on GCS)."""
    store = handle.store
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        committed = pool.submit(commit_lib.committed_partitions, store,
                                len(handle.manifest.partitions))
        beats = pool.submit(heartbeat_lib.read_heartbeats, store, history=history)
        info = pool.submit(_read_info_for_status, store)
        verified = pool.submit(verification_lib.read_record, store)
        masks = pool.submit(_read_masks_for_status, store)
        return (committed.result(), beats.result(), info.result(), verified.result(),
                masks.result())


def _read_masks_for_status(store) -> token_masks_lib.MaskCounts | None:
    """stats.json's mask counts, or None when absent or damaged (the reader says which)."""
    try:
        return token_masks_lib.read_mask_counts(store)
    except schemas_config.ConfigError:
        return None


def last_log_line(text: str, max_chars: int = 300) -> str:
    """The last line a worker wrote to its log (not actx's own "[actx: ...]" notes)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and not line.startswith("[actx:"):
            return line if len(line) <= max_chars else line[:max_chars] + " ..."
    return ""


def _stale_message(store, hb: heartbeat_lib.Heartbeat) -> str:
    """A host that stopped beating without saying why (a preempted or lost TPU VM dies
    with its worker): that it stopped (its age is the host's `age_s`; kept out of the
    message, which stays the same from one status to the next) and the last line of the
    log its host copied into the run (deploy.host_run), which is often the reason."""
    said = "stopped beating (preempted, or its host is gone)"
    key = layout_lib.log_key(hb.job, hb.host)
    line = ""
    if hb.job:
        try:
            size = store.size(key)
            if size:
                line = last_log_line(store.read_range(key, max(0, size - 8192), size)
                                     .decode("utf-8", "replace"))
        except (OSError, ValueError, errors.UserError):
            line = ""  # an unreadable log says nothing more; status itself goes on
    return "; ".join(part for part in (
        hb.message, said, f"its log ({key}) ends: {line}" if line else "") if part)


def _silent_messages(store, beats: list[heartbeat_lib.Heartbeat]) -> dict[str, str]:
    """{host: `_stale_message`} of the hosts that stopped beating, their logs read at once
    (two round trips each on GCS: a preempted slice leaves every host silent)."""
    if not beats:
        return {}
    with concurrent.futures.ThreadPoolExecutor(min(16, len(beats))) as pool:
        return dict(zip((hb.host for hb in beats),
                        pool.map(lambda hb: _stale_message(store, hb), beats)))


def compute_status(handle: RunHandle, stale_after_s: float = DEFAULT_STALE_AFTER_S,
                   now: float | None = None, history: bool = False) -> RunStatus:
    """`history`: also the hosts' (time, tokens) samples (the page draws them); without
    it, heartbeats on GCS come from one listing of their summaries."""
    committed, beats, info, verified, masks = _read_progress(handle, history)
    now = time.time() if now is None else now
    hosts = []
    held_live: set[int] = set()
    held_dead: set[int] = set()
    silent = _silent_messages(handle.store, [
        hb for hb in beats if hb.state in LIVE_STATES and now - hb.updated_at > stale_after_s
        and not heartbeat_lib.process_gone(hb)])
    for hb in sorted(beats, key=lambda b: b.host):
        age = max(0.0, now - hb.updated_at)
        gone = hb.state in LIVE_STATES and heartbeat_lib.process_gone(hb)
        live = hb.state in LIVE_STATES and age <= stale_after_s and not gone
        shown = (hb.state if live or hb.state not in LIVE_STATES
                 else f"{hb.state} (process gone)" if gone else f"{hb.state} (stale)")
        hosts.append(HostState(hb.host, shown, live, round(age, 1), hb.partition,
                               hb.step, hb.steps, hb.tokens_per_s if live else 0.0,
                               hb.tokens_done, silent.get(hb.host, hb.message),
                               hb.partitions_done, hb.history))
        if hb.state not in ("done",):
            held = set(hb.held) | ({hb.partition} if hb.partition is not None else set())
            (held_live if live else held_dead).update(held)
    parts = handle.manifest.partitions
    states = dict.fromkeys((p.id for p in parts), PENDING)
    for ids, state in ((held_dead, STALE), (held_live, IN_PROGRESS), (committed, COMMITTED)):
        for pid in ids:  # later states win: committed over a live worker over a dead one
            if pid in states:
                states[pid] = state
    tally = collections.Counter(states.values())
    counts = {s: tally[s] for s in MAP_CHARS}
    done = [p for p in parts if p.id in committed]
    tokens_done = sum(p.tokens for p in done)
    per_row = info.bytes_per_row(handle.manifest.seq_len) if info else None
    rows_done = sum(p.row_count for p in done)
    throughput = sum(h.tokens_per_s for h in hosts if h.live)
    remaining = handle.manifest.total_tokens - tokens_done
    if remaining <= 0:
        eta = 0.0
    elif throughput > 0:
        eta = remaining / throughput
    else:
        eta = None  # no live worker: any number would be a guess
    elapsed, average, current = _timing(beats, hosts, now)
    return RunStatus(
        elapsed_s=elapsed, average_tokens_per_s=average, current_tokens_per_s=current,
        run=str(handle.location), name=handle.spec.name, fingerprint=handle.spec.fingerprint,
        partitions=states, counts=counts, tokens_done=tokens_done,
        tokens_total=handle.manifest.total_tokens,
        bytes_done=None if per_row is None else per_row * rows_done,
        bytes_total=None if per_row is None else per_row * handle.manifest.total_rows,
        full_context_tokens_done=sum(p.full_context_tokens for p in done),
        tokens_per_s=round(throughput, 1), eta_s=eta, hosts=tuple(hosts),
        failed_verification=tuple(p for p in verified.failed if p in committed)
        if verified else (),
        stale_after_s=stale_after_s, at=now, token_masks=masks,
        identity=run_facts.identity(handle, info),
        verification=run_facts.verification(verified, set(committed)),
        phase=run_facts.phase(bool(parts) and counts[COMMITTED] == len(parts), hosts))


def _timing(beats, hosts: list[HostState], now: float
            ) -> tuple[float | None, float | None, float]:
    """(elapsed s, average tokens/s, current tokens/s) from the heartbeats present.

    A host started at its first history sample; where a listing gave no history (GCS
    summaries), at its last beat less its tokens at its average rate.
    """
    if not beats:
        return None, None, 0.0
    starts = []
    for hb in beats:
        if hb.history:
            starts.append(hb.history[0][0])
        elif hb.tokens_per_s > 0:
            starts.append(hb.updated_at - hb.tokens_done / hb.tokens_per_s)
        else:
            starts.append(hb.updated_at)
    live = any(h.live for h in hosts)
    end = now if live else max(hb.updated_at for hb in beats)
    elapsed = max(0.0, end - min(starts))
    average = sum(hb.tokens_done for hb in beats) / elapsed if elapsed > 0 else None
    current = 0.0
    for h in hosts:
        if not h.live:
            continue
        if len(h.history) >= 2 and h.history[-1][0] > h.history[-2][0]:
            (t0, n0), (t1, n1) = h.history[-2], h.history[-1]
            current += (n1 - n0) / (t1 - t0)
        else:
            current += h.tokens_per_s
    return round(elapsed, 1), None if average is None else round(average, 1), round(current, 1)


def map_chars(status: RunStatus) -> str:
    """One character per partition, in id order: MAP_CHARS, and F for a committed
    partition that failed the latest verify."""
    chars = [MAP_CHARS[s] for _, s in sorted(status.partitions.items())]
    for pid in status.failed_verification:
        chars[pid] = FAILED_CHAR
    return "".join(chars)


def partition_map(status: RunStatus, width: int = 64) -> list[str]:
    chars = map_chars(status)
    return [chars[i:i + width] for i in range(0, len(chars), width)] or [""]


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def one_line(status: RunStatus) -> str:
    """A progress line for submit's live display: while no worker has processed a token,
    what each one is doing (loading weights, compiling) instead of a rate of 0."""
    c = status.counts
    pct = 100.0 * status.tokens_done / max(1, status.tokens_total)
    if status.phase == run_facts.STARTING:
        doing = "; ".join(f"{h.host} {h.message or h.state}" for h in status.hosts if h.live)
        rate = f"starting: {doing}"
    elif status.phase == run_facts.NOT_STARTED:
        rate = "starting: waiting for the workers' first heartbeat"
    elif status.complete:
        rate = f"finished, {_average(status)} tok/s avg"
    else:
        rate = (f"{status.current_tokens_per_s:,.0f} tok/s now, {_average(status)} avg")
    context = f" | {_whole_documents(status)}" if status.tokens_done else ""
    return (f"[{status.name}] {c[COMMITTED]}/{len(status.partitions)} committed, "
            f"{c[IN_PROGRESS]} in progress, {c[STALE]} stale, {c[PENDING]} pending | "
            f"{pct:5.1f}% tokens | {rate} | elapsed {_duration(status.elapsed_s)} | "
            f"ETA {_duration(status.eta_s)}{context}")


def lines_per_extraction(statuses: dict[str, RunStatus]) -> str:
    """`one_line` of each extraction ({name: status}; "" the default one), named where a
    run has named ones, on one line."""
    return " | ".join((f"{name}: " if name else "") + one_line(status)
                      for name, status in statuses.items())


def _average(status: RunStatus) -> str:
    avg = status.average_tokens_per_s
    return "unknown" if avg is None else f"{avg:,.0f}"


def _whole_documents(status: RunStatus) -> str:
    share = 100.0 * status.full_context_tokens_done / max(1, status.tokens_done)
    return (f"{status.full_context_tokens_done:,} of {status.tokens_done:,} stored tokens "
            f"({share:.1f}%) saw their whole document")


def _settings(ident: dict) -> str:
    if not ident:
        return "?"
    hooks = (", ".join(ident["hooks"]) if ident.get("hooks")
             else f"{ident['hooks_requested']} (resolved when a worker starts)")
    context = f", max_context {ident['max_context']:,}" if ident.get("max_context") else ""
    return (f"model {ident['model']}; hooks {hooks} stored as {ident['dtype']}; seq_len "
            f"{ident['seq_len']:,}, {ident['packing']} packing{context}; activations in "
            f"{ident['activations']}")


def _verify_line(status: RunStatus) -> str:
    v = status.verification
    if v is None:
        return f"not run yet: `actx verify {status.run}` re-reads the data against its markers"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(v["at"]))
    if v["ok"]:
        return f"passed at {when} ({v['checked']} partition(s) checked)"
    return f"FAILED at {when}: {v['failed']} committed partition(s) did not match their marker"


def _masks_line(m: token_masks_lib.MaskCounts) -> str:
    """What each token mask leaves out, of the positions compute_stats counted."""
    parts = [f"{name} {n:,}" for name, n in m.removed.items()]
    parts += [f"outlier in {hook} {n:,}" for hook, n in sorted(m.outlier.items())]
    return (f"{', '.join(parts)} of {m.positions:,} token positions "
            f"({len(m.partitions)} partitions counted by compute_stats; "
            f"outlier: norm > {m.outlier_factor:g} x the hook's median)")


def render(status: RunStatus) -> str:
    c = status.counts
    n = len(status.partitions)
    bytes_note = "" if status.bytes_total is not None else " (sizes known once a worker starts)"
    lines = [
        f"run {status.run}  (name {status.name}, fingerprint {status.fingerprint})",
        f"phase:      {status.phase}: {run_facts.PHASE_NOTES[status.phase]}",
        f"settings:   {_settings(status.identity)}",
        f"partitions: {n} total | {c[COMMITTED]} committed | {c[IN_PROGRESS]} in progress | "
        f"{c[STALE]} stale | {c[PENDING]} pending",
        f"tokens:     {status.tokens_done:,} / {status.tokens_total:,} "
        f"({100.0 * status.tokens_done / max(1, status.tokens_total):.1f}%)",
        *([f"context:    {_whole_documents(status)} (the rest: past packing.max_context, or "
           f"documents continued from an earlier concat row; tokens/context_start says "
           f"which)"] if status.tokens_done else []),
        f"bytes:      {_size(status.bytes_done)} / {_size(status.bytes_total)}{bytes_note}",
        (("throughput: finished; no heartbeat to time it" if status.elapsed_s is None else
          f"throughput: finished; average {_average(status)} tokens/s over "
          f"{_duration(status.elapsed_s)}") if status.complete else
         f"throughput: {status.current_tokens_per_s:,.0f} tokens/s now (live workers); average "
         f"{_average(status)} tokens/s; elapsed {_duration(status.elapsed_s)}   "
         f"ETA: {_duration(status.eta_s)}" + ("" if status.eta_s is not None
                                              else " (no live worker)")),
    ]
    if status.token_masks is not None:
        lines.append(f"masks:      {_masks_line(status.token_masks)}")
    if status.hosts:
        lines.append(f"hosts (stale after {status.stale_after_s:g}s without a heartbeat):")
        for h in status.hosts:
            # steps is 0 for a worker streaming partitions (no per-partition step count).
            step = f"step {h.step}/{h.steps}" if h.steps else f"step {h.step}"
            where = (f"partition {layout_lib.partition_name(h.partition)} {step}"
                     if h.partition is not None else "-")
            msg = f"  {h.message}" if h.message else ""
            lines.append(f"  {h.host:<28} {h.state:<16} {where:<30} "
                         f"{h.tokens_per_s:>10,.0f} tok/s  last beat {_duration(h.age_s)} ago{msg}")
    else:
        lines.append("hosts: none has reported yet")
    lines.append(f"verify:     {_verify_line(status)}")
    if status.failed_verification:
        names = ", ".join(layout_lib.partition_name(p) for p in status.failed_verification[:20])
        lines.append(f"verify:     {len(status.failed_verification)} committed partition(s) "
                     f"failed the latest `actx verify`: {names}; `actx verify {status.run}` "
                     f"says why")
    chars = map_chars(status)
    per_char = max(1, -(-len(chars) // TEXT_MAP_CHARS))
    if per_char > 1:  # 150k partitions would be 2,344 lines: each character covers several
        chars = "".join(_worst(chars[i:i + per_char]) for i in range(0, len(chars), per_char))
    lines.append("map (C committed, W in progress, S stale, . pending"
                 + (", F failed verification" if status.failed_verification else "")
                 + (f"; one character per {per_char} partitions, the most urgent state "
                    f"among them; `--serve` draws every partition" if per_char > 1 else "")
                 + "):")
    for i in range(0, len(chars), 64):
        lines.append(f"  {i * per_char:>6}  {chars[i:i + 64]}")
    return "\n".join(lines)


TEXT_MAP_CHARS = 64 * 64  # the text map's size at most (64 lines)
_URGENCY = "FSW.C"  # what a character covering several partitions shows first


def _worst(chars: str) -> str:
    return next(c for c in _URGENCY if c in chars)


def render_extractions(statuses: dict[str, RunStatus], as_json: bool = False) -> str:
    """`actx status` of one or several extractions (schemas.extraction): a run with only
    its default extraction prints as it always has; otherwise one line per extraction,
    then each one's full status (with its map) under its name. JSON: an
    "extractions" object keyed by name ("default" for the root one)."""
    import json

    if list(statuses) == [""]:
        status = statuses[""]
        return (json.dumps(status.to_json_obj(), indent=1, sort_keys=True) if as_json
                else render(status))
    if as_json:
        return json.dumps({"extractions": {name or "default": s.to_json_obj()
                                           for name, s in statuses.items()},
                           "complete": all(s.complete for s in statuses.values())},
                          indent=1, sort_keys=True)
    width = max(len(name or "default") for name in statuses)
    lines = [f"{len(statuses)} extractions over one token store:"]
    for name, s in statuses.items():
        c = s.counts
        lines.append(f"  {name or 'default':<{width}}  {c[COMMITTED]}/{len(s.partitions)} "
                     f"committed, {c[IN_PROGRESS]} in progress, {c[STALE]} stale, "
                     f"{c[PENDING]} pending, fingerprint {s.fingerprint}")
    for name, s in statuses.items():
        lines += ["", f"== extraction {name or 'default'} ==", render(s)]
    return "\n".join(lines)
