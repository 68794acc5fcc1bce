"""What a run is and where it stands, in words a researcher reads first: its identity
(model, hooks, dtype, packing, where the activations are), the last `actx verify`, and
one phase word (not started, starting, running, finished, stopped, failed).

Used by `actx status` (text and --json) and by the live page, so all three agree.
"""

from __future__ import annotations

import weakref

from actx.schemas import commit as commit_lib
from actx.schemas import config as config_lib
from actx.schemas import layout as layout_lib
from actx.schemas import manifest as manifest_lib
from actx.schemas import verification as verification_lib

# The phase words and their advice are shared with the reader that follows a live run.
from actx.schemas.run_phase import (FAILED, FINISHED, NOT_STARTED, PHASE_NOTES,  # noqa: F401,E402
                                    RUNNING, STARTING, STOPPED, phase, phase_note)

VERIFY_PROBLEMS_SHOWN = 3


def identity(handle, info, committed: "set[int] | None" = None) -> dict:
    """The run's settings as prepared (run.json, manifest.json) and, once a worker wrote
    activations/actx.json, the hooks it resolved with their widths. A generating run adds
    its `generate` settings and, under "generation", what its committed partitions
    generated (`generation`); `committed`: their ids where the caller listed them."""
    spec, packing = handle.spec, handle.spec.packing
    model = spec.model.path or f"flax:{spec.model.flax}"
    hooks = dict(info.hooks) if info else None
    facts = {
        "model": model, "model_dtype": spec.model.dtype if spec.model.path else None,
        "hooks_requested": spec.capture.hooks,
        "hooks": hooks,
        "dtype": spec.capture.dtype, "seq_len": handle.manifest.seq_len,
        "packing": packing.mode, "overflow": packing.overflow,
        "max_context": packing.max_context if packing.carries_context else None,
        "tokens": handle.manifest.total_tokens, "rows": handle.manifest.total_rows,
        # A named extraction's under its own prefix (extractions/<name>/activations).
        "activations": str(handle.location.join(layout_lib.extraction_key(
            getattr(handle.store, "name", ""), layout_lib.ACTIVATIONS_GROUP + "/")
            .rstrip("/"))),
    }
    if spec.generate is not None:
        if hooks:  # the ids the model wrote are stored beside the hooks, not one of them
            hooks.pop(layout_lib.GENERATED_IDS, None)
        facts["generate"] = config_lib.to_dict(spec.generate)
        facts["generation"] = generation(handle, committed)
    return facts


def generation(handle, committed: "set[int] | None" = None) -> dict:
    """A generating run's counts over its committed partitions' records
    (reader.generation_records.count: prompts, samples, generated_tokens, stop_reasons,
    partitions, unreadable), read in parallel, each once per process for a run's view
    (`_GENERATION_COUNTS`): a status that polls a view reads only what was committed
    since. Only a generating run calls it: the others pay neither the reads nor the
    reader's import."""
    from actx.reader import generation_records

    if committed is None:
        committed = commit_lib.committed_partitions(handle.store,
                                                    len(handle.manifest.partitions))
    cache = _GENERATION_COUNTS.get(handle.store)
    if cache is None:
        cache = _GENERATION_COUNTS[handle.store] = generation_records.CountCache()
    return cache.count(handle.store, committed)


# {a run view's store: reader.generation_records.CountCache}, for as long as the view is
# held: a poller (a launcher's progress line, a follow, the page) keeps its views, so it
# reads each record once; a command that opens the run anew reads them all again.
_GENERATION_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def verification(record, committed: set[int]) -> dict | None:
    """The latest `actx verify` (verify/latest.json), or None when it never ran. ok: no
    committed partition failed it, none it repaired waits for a verify since, and it found
    no problem of the run as a whole."""
    if record is None:
        return None
    if isinstance(record, verification_lib.DamagedRecord):  # its outcome unknown
        return {"at": None, "checked": 0, "failed": 0, "repaired": 0, "ok": False,
                "problems": [record.damage], "damaged": record.damage}
    failed = [p for p in record.failed if p in committed]
    # A problem of no one partition (an array the store would not open that time): the
    # verify did not pass, though it failed no partition.
    whole_run = bool(record.problems) and not record.failed
    return {"at": record.at, "checked": record.checked, "failed": len(failed),
            "repaired": len(record.repaired),
            "ok": not failed and not record.repaired and not whole_run,
            "problems": list(record.problems[:VERIFY_PROBLEMS_SHOWN])}


def shown_state(state: str) -> str:
    """A heartbeat's state as status shows it: "preempted" (the heartbeat's word for a
    worker a stop signal ended: Ctrl-C, a launcher's SIGTERM, a preemption notice) reads
    as stopped, as the run's phase does."""
    return "stopped" if state == "preempted" else state


def without_advice(message: str) -> str:
    """A host's message without the commands it advised ("; `actx rerun RUN` finishes the
    run"): once every partition is committed there is nothing left to rerun."""
    kept = [part for part in message.split("; ") if "`actx rerun" not in part]
    return "; ".join(kept)


def history(hosts) -> tuple[str, ...]:
    """A complete run's hosts that ended otherwise than done (failed, gone, stale,
    stopped), each in one line with what it said, and the partitions others took over:
    what happened on the way, not something to act on (every partition is committed)."""
    lines = []
    for h in hosts:
        if h.live or h.state == "done":
            continue
        said = f" ({h.message})" if h.message else ""
        lines.append(f"{h.host} ended {h.state}{said} after {h.partitions_done} "
                     f"partition(s); the other hosts committed the rest")
    taken = sum(sum(h.stolen_from.values()) for h in hosts)
    if lines and taken:
        lines.append(f"{taken} partition(s) were taken over from other hosts' lists")
    return tuple(lines)


def rejects(handle) -> dict | None:
    """What prepare rejected, from the manifest (no other read): the count, the reasons
    per source with their counts, where each reject is with its reason, and the phrase
    status prints; None when it rejected nothing."""
    manifest = handle.manifest
    if not manifest.docs_rejected:
        return None
    return {"count": manifest.docs_rejected,
            "reasons": {name: dict(c.reasons) for name, c in sorted(manifest.sources.items())
                        if c.rejected},
            "path": str(handle.location.join(layout_lib.REJECTS_PREFIX)),
            "summary": manifest_lib.rejects_words(manifest)}
