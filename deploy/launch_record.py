"""`launch.json`: how the run's latest job launched its workers (target kind, hosts,
hosts per replica, batch size, devices per host, model parallelism), written by the
launcher when its workers start, so that `actx rerun RUN` with no flags and no config
launches the same way instead of with the defaults (a batch size that differs changes the
rows each device computes per step, which the run's numerics record holds the workers to).

Optional: a run without it (older runs, or prepared but never extracted) reruns with the
defaults, as before. Only settings are recorded, nothing secret (no environment, no TPU
table): a tpu-vm rerun still names its config.
"""

from __future__ import annotations

import time

from actx.schemas import layout

KEY = layout.LAUNCH_KEY
# The target fields a rerun takes from the record, which are also its flags (jobs.TARGET_FLAGS).
FIELDS = ("hosts", "hosts_per_replica", "batch_size", "devices_per_host", "model_parallel")


def record(store, config, job: str) -> None:
    """Writes the launch settings of `job` (a deploy.config.TargetConfig). Best effort: a
    run that cannot take it still extracts (the next rerun then uses the defaults)."""
    import logging

    try:
        store.write_json(KEY, {"job": job, "at": round(time.time(), 3), "target": config.kind,
                               **{name: getattr(config, name) for name in FIELDS}})
    except Exception as e:  # noqa: BLE001 - a record, not the extraction
        logging.getLogger("actx.launch").warning("could not record %s: %s", KEY, e)


def read(store) -> dict | None:
    """The recorded settings, or None (absent or unreadable: the defaults apply)."""
    try:
        data = store.read_json(KEY)
    except Exception:  # noqa: BLE001 - damaged: the defaults, as without one
        return None
    if not isinstance(data, dict):
        return None
    return data


def settings_for(recorded: dict | None, kind: str) -> dict:
    """The recorded fields that apply to a rerun on `kind` ({} when the record is of
    another target or has none): {field: value} of valid integers only."""
    if not recorded or recorded.get("target") != kind:
        return {}
    return {name: recorded[name] for name in FIELDS
            if isinstance(recorded.get(name), int) and not isinstance(recorded[name], bool)
            and recorded[name] >= 1}
