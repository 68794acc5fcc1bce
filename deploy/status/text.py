"""`actx status` in words: the report, the one-line progress of submit's live display, and
the text and JSON of one or several extractions, all from a `runstate.RunStatus`."""

from __future__ import annotations

import math
import time

from actx.deploy.status import json_text as status_json
from actx.deploy.status import run_facts
from actx.deploy.status.partition_states import COMMITTED, IN_PROGRESS, PENDING, STALE
from actx.deploy.status.runstate import HostState, RunStatus, map_chars
from actx.schemas import advice
from actx.schemas import layout as layout_lib
from actx.schemas import token_masks as token_masks_lib


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
    # Halves up, as the page's Math.round: Python's round(2.5) is 2, and elapsed times
    # are recorded to 0.1 s, so one in ten would read a second apart on the two.
    s = math.floor(s + 0.5)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def _eta(status: RunStatus) -> str:
    return _duration(status.eta_s) if status.eta_s is not None else status.eta_word


def one_line(status: RunStatus, width: int | None = None) -> str:
    """A progress line for submit's live display: while no worker has processed a token,
    what each one is doing (loading weights, compiling) instead of a rate of 0.

    `width`: at most this many characters (a terminal's columns): the parts that matter
    most are kept (committed, tokens, ETA, rate, elapsed, then the other counts and the
    context), in their usual order, and the line is cut only if those alone are longer."""
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
    # (priority: lower is kept first, separator before it, text), in display order.
    parts = [
        (5, ", ", f"{c[IN_PROGRESS]} in progress, {c[STALE]} stale, {c[PENDING]} pending"),
        (0, " | ", f"{pct:5.1f}% tokens"),
        (2, " | ", rate),
        (3, " | ", f"elapsed {_duration(status.elapsed_s)}"),
        (1, " | ", f"ETA {_eta(status)}"),
        (6, " | ", _whole_documents(status) if status.tokens_done else ""),
    ]
    head = f"[{status.name}] {c[COMMITTED]}/{len(status.partitions)} committed"
    kept = {i for i, (_, _, text) in enumerate(parts) if text}
    if width is not None:
        chosen: set[int] = set()
        for i in sorted(kept, key=lambda i: parts[i][0]):
            if len(_join(head, parts, chosen | {i})) <= width:
                chosen.add(i)
        kept = chosen
    return fit(_join(head, parts, kept), width)


def _join(head: str, parts, kept: set[int]) -> str:
    return head + "".join(sep + text for i, (_, sep, text) in enumerate(parts) if i in kept)


def fit(line: str, width: int | None) -> str:
    """`line` cut to `width` characters (None: as it is), an ellipsis saying it was."""
    if width is None or len(line) <= width:
        return line
    return line[:max(0, width - 1)] + "…"


