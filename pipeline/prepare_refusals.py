"""What `actx prepare` refuses, and the hints it gives: a run directory of another run or
with files no prepare wrote, a max_context beyond the model's, a tokenizer that is not the
model's, sources that hold no documents, too many rejects.

Apart from `pipeline.main` (which runs prepare and parses its command line) because these
are the refusals themselves: each a check of the spec or the run directory that raises
`PrepareError` with the line that says what to do, written once and called from there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shlex

from actx.pipeline import tokenize
from actx.pipeline import write_store
from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import extraction_store
from actx.schemas import layout
from actx.schemas import object_store
from actx.schemas import position_limits
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import tokenizer_identity

_log = logging.getLogger("actx.prepare")  # the logger of `pipeline.main`: one for prepare


class PrepareError(errors.UserError, RuntimeError):
    """The run failed a check (too many rejects, a conflicting run directory)."""


def check_run_dir(store, spec: runspec_lib.RunSpec, carried: dict | None = None) -> set[int]:
    """Refuses another run's directory, then clears what an earlier attempt left; returns
    the partitions committed in any extraction (a run prepared again), whose tokens the
    writers then check rather than write (write_store.write_partition).

    run.json and manifest.json are written last, so without them every token array, doc
    table and reject file here is from a failed attempt (possibly of another shape) and
    goes; prepare/attempt.json, written first, says an attempt was made here, so files
    that no prepare wrote are refused rather than deleted. Once partitions are committed
    the token store stays (prepare is deterministic, and workers read it); rejects are
    always rewritten by this attempt. `carried`: what the attempt's record keeps for a
    try after this one stopped (the reject fraction accepted before).
    """
    store.check_reachable()  # a missing bucket or no access: said now, not from a Beam worker
    try:
        existing = store.read_json(runspec_lib.RUN_SPEC_KEY)
    except object_store.DamagedObjectError:
        # Damaged (not JSON): as lost where the manifest says it was this spec's (below);
        # anything else is said as it is, and nothing is touched.
        if _manifest_fingerprint(store) != spec.fingerprint:
            raise
        existing = None
    if existing is not None and existing.get("fingerprint") != spec.fingerprint:
        # A run prepared before prepend_bos has its own hint (the line to add).
        hint = _add_bos_hint(existing, spec, store.location)
        raise PrepareError(
            f"{store.location}: holds a different run (fingerprint {existing.get('fingerprint')}, "
            f"this spec is {spec.fingerprint}"
            + ("); choose a new run directory" + hint if hint else _spec_changes(existing, spec)))
    # run.json alone lost (deleted by hand), its manifest this spec's: a prepare again, as
    # with run.json there, so what is committed stays (the tokens are checked against the
    # markers' token checksums before anything is written; the tokenizer's record was in
    # the lost run.json, so it is not compared).
    manifest_fingerprint = _manifest_fingerprint(store) if existing is None else None
    lost_spec = existing is None and manifest_fingerprint == spec.fingerprint
    if (existing is None and manifest_fingerprint is not None and not lost_spec
            and committed_anywhere(store)):
        raise PrepareError(
            f"{store.location}: holds a different run (its manifest.json has fingerprint "
            f"{manifest_fingerprint}, this spec is {spec.fingerprint}; its run.json is gone) "
            f"with committed partitions; choose a new run directory, or submit the config "
            f"that run was made with (it writes run.json again and keeps them)")
    committed = committed_anywhere(store) if existing is not None or lost_spec else set()
    if existing is not None:
        _check_same_tokens(store, existing, spec)
    elif lost_spec and committed:
        _log.info("prepare: %s has no readable run.json, but its manifest.json is this spec's "
                  "(fingerprint %s) and %d partition(s) are committed: its token store is "
                  "checked against them and run.json written again", store.location,
                  spec.fingerprint, len(committed))
        # Before the manifest goes: a prepare stopped on the way then leaves the run of a
        # prepare again (run.json, no manifest), whose next try keeps what is committed,
        # never a directory of markers alone, which a prepare starts afresh.
        store.write_json(runspec_lib.RUN_SPEC_KEY, spec.to_json_obj())
    # Until the new manifest lands the run counts as not prepared.
    store.delete(layout.MANIFEST_KEY)
    store.delete(write_store.SUMMARY_KEY)
    if existing is None and not lost_spec and not store.exists(layout.PREPARE_ATTEMPT_KEY):
        foreign = [p for p in layout.PREPARE_OUTPUT_PREFIXES if store.list(p)]
        if foreign:
            raise PrepareError(
                f"{store.location}: holds {', '.join(foreign)} that no actx prepare wrote (no "
                f"run.json, no {layout.PREPARE_ATTEMPT_KEY}); choose a new run directory, or "
                f"delete them if they are a failed prepare's")
    if existing is None and not committed and commit_lib.committed_partitions(store):
        # No run.json, yet commit markers: a run whose directory was removed (under a live
        # job, whose workers went on writing a few). Its markers, activations and claims
        # say nothing about the token store this prepare writes: the run starts afresh
        # rather than count as extracted.
        stale = sum(store.delete_prefix(p) for p in (
            layout.COMMITS_PREFIX, f"{layout.ACTIVATIONS_GROUP}/", layout.CLAIMS_PREFIX))
        if stale:
            _log.info("prepare: %s has no run.json but %d object(s) of an earlier run "
                      "(commits/, activations/, claims/): removed; the run starts afresh",
                      store.location, stale)
    prefixes = ((layout.REJECTS_PREFIX, "prepare/") if committed
                else layout.PREPARE_OUTPUT_PREFIXES)  # prepare/ last: its marker goes last
    removed = sum(store.delete_prefix(prefix) for prefix in prefixes)
    if removed:
        _log.info("prepare: removed %d object(s) of an earlier attempt under %s (%s)", removed,
                  store.location, ", ".join(prefixes))
    write_attempt(store, spec, carried)
    return committed


def write_attempt(store, spec: runspec_lib.RunSpec, carried: dict | None = None) -> None:
    """Writes prepare/attempt.json. No time in it: the run directory stays byte-identical
    across prepares (what an attempt carries is taken out once its manifest stands)."""
    store.write_json(layout.PREPARE_ATTEMPT_KEY, {"fingerprint": spec.fingerprint,
                                                  **(carried or {})})


def _manifest_fingerprint(store) -> str | None:
    """The fingerprint manifest.json records; None without one, or one that cannot be
    read."""
    try:
        manifest = store.read_json(layout.MANIFEST_KEY)
    except ValueError:
        return None
    return manifest.get("fingerprint") if isinstance(manifest, dict) else None


def committed_anywhere(store) -> set[int]:
    """The partitions committed in any extraction of the run."""
    return set().union(*(commit_lib.committed_partitions(extraction_store.view(store, name))
                         for name in extraction_store.names(store)))


def committed_rows(run) -> int | None:
    """The rows of the run's token arrays as stored (None: none stored)."""
    from actx.schemas import ts_context

    key = layout.token_array_key("input_ids")
    if not run.store.exists(f"{key}/zarr.json"):
        return None
    return int(ts_context.open_array(layout.array_spec(run.location, key)).shape[0])


