"""The `actx` command line: prepare, extract, submit, status, rerun, verify, down.

`prepare` and `extract` hand their flags to the pipeline's and the workers' entry points;
the others operate a run directory. status, rerun and verify import neither jax nor Beam
(rerun starts workers as separate processes). Exit codes: 0 ok, 1 a check or a worker
failed, 2 bad input (config, flags, not an actx run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from actx.deploy import columns
from actx.deploy import config as config_lib
from actx.deploy import jobs
from actx.deploy import targets
from actx.deploy.targets import UsageError
from actx.schemas import advice
from actx.schemas import errors
from actx.schemas import extraction as extraction_lib
from actx.schemas import flags
from actx.schemas import layout as layout_lib
from actx.schemas import run_dir
from actx.schemas import stop_signals

# The commands whose lines fit the terminal's columns (deploy.columns; not --json, --serve
# or --html).
FITTED = ("submit", "demo", "rerun", "status")

EXAMPLES = """\
examples:
  actx submit                                  # the demo: tiny random Qwen2, ARC + FineWeb
  actx submit configs/example_tpu.yaml --set target.tpu.name=my-tpu --dry-run
  actx status runs/demo --watch
  actx status gs://bucket/runs/r1 --serve      # live page on http://127.0.0.1:8765/
  actx rerun gs://bucket/runs/r1 --hosts 2     # every uncommitted partition
  actx verify gs://bucket/runs/r1
  actx down --config configs/example_tpu.yaml  # delete the slice submit created