def lines_per_extraction(statuses: dict[str, RunStatus], width: int | None = None) -> str:
    """`one_line` of each extraction ({name: status}; "" the default one), named where a
    run has named ones, on one line (of at most `width` characters: each extraction gets
    its share)."""
    share = None if width is None else max(20, (width - 3 * (len(statuses) - 1))
                                           // max(1, len(statuses)))
    line = " | ".join(fit((f"{name}: " if name else "") + one_line(
        status, None if share is None else share - (len(name) + 2 if name else 0)), share)
        for name, status in statuses.items())
    return fit(line, width)


def _average(status: RunStatus) -> str:
    avg = status.average_tokens_per_s
    return "unknown" if avg is None else f"{avg:,.0f}"


def _whole_documents(status: RunStatus) -> str:
    share = 100.0 * status.full_context_tokens_done / max(1, status.tokens_done)
    return (f"{status.full_context_tokens_done:,} of {status.tokens_done:,} stored tokens "
            f"({share:.1f}%) saw their whole document")


def _context_causes(ident: dict) -> str:
    """What kept the other stored tokens from their whole document, for this run's packing:
    a sliding window past max_context where documents carry their context across rows,
    the start of a concat row where they do not."""
    causes = []
    if ident.get("max_context"):
        causes.append("past packing.max_context")
    if ident.get("packing") == "concat":
        causes.append("documents continued from an earlier concat row")
    if not causes:
        return ""
    return f" (the rest: {', or '.join(causes)}; tokens/context_start says which)"


def host_did(h: HostState) -> str:
    """What a host did: tokens, partitions committed, partitions taken from other
    replicas' lists or given up to them, and why it idles when it says. A replica's rank
    other than 0 stores the rows of its own shards and commits nothing (its rank 0
    commits the replica's partitions), which its line says rather than "0 committed"."""
    if h.rank:
        parts = [f"{h.tokens_done:,} tokens in its shards (rank {h.rank} of its replica; "
                 f"rank 0 commits the replica's partitions)"]
    else:
        parts = [f"{h.tokens_done:,} tokens", f"{h.partitions_done} partition(s) committed"]
    if not h.live and h.state != "done":
        # A process killed between a commit and its next beat: its last beat lags the
        # markers (the totals above count the markers).
        parts[0] = f"by its last heartbeat, {parts[0]}"
    if h.stolen_from:
        parts.append(f"took {sum(h.stolen_from.values())} from other replicas' lists "
                     f"({_per_replica(h.stolen_from)})")
    if h.given_up:
        parts.append(f"{sum(h.given_up.values())} of its own taken by others first "
                     f"({_per_replica(h.given_up)})")
    if h.idle_reason:
        parts.append(f"idle: {h.idle_reason}")
    return "; ".join(parts)


def _per_replica(counts: dict) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))


def _settings(ident: dict) -> str:
    if not ident:
        return "?"
    hooks = (", ".join(ident["hooks"]) if ident.get("hooks")
             else f"{ident['hooks_requested']} (resolved when a worker starts)")
    context = f", max_context {ident['max_context']:,}" if ident.get("max_context") else ""
    generates = f"; {generates_words(ident['generate'])}" if ident.get("generate") else ""
    return (f"model {ident['model']}; hooks {hooks} stored as {ident['dtype']}{generates}; "
            f"seq_len {ident['seq_len']:,}, {ident['packing']} packing{context}; "
            f"activations in {ident['activations']}")


def generates_words(gen: dict) -> str:
    """A generating run's `generate` settings (identity's "generate"), as status and the
    page say them."""
    how = "greedy" if gen["temperature"] == 0 else f"temperature {gen['temperature']:g}"
    if gen["temperature"] and gen["top_k"]:
        how += f", top_k {gen['top_k']}"
    if gen["temperature"] and gen["top_p"] < 1:
        how += f", top_p {gen['top_p']:g}"
    return (f"generates up to {gen['max_new_tokens']:,} new tokens per sample ({how}), "
            f"{gen['samples_per_prompt']:,} sample(s) per prompt")


def generated_words(g: dict) -> str:
    """What a generating run's committed partitions generated (identity's "generation")."""
    if not g["partitions"] and not g["unreadable"]:
        return "nothing yet: no partition is committed"
    reasons = ", ".join(f"{reason} {n:,}" for reason, n in g["stop_reasons"].items())
    text = (f"{g['samples']:,} sample(s) of {g['prompts']:,} prompt(s), "
            f"{g['generated_tokens']:,} generated tokens; stopped by: {reasons} (records of "
            f"{g['partitions']:,} committed partition(s))")
    if g["unreadable"]:
        names = ", ".join(layout_lib.partition_name(p) for p in g["unreadable"][:5])
        text += (f"; {len(g['unreadable']):,} committed partition(s) without a readable "
                 f"generated/ record, not counted: {names}")
    return text