def _check_same_tokens(store, existing: dict, spec: runspec_lib.RunSpec) -> None:
    """Committed activations belong to the tokens they were computed on: preparing the run
    again (a damaged token store's advice, `actx prepare --spec RUN/run.json`) with a
    tokenizer that makes other ids (its files changed since) would put other tokens under
    them. Refused before anything is touched; without a commit the whole store is written
    again, and run.json records the tokenizer it was."""
    recorded = runspec_lib.RunSpec.from_dict(existing).tokenizer_identity
    if recorded is None or spec.tokenizer_identity is None:
        return  # spec_version 2 recorded no tokenizer
    changed = tokenizer_identity.changes_since(recorded, spec.tokenizer_identity)
    if not changed:
        return
    committed = [name or "default" for name in extraction_store.names(store)
                 if commit_lib.committed_partitions(extraction_store.view(store, name))]
    if committed:
        raise PrepareError(
            f"{store.location}: the tokenizer at {spec.tokenizer.path} is not the one this "
            f"run's tokens were made with (fingerprint {recorded.fingerprint} then, "
            f"{spec.tokenizer_identity.fingerprint} now; {'; '.join(changed)} differ), and "
            f"partitions are committed with the activations of those tokens"
            f"{'' if committed == ['default'] else ' (extractions ' + ', '.join(committed) + ')'}"
            f": other tokens would lie under them. Restore the "
            f"tokenizer's files as they were when the run was prepared, or prepare into a new "
            f"run directory")


def _spec_changes(existing: dict, spec: runspec_lib.RunSpec, shown: int = 4) -> str:
    """'; differs in packing.seq_len (32 there, 64 here), ...': the settings in which the
    spec differs from the run.json already there (its fields as dotted keys), so the user
    sees which line of the config moved it to another run."""
    def leaves(value, prefix=""):
        if isinstance(value, dict):
            for key, inner in value.items():
                yield from leaves(inner, f"{prefix}{key}.")
        else:
            yield prefix[:-1], value

    ignored = ("fingerprint", "spec_version", "tokenizer_identity")
    there = dict(leaves({k: v for k, v in existing.items() if k not in ignored}))
    here = dict(leaves({k: v for k, v in spec.to_dict().items() if k not in ignored}))
    changed = sorted(k for k in set(there) | set(here) if there.get(k) != here.get(k))
    if not changed:
        return "); choose a new run directory"
    listed = ", ".join(f"{k} ({there.get(k, 'absent')!r} there, {here.get(k, 'absent')!r} "
                       f"here)" for k in changed[:shown])
    more = f" and {len(changed) - shown} more" if len(changed) > shown else ""
    return (f"; it differs in {listed}{more}); choose a new run directory, or set "
            f"{'this' if len(changed) == 1 else 'these'} back to go on with that run")