"""


def _ids_or_state(text: str) -> str | list[int]:
    if text in ("stale", "pending", "all"):
        return text
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'stale', 'pending', 'all' or partition ids like 3,7,9; got {text!r}")


def _add_target_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target (override the config's target table)")
    g.add_argument("--target", choices=targets.NAMES, default=None,
                   help="where to run (default: the config's target.kind, else local)")
    flags.add_override_arguments(g, config_lib.TargetConfig, jobs.TARGET_FLAGS)
    g.add_argument("--job", default=None, help="job id (default: <target>-<time>)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the plan (every command exactly, on tpu-vm and dataflow) and "
                        "what the job costs (tokens; each hook's bytes and objects), run "
                        "nothing, write nothing; every target")
    g.add_argument("--estimate", action="store_true",
                   help="with --dry-run: also a time for the job (local: one worker timed "
                        "over the first partitions of a temporary copy; other targets: "
                        "their accelerators' peak), and what the bucket sees for the "
                        "target's hosts: objects, bytes, requests by GCS class, dollars at "
                        "list prices (config `prices`), the data's write rate against a "
                        "new bucket's and GCS's ramp to it, and whether storage or compute "
                        "bounds the job")
    g.add_argument("--join", action="store_true",
                   help="local: run beside the job already extracting this run instead of "
                        "being refused (this job's hosts get their own names and logs; "
                        "the first commit of a partition wins)")


def _add_wait_flags(p: argparse.ArgumentParser, stale_after: bool = True) -> None:
    detached = " and ".join(targets.DETACHED)
    p.add_argument("--wait", action="store_true",
                   help=f"{detached}: follow the detached workers (as `status --watch`) "
                        f"until the job ends; exit 0 when its partitions are committed, "
                        f"else 1 (on local the command always waits: its workers run "
                        f"under it)")
    if stale_after:
        p.add_argument("--stale-after", type=float, default=60.0, metavar="SECONDS",
                       help="--wait: a heartbeat older than this is a lost host (default 60)")


def _add_prepare_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-reject-fraction", type=float, default=None, metavar="FRACTION",
                   help="prepare aborts when more than this fraction of inputs is rejected "
                        "(default: the config's max_reject_fraction, else 0.01)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actx", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("prepare", help="tokenize and pack inputs into a run (Beam); "
                                   "`actx prepare --help`", add_help=False)
    sub.add_parser("extract", help="one extraction worker process; `actx extract --help`",
                   add_help=False)

    s = sub.add_parser("submit", help="prepare then extract a run on a target",
                       description="Runs prepare, then extract, from one config file (YAML or "
                                   "TOML). Without CONFIG: the embedded demo (deploy/demo.yaml).")
    s.add_argument("config", nargs="?", default=None, help="submit config (YAML/TOML/JSON)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set spec.packing.seq_len=256")
    s.add_argument("--run", default=None, help="run directory (overrides the config's run)")
    _add_prepare_flags(s)
    _add_target_flags(s)
    _add_wait_flags(s)

    d = sub.add_parser("demo", help="the embedded demo (same as `actx submit` with no CONFIG)")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--run", default=None)
    _add_prepare_flags(d)
    _add_target_flags(d)

    st = sub.add_parser("status", help="progress of a run (local path or gs://)")
    st.add_argument("run")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--check", action="store_true",
                    help="exit 1 while any partition is uncommitted (for scripts)")
    st.add_argument("--watch", nargs="?", type=float, const=5.0, default=None,
                    metavar="SECONDS", help="refresh in place (default every 5s) until done")
    st.add_argument("--stale-after", type=float, default=60.0, metavar="SECONDS",
                    help="a heartbeat older than this, and than 3 of its host's heartbeat "
                         "intervals, is stale (default 60)")
    st.add_argument("--serve", nargs="?", type=int, const=8765, metavar="PORT",
                    help="serve a live page on http://127.0.0.1:PORT/ (default 8765; 0: any)")
    st.add_argument("--html", metavar="FILE", help="write the page once, self-contained")
    st.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                    help="--serve: seconds between the page's refreshes (default 5)")
    _add_extraction_flag(st, "show (default: every one; the page lists them and shows the first in full)")

    r = sub.add_parser("rerun", help="extract the partitions that have no commit")
    r.add_argument("run")
    r.add_argument("--only", type=_ids_or_state, default="all",
                   help="stale, pending, or partition ids 3,7,9 (default: every uncommitted)")
    r.add_argument("--config", default=None, help="a submit config whose target table to use")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--stale-after", type=float, default=60.0, metavar="SECONDS")
    r.add_argument("--install", action="store_true", help="tpu-vm: install actx on the hosts first")
    r.add_argument("--recreate", action="store_true",
                   help="tpu-vm: delete the slice and request it again first (after a "
                        "preemption), then install")
    _add_extraction_flag(r, "extract (default: whichever are behind)")
    _add_target_flags(r)
    _add_wait_flags(r, stale_after=False)

    dn = sub.add_parser("down", help="tpu-vm: delete the TPU slice that submit created; "
                                     "slurm: cancel the job",
                        description="Deletes the queued resource (with its slice) or the TPU "
                                    "VM that `actx submit CONFIG` created; for a slurm "
                                    "target, cancels its jobs (scancel).")
    dn.add_argument("--config", required=True, help="the submit config whose target table "
                                                    "names the slice or the Slurm job")
    dn.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    dn.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")

    v = sub.add_parser("verify", help="re-read committed data and check it against the markers")
    v.add_argument("run")
    v.add_argument("--only", type=_ids_or_state, default="all", help="partition ids 3,7,9")
    v.add_argument("--json", action="store_true")
    v.add_argument("--committed-only", action="store_true",
                   help="check committed partitions only: uncommitted ones are no failure")
    v.add_argument("--repair", action="store_true",
                   help="turn partitions that fail back into pending (their markers are "
                        "deleted, and recorded under verify/repairs/) for `actx rerun`")
    v.add_argument("--reference", action="store_true",
                   help="recompute a sample of stored documents with the model itself (HF "
                        "transformers on PyTorch: the `torch` extra) and compare every "
                        "stored hook, instead of the checksums")
    v.add_argument("--sample", type=int, default=4, metavar="N",
                   help="--reference: documents to recompute (default 4)")
    v.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="--reference: where the reference runs (default cpu)")
    v.add_argument("--seed", type=int, default=0, help="--reference: which documents")
    _add_extraction_flag(v, "verify (default: every one)")
    return p


def _verify_failed_run(status) -> bool:
    """Whether the latest `actx verify` of a run failed with no partition to repair (its
    token store or an array damaged): nothing since says it was mended."""
    v = status.verification
    return bool(v) and not v.get("damaged") and not v.get("ok") and not v.get("failed") \
        and not v.get("repaired")


def _add_extraction_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--extraction", default=None, metavar="NAME[,NAME]",
                   help=f"the run's extractions to {what}; 'default' names the run's root "
                        f"one (a run with one model has only that)")


# -- status / verify ------------------------------------------------------------------
def cmd_status(args, out) -> int:
    from actx.deploy.status import runstate
    from actx.deploy.status import text as status_text

    handles = extraction_lib.scoped_all(run_dir.open_run(args.run), args.extraction)
    if args.html is not None or args.serve is not None:
        from actx.deploy.page import server as ui_server

        if args.json or args.watch is not None:
            raise UsageError("--serve and --html show the page; drop --json and --watch")
        return ui_server.page_command(next(iter(handles.values())), args.html, args.serve,
                                      args.refresh, args.stale_after, out,
                                      extractions=handles)
    tty = hasattr(out, "isatty") and out.isatty()
    while True:
        statuses = {name: runstate.compute_status(handle, args.stale_after)
                    for name, handle in handles.items()}
        text = status_text.render_extractions(statuses, as_json=args.json)
        if args.watch is not None and tty and not args.json:
            print("\x1b[H\x1b[2J" + text, file=out, flush=True)
        else:
            print(text, file=out, flush=True)
        complete = all(status.complete for status in statuses.values())
        if args.watch is None or complete:
            failed = sum(len(st.failed_verification) for st in statuses.values())
            if args.check and complete and failed:
                # Committed is a listing of marker names; the latest `actx verify` found
                # some of those partitions' data not as their markers say: not complete.
                _say_error(f"actx status: {failed} committed partition(s) failed the latest "
                           f"`actx verify`; `{advice.repair(args.run)}` turns them back into "
                           f"pending, then `{advice.rerun(args.run)}` extracts them again")
                return 1
            damaged = next((st.verification["damaged"] for st in statuses.values()
                            if st.verification and st.verification.get("damaged")), None)
            if args.check and complete and damaged:  # what the latest verify found: unknown
                _say_error(f"actx status: {damaged}")
                return 1
            if args.check and complete and any(_verify_failed_run(st) for st in statuses.values()):
                # A failure of no one partition (the token store, an array that would not
                # open): the markers cannot say it is mended; a verify that passes does.
                _say_error(f"actx status: the latest `actx verify` failed on what no one "
                           f"partition holds; `{advice.verify(args.run)}` names it (with what "
                           f"mends it) and checks the run again")
                return 1
            return 1 if args.check and not complete else 0
        time.sleep(args.watch)


def cmd_verify(args, out) -> int:
    """Each extraction of the run that --extraction names (every one by default) in turn,
    under its name when the run has named ones; the worst exit code."""
    handles = extraction_lib.scoped_all(run_dir.open_run(args.run), args.extraction)
    codes = []
    for name, handle in handles.items():
        if list(handles) != [""]:
            print((json.dumps({"extraction": name or "default"}) if args.json
                   else f"== extraction {name or 'default'} =="), file=out, flush=True)
        codes.append(_verify_one(args, handle, out))
    return max(codes)


def _verify_one(args, handle, out) -> int:
    from actx.deploy import verify
    from actx.schemas import store_errors

    if args.only not in ("all",) and isinstance(args.only, str):
        raise UsageError("verify --only takes partition ids, e.g. 3,7,9")
    only = None if args.only == "all" else set(args.only)
    if only is not None:
        known = {p.id for p in handle.manifest.partitions}
        unknown = sorted(only - known)
        if unknown:
            raise UsageError(
                f"--only: partition(s) {unknown} do not exist (the run has "
                f"{len(known)} partition(s), 0..{len(known) - 1}); nothing was verified")
    if args.reference:
        from actx.deploy import verify_reference

        return verify_reference.command(handle, only, args, out)
    report = verify.verify_run(handle, only)
    from actx.schemas import verification

    repaired = verify.repair(handle, report, time.time()) if args.repair else []
    leftovers = verify.leftover_temporaries(handle, remove=args.repair)
    if args.json:
        obj = report.to_json_obj()
        obj["leftover_temporaries"] = leftovers
        if args.repair:
            obj["repaired"] = [layout_lib.partition_name(p) for p in repaired]
        print(json.dumps(obj, indent=1, sort_keys=True), file=out)
    else:
        print(verify.render(report), file=out)
        if leftovers:
            print(f"{'REMOVED' if args.repair else 'note'}: {len(leftovers)} temporary "
                  f"file(s) of marker writes a stopped worker left under "
                  f"{handle.location.join(layout_lib.COMMITS_PREFIX)} (never read)"
                  + ("" if args.repair else f"; `{advice.repair(handle.location)}` "
                                            f"removes them"), file=out)
        first = (f"`{advice.reprepare(handle.location)}` writes the damaged token store "
                 f"again (the same tokens); then " if report.tokens_damaged else "")
        rebuilt = report.rebuilt_info is not None
        # Where the repair record is: a named extraction's under extractions/NAME/.
        repairs = handle.location.join(layout_lib.extraction_key(
            handle.extraction_name, layout_lib.VERIFY_REPAIRS_PREFIX))
        if rebuilt and args.repair:
            record = layout_lib.extraction_key(handle.extraction_name,
                                               layout_lib.ACTIVATIONS_INFO_KEY)
            print(f"REBUILT: {handle.location.join(record)} (what it replaced is kept under "
                  f"{repairs})"
                  + ("" if repaired else f"; {first}`{advice.verify(handle.location)}` checks "
                                         f"the run again"), file=out)
        if repaired:
            print(f"REPAIRED: {len(repaired)} partition(s) are pending again (markers deleted, "
                  f"recorded under {repairs}): "
                  f"{', '.join(layout_lib.partition_name(p) for p in repaired[:20])}"
                  f"{' ...' if len(repaired) > 20 else ''}; {first}"
                  f"`{advice.rerun(handle.location)}` extracts them", file=out)
        elif report.only_tokens_damaged:
            # The committed activations stand: only the token store is written again.
            print(f"{first}`{advice.verify(handle.location)}` checks the run again",
                  file=out)
        elif rebuilt and not report.failed:
            # The data checked out against the rebuilt record: only the record is written.
            if not args.repair:
                print(f"{first}`{advice.repair(handle.location)}` writes the rebuilt "
                      f"{layout_lib.ACTIVATIONS_INFO_KEY} (the data checked out)", file=out)
        elif not report.ok and not report.failed:
            # Nothing failed its own check (an array the store would not open this time, a
            # run that holds no data): `--repair` would turn nothing back, and the rerun
            # after it would find nothing to do.
            print(f"{first}no partition failed its check; once what is named above is "
                  f"mended (a refusal or outage of the store passes by itself), "
                  f"`{advice.verify(handle.location)}` checks the run again", file=out)
        elif not report.ok:
            print(f"{first}`{advice.repair(handle.location)}` turns the failed partitions "
                  f"back into pending; then `{advice.rerun(handle.location)}` extracts them "
                  f"again", file=out)
    # Recorded for status and the live page (failed partitions shown on the map); a
    # repaired partition is pending now, not failed. The report above stands without it.
    try:
        verification.update_record(handle.store, time.time(), report.checked,
                                   [p for p in report.failed if p not in repaired],
                                   report.problems, repaired)
    except store_errors.StoreError as e:
        print(f"actx verify: the report above was not recorded: {e}", file=sys.stderr)
    return 0 if report.ok and (report.complete or args.committed_only) else 1


def _staged_for_dataflow(argv: list[str]) -> list[str]:
    """`actx prepare ... --runner=DataflowRunner` without --setup_file: stage what the
    Dataflow workers must install (deploy.targets.dataflow.stage, as `actx submit` does) in a
    temporary directory and name its setup.py."""
    runner = next((argv[i + 1] if a == "--runner" and i + 1 < len(argv) else
                   a.split("=", 1)[1] for i, a in enumerate(argv)
                   if a == "--runner" or a.startswith("--runner=")), "")
    if runner != "DataflowRunner" or any(a == "--setup_file" or a.startswith("--setup_file=")
                                         for a in argv):
        return argv
    import tempfile

    from actx.deploy.targets.dataflow import stage as dataflow_stage

    setup_file = dataflow_stage.stage(os.path.join(tempfile.mkdtemp(prefix="actx-stage-"),
                                                   "src"))
    print(f"prepare: staged actx for the Dataflow workers in {os.path.dirname(setup_file)}",
          file=sys.stderr)
    return [*argv, f"--setup_file={setup_file}"]


# -- entry point ----------------------------------------------------------------------------
def main(argv: list[str] | None = None, out=None) -> int:
    """Exit codes: 0 ok, 1 a check or a worker failed, 2 bad input, 130 / 143 interrupted
    by SIGINT / SIGTERM (128 + the signal's number, in every command and stage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with stop_signals.handled():
            return _main(argv, out)
    except KeyboardInterrupt as e:  # anywhere the commands do not catch it
        return _interrupted(argv, e)
    except BrokenPipeError:
        # `actx status RUN | head -1`: the reader has all it wanted, which is no error.
        # stdout now points at /dev/null so the interpreter's last flush stays quiet.
        if out is None or out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# What an interrupted command leaves, and what to type next, when no launcher said more.
_RESUME = {
    "status": lambda run: "nothing was written",
    "verify": lambda run: f"nothing was recorded; `{advice.verify(run)}` checks it again",
    "extract": lambda run: (f"partitions without a commit marker stay uncommitted: "
                            f"`{advice.rerun(run)}` finishes them"),
}


def _interrupted(argv: list[str], e: KeyboardInterrupt) -> int:
    """One line: which command a stop signal ended, and the command that resumes."""
    import shlex

    command = argv[0] if argv else ""
    run = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--run", "--out")),
               next((a for a in argv[1:] if not a.startswith("-")), "RUN"))
    hint = getattr(e, "hint", "") or _RESUME.get(command, lambda run: "")(run)
    if command in ("submit", "demo", "rerun") and "`" not in hint:
        # The same command (its config, its target) resumes: committed partitions are
        # kept, a prepared run is not prepared again.
        hint = (f"{hint or 'committed work is kept'}: `{shlex.join(['actx', *argv])}` "
                f"again finishes them")
    signum = stop_signals.signum_of(e)
    said = (f"actx {command}: interrupted by {stop_signals.signal_name(signum)}"
            f"{'; ' + hint if hint else ''}".replace("actx :", "actx:"))
    if command in FITTED:
        _say_error(said)
    else:
        print(said, file=sys.stderr, flush=True)
    return stop_signals.exit_code(signum)


