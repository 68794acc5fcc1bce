"""The options of an extraction worker process, defined once.

`ExtractSettings` are the choices of a whole job (a submit config's `target` table holds
them under the same names); `WorkerOptions` adds where one process stands in the job. The
worker's flags (`actx extract --help`) and the argv a launcher builds both derive from these
classes through `schemas.flags`, so a new option is one field here.
"""

from __future__ import annotations

import dataclasses

from actx.schemas import flags


@dataclasses.dataclass(frozen=True)
class ExtractSettings:
    """How the workers of a job extract.

    batch_size: rows per step for the whole replica (split evenly over its hosts). With
      the device kind, model_parallel and the jax version it forms the numerics key: the
      bytes a step produces depend on them, so every attempt at a run must share them.
    model_parallel: size of the `model` mesh axis (tensor parallelism within a host).
    steal: after its own partitions, take uncommitted partitions of other replicas.
    allow_numerics_change: accept a device kind / jax version / rows per device / model
      parallelism other than the run's first attempt used (reruns then rewrite partitions
      with slightly different bytes; markers stay true).
    prefetch_depth: token batches read ahead of the device.
    steps_in_flight: steps dispatched to the devices whose outputs the host has not yet
      handled (written into blocks); 1 runs a step only after the previous one's outputs
      are handled.
    writer_threads: threads writing shard blocks to storage.
    max_pending_mb: MB of shard blocks waiting for storage before the loop waits.
    heartbeat_s: seconds between heartbeats (workers/<host>.json).
    stop_check_steps: multi-host replicas agree on a SIGTERM every this many steps (the
      agreement is a collective; one-host replicas check every step for free).
    gcs_request_concurrency: tensorstore's concurrent GCS requests per process.
    gcs_request_retries: tensorstore's retries of a failed GCS request.
    models_at_once: named extractions (several models over one token store) a worker
      process extracts at the same time, each model in device memory beside the others;
      1 extracts them one after another, one model in memory at a time. More than one run
      together only where they fit in device memory together (measured as each loads;
      the rest wait their turn) and within one-host replicas (workers/loop/model_groups.py).
    """

    batch_size: int = 8
    model_parallel: int = 1
    steal: bool = False
    allow_numerics_change: bool = False
    prefetch_depth: int = 4
    steps_in_flight: int = 2
    writer_threads: int = 4
    max_pending_mb: int = 2048
    heartbeat_s: float = 2.0
    stop_check_steps: int = 16
    gcs_request_concurrency: int = 32
    gcs_request_retries: int = 8
    models_at_once: int = 1

    def __post_init__(self):
        at_least = {"batch_size": 1, "model_parallel": 1, "prefetch_depth": 1,
                    "writer_threads": 1, "max_pending_mb": 1, "stop_check_steps": 1,
                    "gcs_request_concurrency": 1, "gcs_request_retries": 0,
                    "models_at_once": 1}
        wrong = [f"{name} must be at least {least}, got {getattr(self, name)}"
                 for name, least in at_least.items() if getattr(self, name) < least]
        if not self.heartbeat_s > 0:
            wrong.append(f"heartbeat_s must be more than 0, got {self.heartbeat_s}")
        if wrong:  # every one at once, before anything starts
            raise ValueError("; ".join(wrong))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerOptions(ExtractSettings):
    """One worker process: the job's settings and this process's place in the job.

    run: the run directory (local path, gs://bucket/path or memory://name).
    replicas: independent replicas in the job.
    replica: this process's replica index (0 .. replicas - 1).
    job: id shared by the processes of one job (scopes work-stealing claims and logs).
    expect_fingerprint: refuse the run unless run.json has this fingerprint.
    host_name: name of this process's heartbeat (default: machine name and process id).
    coordinator: host:port of process 0 of this replica (multi-host replicas; default
      ACTX_COORDINATOR).
    num_processes: hosts in this replica (default ACTX_NUM_PROCESSES or 1).
    process_id: this host's index in the replica (default ACTX_PROCESS_ID or 0).
    only: extract only these partition ids (default: all that belong to the replica).
    extraction: which of the run's extractions (schemas.extraction) to extract: None the
      default one (the root run.json's model; "default" in a list), a name, several names
      separated by commas (extracted one after another, one model in memory at a time),
      or "all".
    """

    run: str
    replicas: int = 1
    replica: int = 0
    job: str = "job"
    expect_fingerprint: str | None = None
    host_name: str | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    only: tuple[int, ...] | None = None
    extraction: str | None = None

    @classmethod
    def for_job(cls, settings: ExtractSettings, **placement) -> "WorkerOptions":
        """The options of one process of a job run with `settings` (`placement` gives the
        process's own fields, and may override a setting)."""
        values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(ExtractSettings)}
        values.update(placement)
        if values.get("only") is not None:
            values["only"] = tuple(values["only"])
        return cls(**values)

    def to_argv(self) -> list[str]:
        """This process's flags for `actx extract` / `python -m actx.workers.main`."""
        # models_at_once at 1 (one model after another) is left out: it is what a worker
        # of an actx from before the setting does, and such a worker would refuse the flag.
        at_once = ("models_at_once",) if self.models_at_once == 1 else ()
        return ["--run", self.run, *flags.to_argv(self, exclude=("run", *at_once))]
