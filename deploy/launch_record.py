"""`launch.json`: how the run's latest job launched its workers (target kind, hosts,
hosts per replica, batch size, devices per host, model parallelism, models at once, and
the config file with its --set overrides), written by the launcher when its workers start, so that
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
# models_at_once: only how fast a run of several extractions goes (the bytes are the same),
# absent from records written before it (a rerun of such a run takes one at a time).
FIELDS = ("hosts", "hosts_per_replica", "batch_size", "devices_per_host", "model_parallel",
          "models_at_once")
# Targets whose rerun needs their config's table (where the hosts are, how they start).
CONFIGURED = ("slurm", "tpu-vm")


def record(store, config, job: str, config_file: str | None = None,
           sets: "tuple[str, ...] | list[str]" = (),
           extractions: "list[str] | None" = None) -> None:
    """Writes the launch settings of `job` (a deploy.config.TargetConfig), with the config
    file it came from (made absolute: a rerun may run from another directory) and the
    --set overrides given with it, the job's extractions ("" the default one; None: the
    default alone) and the record it replaces (`previous`, what `read` answered): a job
    the run refuses did not launch the run's way, and its workers may say so long after
    this command ended (a detached job), so `read` looks for that. Best effort: a run that
    cannot take it still extracts (the next rerun then uses the defaults)."""
    import logging
    import os

    where = ({"config": os.path.abspath(config_file), "set": list(sets)}
             if config_file else {})
    try:
        previous = read(store)
        store.write_json(KEY, {"job": job, "at": round(time.time(), 3), "target": config.kind,
                               **{name: getattr(config, name) for name in FIELDS}, **where,
                               "extractions": list(extractions or [""]),
                               "previous": previous})
    except Exception as e:  # noqa: BLE001 - a record, not the extraction
        logging.getLogger("actx.launch").warning("could not record %s: %s", KEY, e)


def read(store) -> dict | None:
    """The settings of the run's latest launch the run did not refuse, or None (none, or
    unreadable: the defaults apply). The record of a job that a worker refused (its
    heartbeat says "refused": its settings are not the run's) gives way to the record
    before it (`previous`; a record written before actx kept one stands as it is)."""
    try:
        data = store.read_json(KEY)
    except Exception:  # noqa: BLE001 - damaged: the defaults, as without one
        return None
    if not isinstance(data, dict):
        return None
    if "previous" not in data:
        return data
    previous = data.pop("previous")
    if _refused(store, data.get("job"), data.get("extractions")):
        return previous if isinstance(previous, dict) else None
    return data


def in_launch_order(store, names: list[str]) -> list[str]:
    """`names` (extractions, "" the default) in the order the run's latest launch took
    them (a submit's: its config's), those it did not take after, as given."""
    record = read(store) or {}
    taken = record.get("extractions")
    taken = [n for n in taken if isinstance(n, str)] if isinstance(taken, list) else []
    rank = {name: i for i, name in enumerate(taken)}
    return sorted(names, key=lambda n: rank.get(n, len(rank)))


def _refused(store, job, extractions) -> bool:
    """Whether a worker of `job` (of any of its `extractions`, whose heartbeats are their
    own) says the run refused it."""
    from actx.schemas import extraction_store
    from actx.schemas import heartbeat as heartbeat_lib

    names = [n for n in extractions if isinstance(n, str)] if isinstance(
        extractions, list) else [""]
    try:
        return any(hb.job == job and hb.state == "refused" for name in names
                   for hb in heartbeat_lib.read_heartbeats(
                       extraction_store.view(store, name), history=False))
    except Exception:  # noqa: BLE001 - unreadable heartbeats: the record stands
        return False


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