def _verify_line(status: RunStatus) -> str:
    v = status.verification
    if v is None:
        return f"not run yet: `{advice.verify(status.run)}` re-reads the data against its markers"
    if v.get("damaged"):
        return f"unknown: {v['damaged']}"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(v["at"]))
    if v["ok"]:
        return f"passed at {when} ({v['checked']} partition(s) checked)"
    if not v["failed"] and not v.get("repaired"):  # a problem of no one partition
        return (f"FAILED at {when}: no partition failed its check (the token store damaged, "
                f"an array the store would not open, a run that holds no data): "
                f"`{advice.verify(status.run)}` names it and checks the run again")
    if not v["failed"]:  # what failed was repaired: pending, or extracted again since
        return (f"FAILED at {when}; its {v.get('repaired', 0)} failed partition(s) were "
                f"repaired (`{advice.rerun(status.run)}` extracts them), not verified since: "
                f"`{advice.verify(status.run)}` checks them")
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
        f"phase:      {status.phase}: "
        f"{status.problem or run_facts.phase_note(status.phase, status.run)}"
        # Committed, but not as their markers say: the phase alone would read as done.
        + (f"; but {len(status.failed_verification)} of them failed the latest `actx "
           f"verify` (below)" if status.failed_verification else ""),
        *(f"history:    {line}" for line in status.history),
        f"settings:   {_settings(status.identity)}",
        f"partitions: {n} total | {c[COMMITTED]} committed | {c[IN_PROGRESS]} in progress | "
        f"{c[STALE]} stale | {c[PENDING]} pending",
        f"tokens:     {status.tokens_done:,} / {status.tokens_total:,} "
        f"({100.0 * status.tokens_done / max(1, status.tokens_total):.1f}%)",
        *([f"context:    {_whole_documents(status)}"
           + (_context_causes(status.identity)
              if status.full_context_tokens_done < status.tokens_done else "")]
          if status.tokens_done else []),
        *([f"generated:  {generated_words(status.identity['generation'])}"]
          if status.identity.get("generation") else []),
        f"bytes:      {_size(status.bytes_done)} / {_size(status.bytes_total)}{bytes_note}",
        *([f"rejects:    {status.rejects['summary']}; each with its reason in "
           f"{status.rejects['path']}"] if status.rejects else []),
        (("throughput: finished; no heartbeat to time it" if status.elapsed_s is None else
          f"throughput: finished; average {_average(status)} tokens/s over "
          f"{_duration(status.elapsed_s)}") if status.complete else
         f"throughput: {status.current_tokens_per_s:,.0f} tokens/s now (live workers); average "
         f"{_average(status)} tokens/s; elapsed {_duration(status.elapsed_s)}   "
         f"ETA: {_eta(status)}" + ("" if status.eta_s is not None else
                                   " (no live worker)" if status.eta_word == "unknown" else
                                   " (no steady-state rate yet: loading, compiling)")),
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
            lines.append(f"  {'':<28} did: {host_did(h)}")
    elif not status.unreadable_heartbeats:
        lines.append("hosts: none has reported yet")
    else:
        lines.append("hosts:")
    for damaged in status.unreadable_heartbeats:
        lines.append(f"  host unknown: its heartbeat cannot be read: {damaged}")
    lines.append(f"verify:     {_verify_line(status)}")
    if status.reference is not None:
        lines.append(f"verify:     {status.reference['summary']}")
    if status.failed_verification:
        names = ", ".join(layout_lib.partition_name(p) for p in status.failed_verification[:20])
        lines.append(f"verify:     {len(status.failed_verification)} committed partition(s) "
                     f"failed the latest `actx verify`: {names}; `{advice.verify(status.run)}` "
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
    if list(statuses) == [""]:
        status = statuses[""]
        return status_json.dumps(status.json_fields()) if as_json else render(status)
    if as_json:
        return status_json.dumps({"extractions": {name or "default": s.json_fields()
                                                  for name, s in statuses.items()},
                                  "complete": all(s.complete for s in statuses.values())})
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