def _add_bos_hint(existing: dict, spec: runspec_lib.RunSpec, location) -> str:
    """What to write when the run was prepared before `prepend_bos` (its run.json says
    add_bos) and the spec differs from it only by leaving BOS to the tokenizer."""
    old = (existing.get("tokenizer") or {}).get("add_bos")
    if not isinstance(old, bool) or spec.tokenizer.bos_choice is not None:
        return ""
    same = dataclasses.replace(spec, tokenizer=dataclasses.replace(spec.tokenizer,
                                                                   add_bos=old))
    if same.fingerprint != existing.get("fingerprint"):
        return ""
    return (f"; or go on with it: it was prepared before spec.tokenizer.prepend_bos, with "
            f"add_bos: {str(old).lower()} (docs/checkpoints.md): add that to spec.tokenizer, "
            f"or `{advice.rerun(location)}`")


def reject_summary(summary: dict) -> str:
    lines = []
    for name, counts in summary["sources"].items():
        reasons = summary["reject_reasons"].get(name, {})
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items()))
        lines.append(f"  {name}: read {counts['read']}, accepted {counts['accepted']}, "
                     f"rejected {counts['rejected']}" + (f" ({detail})" if detail else ""))
    return "\n".join(lines)


def accept_rejects_hint(fraction: float, retry_argv: list[str] | None) -> str:
    """What to type to accept `fraction` rejected: the same command with the smallest
    --max-reject-fraction (rounded up to 3 decimals) that passes."""
    needed = f"{min(1.0, math.ceil(fraction * 1000) / 1000):g}"
    if retry_argv is None:
        return f"run_prepare(..., max_reject_fraction={needed})"
    kept, skip = [], False
    for arg in retry_argv:
        if skip:
            skip = False
        elif arg == "--max-reject-fraction":
            skip = True  # its value follows
        elif not arg.startswith("--max-reject-fraction="):
            kept.append(arg)
    return shlex.join(kept + [f"--max-reject-fraction={needed}"])


def check_not_empty(spec: runspec_lib.RunSpec, files: list[tuple[int, str]],
                     summary: dict) -> None:
    """A source that yielded no record at all is a mistake (an empty file, a wrong glob's
    empty match), not a run of 0 documents."""
    for s, source in enumerate(spec.sources):
        name = spec.source_name(s)
        counts = summary["sources"].get(name)
        if source.max_docs != 0 and counts is not None and counts["read"] == 0:
            paths = [f for i, f in files if i == s]
            shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3
                                            else "")
            raise PrepareError(f"source {name!r}: no documents in {shown} (empty input); "
                               f"check the path, or remove the source")


def check_max_context(spec: runspec_lib.RunSpec) -> None:
    """packing.max_context within the model's declared context, and every position within
    a GPT-2's learned position embeddings, when its config.json can be read now: the
    workers refuse them later, after the whole prepare, otherwise."""
    if not spec.model.path:  # prepare alone: the model is only recorded
        return
    try:
        # The model's checkpoint directory, not the run.
        config = store_lib.open_store(spec.model.path).read_json("config.json") or {}
    except Exception:  # the model may not be reachable from here; workers check again
        return
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal checkpoint's decoder (Gemma 3)
    if not isinstance(config, dict):
        return
    if config.get("model_type") == "gpt2":  # the family with learned positions
        limit = int(config.get("n_positions") or config.get("max_position_embeddings") or 0)
        architecture = (config.get("architectures") or ["GPT2LMHeadModel"])[0]
        problems = position_limits.learned_position_problems(
            spec.packing, limit, architecture, spec.model.path, spec.generate is not None
        ) if limit else []
    else:
        problem = position_limits.context_problem(
            spec.packing, int(config.get("max_position_embeddings") or 0), spec.model.path)
        problems = [problem] if problem else []
    if problems:
        raise PrepareError("; ".join(problems))


def check_tokenizer_is_models(spec: runspec_lib.RunSpec
                               ) -> tokenizer_identity.TokenizerIdentity:
    """Refuses a tokenizer of another model (schemas.tokenizer_identity) when the model's
    files can be read now (the workers check again); returns the tokenizer's identity,
    which run.json records."""
    tokenize.check_tokenizer_path(spec.tokenizer.path)
    files = tokenizer_identity.read_tokenizer(spec.tokenizer.path)
    if not spec.model.path:  # prepare alone: the model is only recorded
        return files.identity()
    try:
        # The model's checkpoint directory, not the run.
        config = store_lib.open_store(spec.model.path).read_json("config.json")
        if config is None or "vocab_size" not in config:
            return files.identity()
        found = tokenizer_identity.match_problems(
            files, spec.tokenizer.path, spec.model.path, int(config["vocab_size"]),
            allowed=spec.tokenizer.allow_model_mismatch)
    except Exception as e:  # the model may not be reachable from here; workers check again
        _log.warning("prepare: could not check the tokenizer against the model (%s); the "
                     "workers will", e)
        return files.identity()
    if found:
        raise PrepareError(found[0] if len(found) == 1 else
                           f"{len(found)} problems, nothing was started:\n  "
                           + "\n  ".join(found))
    return files.identity()
