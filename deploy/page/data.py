"""What the live page shows, as one JSON-able dict built from a `RunStatus`.

Everything comes from what status reads (manifest, marker names, heartbeats with their
history) plus, once per page, the first lines of each rejects/ file as samples. The
partition map travels as one character per partition, so 150k partitions cost 150 KB.
"""

from __future__ import annotations

import json

from actx.deploy.status import partition_states
from actx.deploy.status import run_facts
from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.schemas import advice
from actx.schemas import config as config_lib
from actx.schemas import layout as layout_lib

# Points of the job's tokens-over-time series (host histories resampled onto one grid).
SERIES_POINTS = 120
REJECT_SAMPLES = 5
# The page counts reject reasons from at most this much of rejects/ (read once per page).
REJECT_BYTES = 32 << 20


def job_series(hosts, points: int = SERIES_POINTS) -> list[tuple[float, int]]:
    """(unix time, tokens done by all hosts) on `points` evenly spaced times.

    Each host's cumulative tokens are interpolated linearly between its samples (steps
    would alias against the grid); before its first sample a host counts 0, after its last
    it keeps its last value (a dead host's work stays done).
    """
    samples = [h.history for h in hosts if h.history]
    if not samples:
        return []
    t0 = min(s[0][0] for s in samples)
    t1 = max(s[-1][0] for s in samples)
    if t1 <= t0:
        return [(t1, sum(s[-1][1] for s in samples))]
    grid = [t0 + (t1 - t0) * i / (points - 1) for i in range(points)]
    total = [0] * points
    for hist in samples:
        j = 0
        for i, t in enumerate(grid):
            while j < len(hist) and hist[j][0] <= t:
                j += 1
            if j == 0:
                continue  # before the host's first sample
            if j == len(hist):
                total[i] += hist[-1][1]
                continue
            (ta, va), (tb, vb) = hist[j - 1], hist[j]
            total[i] += int(va + (vb - va) * (t - ta) / (tb - ta))
    return [(round(t, 1), v) for t, v in zip(grid, total)]


def throughput_series(series: list[tuple[float, int]],
                      window: int = 6) -> list[tuple[float, float]]:
    """Tokens per second over `window` points of `series` ending at each point: hosts
    report in bursts (a step's tokens at once), so a one-point rate would saw-tooth."""
    out = []
    for i in range(1, len(series)):
        (ta, va), (tb, vb) = series[max(0, i - window)], series[i]
        if tb > ta:
            out.append((round(tb, 1), round((vb - va) / (tb - ta), 1)))
    return out