def _say_error(text: str) -> None:
    """`text` on stderr, each line fitted to its columns (deploy.columns): submit's,
    rerun's and status's last words fit a terminal as their other lines do."""
    print("\n".join(line for part in text.split("\n")
                    for line in columns.fit(part, columns.columns(sys.stderr))),
          file=sys.stderr, flush=True)


def _main(argv: list[str] | None, out) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    if argv and argv[0] == "prepare":
        from actx.pipeline import main as pipeline_main

        from actx.deploy import preflight

        return pipeline_main.main(_staged_for_dataflow(argv[1:]), preflight=preflight.check)
    if argv and argv[0] == "extract":
        from actx.workers import main as workers_main

        return workers_main.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        args.config = None
    args.argv = ["actx", *argv]  # as typed, for hints that repeat the command
    handlers = {"submit": jobs.cmd_submit, "demo": jobs.cmd_submit, "status": cmd_status,
                "rerun": jobs.cmd_rerun, "verify": cmd_verify, "down": jobs.cmd_down}
    from actx.schemas import store_errors

    # Commands that only look at a run answer within seconds when GCS is unreachable.
    interactive = args.command in ("status", "verify", "rerun")
    if interactive:
        store_errors.set_deadline(store_errors.INTERACTIVE_DEADLINE_S)
    width = columns.columns(out)
    if width is not None and args.command in FITTED and not any(
            getattr(args, name, None) not in (None, False) for name in ("json", "serve", "html")):
        out = columns.FittedOut(out, width)  # not for a script: --json, the page's address
    try:
        return handlers[args.command](args, out)
    except errors.UserError as e:
        said = f"actx {args.command}: error: {e}"
        if args.command in FITTED:
            _say_error(said)
        else:
            print(said, file=sys.stderr)
        return 2
    finally:
        if interactive:
            store_errors.set_deadline(None)


if __name__ == "__main__":
    sys.exit(main())
