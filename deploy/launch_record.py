"""`launch.json`: how the run's latest job launched its workers (target kind, hosts,
hosts per replica, batch size, devices per host, model parallelism, and the config file
with its --set overrides), written by the launcher when its workers start, so that
`actx rerun RUN` with no flags and no config launches the same way, on the same target,
instead of on the local defaults (a batch size that differs changes the rows each device
computes per step, which the run's numerics record holds the workers to; a Slurm run
rerun on this machine would be refused for it).

A target whose table says where its hosts are (slurm, tpu-vm: `CONFIGURED`) reruns from
the recorded config file, read again (the record keeps its path, never its contents: no
environment, no TPU table); the local target from the recorded settings alone.

Optional: a run without it (older runs, or prepared but never extracted) reruns with the
defaults, as before.
"""

from __future__ import annotations

import time

from actx.schemas import layout

KEY = layout.LAUNCH_KEY
# The target fields a rerun takes from the record, which are also its flags (jobs.TARGET_FLAGS).
FIELDS = ("hosts", "hosts_per_replica", "batch_size", "devices_per_host", "model_parallel")
# Targets whose rerun needs their config's table (where the hosts are, how they start).
CONFIGURED = ("slurm", "tpu-vm")


def record(store, config, job: str, config_file: str | None = None,
           sets: "tuple[str, ...] | list[str]" = ()) -> None:
    """Writes the launch settings of `job` (a deploy.config.TargetConfig), with the config
    file it came from (made absolute: a rerun may run from another directory) and the
    --set overrides given with it. Best effort: a run that cannot take it still extracts
    (the next rerun then uses the defaults)."""
    import logging
    import os

    where = ({"config": os.path.abspath(config_file), "set": list(sets)}
             if config_file else {})
    try:
        store.write_json(KEY, {"job": job, "at": round(time.time(), 3), "target": config.kind,
                               **{name: getattr(config, name) for name in FIELDS}, **where})
    except Exception as e:  # noqa: BLE001 - a record, not the extraction
        logging.getLogger("actx.launch").warning("could not record %s: %s", KEY, e)


def keep_unless_refused(run, previous: dict | None, job: str,
                        extractions: "list[str]") -> None:
    """After `job`'s workers ended: a job the run refused (a worker's heartbeat says
    "refused": its settings are not the run's) did not launch the run's way, so the
    record before it (`previous`; None: none) is put back, and `actx rerun RUN` launches
    as before it. `run`: the run directory (schemas.run_dir.RunDir); `extractions`:
    the job's extractions ("" the default one), whose heartbeats are their own."""
    from actx.schemas import heartbeat as heartbeat_lib

    try:
        beats = [hb for name in extractions
                 for hb in heartbeat_lib.read_heartbeats(run.extraction(name).store)]
        if not any(hb.job == job and hb.state == "refused" for hb in beats):
            return
        if previous is None:
            run.store.delete(KEY)
        else:
            run.store.write_json(KEY, previous)
    except Exception as e:  # noqa: BLE001 - a record, not the extraction
        import logging

        logging.getLogger("actx.launch").warning("could not restore %s: %s", KEY, e)


def read(store) -> dict | None:
    """The recorded settings, or None (absent or unreadable: the defaults apply)."""
    try:
        data = store.read_json(KEY)
    except Exception:  # noqa: BLE001 - damaged: the defaults, as without one
        return None
    if not isinstance(data, dict):
        return None
    return data


def kind_of(recorded: dict | None) -> str | None:
    """The target kind the run last launched on (None: no record, or a damaged one)."""
    kind = (recorded or {}).get("target")
    return kind if isinstance(kind, str) and kind else None


def config_of(recorded: dict | None) -> tuple[str | None, list[str]]:
    """(the recorded config file, its --set overrides); (None, []) when none is recorded."""
    path = (recorded or {}).get("config")
    sets = (recorded or {}).get("set")
    if not isinstance(path, str) or not path:
        return None, []
    return path, [s for s in sets if isinstance(s, str)] if isinstance(sets, list) else []


def settings_for(recorded: dict | None, kind: str) -> dict:
    """The recorded fields that apply to a rerun on `kind` ({} when the record is of
    another target or has none): {field: value} of valid integers only."""
    if not recorded or recorded.get("target") != kind:
        return {}
    return {name: recorded[name] for name in FIELDS
            if isinstance(recorded.get(name), int) and not isinstance(recorded[name], bool)
            and recorded[name] >= 1}