def read_reject_samples(store, manifest, max_bytes: int = REJECT_BYTES) -> dict:
    """Per source: rejected count (manifest) and the first rejects with their reasons;
    under "groups" (a list), the rejects counted by source and kind of reason (as prepare's
    summary counts them), the largest first, each with its first reject as a sample.
    Groups are counted from the first `max_bytes` of rejects/ ("groups_complete" says
    whether that was all of it)."""
    out = {name: {"rejected": c.rejected, "read": c.read, "samples": []}
           for name, c in sorted(manifest.sources.items())}
    groups: dict[tuple[str, str], dict] = {}
    budget, complete = max_bytes, True
    for key in store.list(layout_lib.REJECTS_PREFIX):
        data = store.read(key) if budget > 0 else None
        if data is None:
            complete = complete and budget > 0
            continue
        if len(data) > budget:  # whole lines of what fits
            data, complete = data[:data.rfind(b"\n", 0, budget) + 1], False
        budget -= len(data)
        for line in data.split(b"\n"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            source = record.get("source") if isinstance(record, dict) else None
            if source not in out:
                continue
            sample = {k: record[k] for k in ("file", "line", "reason", "snippet") if k in record}
            if len(out[source]["samples"]) < REJECT_SAMPLES:
                out[source]["samples"].append(sample)
            kind = layout_lib.reject_kind(str(record.get("reason", "")))
            group = groups.setdefault((source, kind), {"source": source, "reason": kind,
                                                       "count": 0, "sample": sample})
            group["count"] += 1
    return {"sources": out, "groups": sorted(groups.values(),
                                             key=lambda g: (-g["count"], g["source"], g["reason"])),
            "groups_complete": complete}


def page_commands(status: runstate.RunStatus) -> dict:
    """What to run next, for the run's phase: a finished run is read and verified, not
    rerun; an unfinished one is rerun whole (every uncommitted partition: `--only stale`
    would leave the partitions a dead worker had claimed ahead, which read as pending)."""
    run = status.run
    cmds = {"status": advice.status_json(run)}
    if status.complete and not status.problem:
        cmds["read"] = advice.read(run)
    elif status.problem:  # its markers vouch for nothing: repaired first, then rerun
        cmds["repair"] = advice.repair(run)
        cmds["rerun_all"] = advice.rerun(run)
    else:
        cmds["rerun_all"] = advice.rerun(run)
    cmds["verify"] = advice.verify(run)
    return cmds


def page_data(status: runstate.RunStatus, rejects: dict | None = None) -> dict:
    """The page's data: the figures of `status --json` plus map, series and hosts."""
    chars = runstate.map_chars(status)
    series = job_series(status.hosts)
    tokens_total = max(1, status.tokens_total)
    bytes_per_token = (status.bytes_total / tokens_total) if status.bytes_total else None
    rates = sorted(h.tokens_per_s for h in status.hosts if h.live and h.tokens_done > 0)
    median_rate = rates[len(rates) // 2] if rates else 0.0
    hosts = [{
        "host": h.host, "state": h.state, "live": h.live, "age_s": h.age_s,
        "partition": None if h.partition is None else layout_lib.partition_name(h.partition),
        "step": h.step, "steps": h.steps, "tokens_per_s": h.tokens_per_s,
        "tokens_done": h.tokens_done, "partitions_done": h.partitions_done,
        # Dead: failed or gone; a stopped host (Ctrl-C, SIGTERM) is no failure, and once
        # every partition is committed no host is shown as a failure to act on.
        "message": h.message,
        "dead": not h.live and h.state not in ("done", "stopped") and not status.complete,
        # What it did: tokens, partitions, work taken from or given to other replicas,
        # and why it idles (status's "did:" line).
        "did": status_text.host_did(h),
        # Live but no token yet: loading weights, compiling (its message says which). A
        # rank past 0 may store no row at all: it is starting while its message says so.
        "starting": h.live and h.tokens_done == 0 and (h.rank == 0 or bool(h.message)),
        "slow": (h.live and h.tokens_done > 0 and median_rate > 0
                 and h.tokens_per_s < 0.5 * median_rate),
    } for h in status.hosts]
    run = status.run
    return {
        "run": run, "name": status.name, "fingerprint": status.fingerprint, "at": status.at,
        "stale_after_s": status.stale_after_s, "complete": status.complete,
        "counts": dict(status.counts), "partitions_total": len(status.partitions),
        "tokens_done": status.tokens_done, "tokens_total": status.tokens_total,
        "bytes_done": status.bytes_done, "bytes_total": status.bytes_total,
        "tokens_per_s": status.tokens_per_s, "eta_s": status.eta_s,
        "map": chars, "failed_verification": len(status.failed_verification),
        "hosts": hosts, "hosts_live": sum(1 for h in status.hosts if h.live),
        "series_tokens": series, "series_tokens_per_s": throughput_series(series),
        "bytes_per_token": bytes_per_token,
        "rejects": (rejects or {}).get("sources", {}),
        "reject_groups": (rejects or {}).get("groups", []),
        "reject_groups_complete": (rejects or {}).get("groups_complete", True),
        "history": list(status.history), "problem": status.problem,
        "phase": status.phase, "phase_note": (status.problem
                                                     or run_facts.phase_note(status.phase,
                                                                             status.run)),
        "identity": status.identity, "verification": status.verification,
        "generation_facts": generation_facts(status.identity),
        "reference": status.reference,
        "elapsed_s": status.elapsed_s, "average_tokens_per_s": status.average_tokens_per_s,
        "current_tokens_per_s": status.current_tokens_per_s,
        "token_masks": (None if status.token_masks is None
                        else config_lib.to_dict(status.token_masks)),
        "commands": page_commands(status),
    }


def generation_facts(identity: dict) -> list[tuple[str, str]]:
    """A generating run's lines of the page's Run facts, in status's words: what it
    generates and what its committed partitions generated ([] for any other run)."""
    if not identity.get("generate"):
        return []
    return [("generates", status_text.generates_words(identity["generate"])),
            ("generated", status_text.generated_words(identity["generation"]))]


def extraction_lines(statuses: dict[str, runstate.RunStatus], shown: str) -> list[dict]:
    """One line per extraction of a run that has several (none otherwise): its counts and
    phase, as `actx status` prints them, and whether it is the one the page shows."""
    if len(statuses) < 2:
        return []
    return [{"name": name or "default", "shown": name == shown,
             "committed": s.counts[partition_states.COMMITTED], "partitions": len(s.partitions),
             "in_progress": s.counts[partition_states.IN_PROGRESS],
             "stale": s.counts[partition_states.STALE],
             "pending": s.counts[partition_states.PENDING],
             "phase": s.phase, "fingerprint": s.fingerprint}
            for name, s in statuses.items()]
