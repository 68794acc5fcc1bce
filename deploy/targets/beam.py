"""Extraction through Beam (`target.extract: beam`): the `ExtractPartitions` transform of
adapters/beam_extract.py, on Beam's local runners (a child process with the local target's
devices) or on Dataflow GPU or TPU workers (a custom SDK container with actx and JAX for
the accelerator, deploy/containers/). Status, rerun and verify work on such runs as on
any other: the workers write the same heartbeats, data and markers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from actx.deploy import config as config_lib
from actx.deploy.commands import Command
from actx.schemas import advice
from actx.schemas import runspec as runspec_lib
from actx.schemas import worker_options

if TYPE_CHECKING:  # imported where used: not every command opens a run
    from actx.schemas import run_dir

CONTAINERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "containers")
LOCAL_RUNNER_ARGS = ("--runner=FnApiRunner",)


def _worker_argv(run: str, target: config_lib.TargetConfig, fingerprint: str | None,
                 job: str, only, extraction: str | None = None) -> list[str]:
    opts = worker_options.WorkerOptions.for_job(
        target, run=run, job=job, only=only, expect_fingerprint=fingerprint, steal=False,
        extraction=extraction)
    return opts.to_argv()


def local_command(run: str, target: config_lib.TargetConfig, fingerprint: str | None,
                  job: str, only=None, extraction: str | None = None) -> list[str]:
    """The extraction pipeline on Beam's local runners (target.beam_args, default the
    in-process FnApiRunner); `extraction`: the run's extractions to extract, one pipeline
    after another (None: the default one)."""
    return [sys.executable, "-m", "actx.adapters.beam_extract",
            *_worker_argv(run, target, fingerprint, job, only, extraction),
            *(target.beam_args or LOCAL_RUNNER_ARGS)]


def run_local(run: "str | run_dir.RunDir", target: config_lib.TargetConfig,
              fingerprint: str | None, job: str, only=None, out=sys.stdout,
              progress_s: float = 3.0, extraction: str | None = None) -> int:
    """Runs the pipeline in a child process with the local target's devices, showing the
    run's progress (a line per extraction); returns its exit code (0: every selected
    partition committed). `run`: the run directory (its location goes into the pipeline's
    argv).

    Beam's local runners wait forever for a worker process that died (SIGKILL, out of
    memory): the heartbeats of this job tell, and the pipeline is stopped with one line
    naming the dead process (deploy.dead_workers)."""
    from actx.deploy import dead_workers, local
    from actx.deploy.status import job_progress
    from actx.deploy.status import progress_line
    from actx.schemas import extraction as extraction_lib
    from actx.schemas import run_dir

    run = run_dir.RunDir.at(run)
    names = extraction_lib.parse(extraction)
    log_dir, upload = local.log_dir(run, job)
    log_path = os.path.join(log_dir, "beam.log")
    argv = local_command(run.uri, target, fingerprint, job, only, extraction)
    print(f"extract: job {job} through Beam ({' '.join(target.beam_args or LOCAL_RUNNER_ARGS)}); "
          f"log in {log_path}", file=out, flush=True)
    dead: list = []
    with open(log_path, "w") as log_file:
        # Its own process group: the runner's worker processes are stopped with it.
        proc = subprocess.Popen(argv, env=local.worker_env(target), cwd=config_lib.code_path(),
                                stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        shown, gone_since = progress_line.ProgressLine(out), {}
        progress = job_progress.JobProgress(run, names)

        def find_dead(views):  # progress is best effort; the pipeline decides
            dead[:] = [(name, hb) for name, h in views.items()
                       for hb in dead_workers.find(h.store, job, gone_since.setdefault(
                           name, {}), grace_s=max(30.0, 3 * target.heartbeat_s))]

        try:
            while proc.poll() is None:
                time.sleep(progress_s)
                make = progress.poll(also=find_dead)
                shown.show(make, force=proc.poll() is not None)  # the last line always
                if dead and proc.poll() is None:
                    _stop_group(proc)
                    break
        except KeyboardInterrupt:  # SIGINT or SIGTERM: the runner's workers stop too
            _stop_group(proc)
            raise
        finally:
            shown.end()
    if upload:
        local.upload_logs(run, job, log_dir, out)
    if dead:
        for name, hb in dead:
            local.mark_dead(run, hb.host, None, extraction=name,
                            how="died (killed, or out of memory): its runner never reported it")
        print(f"extract: Beam worker process "
              f"{'; '.join(dead_workers.describe(hb) for _, hb in dead)} "
              f"died, and Beam's local runner would wait for it forever: the pipeline was "
              f"stopped. Nothing partial was committed; `{advice.rerun(run.uri)}` finishes the "
              f"run",
              file=out, flush=True)
        return 1
    if proc.returncode != 0:
        from actx.deploy import commands

        print(f"extract: the Beam pipeline failed ({commands.describe_exit(proc.returncode)});"
              f" last lines of {log_path}:\n{local.tail(log_path)}", file=out, flush=True)
    return 0 if proc.returncode == 0 else 1  # 1: a worker failed, whatever ended it


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the pipeline's process group, SIGKILL to what is left after `grace_s`."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            # The group's other members (the runner's workers) may outlive its leader.
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return


def job_name(spec: runspec_lib.RunSpec) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", spec.name.lower()).strip("-") or "run"
    return f"actx-extract-{name}-{spec.fingerprint}"


def problems(run: str, target: config_lib.TargetConfig) -> list[str]:
    """What extraction on Dataflow needs that the target lacks."""
    df = target.dataflow
    found = [f"target.dataflow.{k}: required to extract on Dataflow" for k in
             ("project", "region", "temp_location", "sdk_container_image",
              "extract_accelerator") if not getattr(df, k)]
    if not run.startswith("gs://"):
        found.append(f"run {run!r}: Dataflow workers need a gs:// run directory")
    return found


def dataflow_command(spec: runspec_lib.RunSpec, run: str, target: config_lib.TargetConfig,
                     job: str, only=None, extraction: str | None = None) -> Command:
    """The exact launch command of extraction on Dataflow GPU or TPU workers.

    The workers run the custom SDK container (built from deploy/containers/), which holds
    actx and JAX for the accelerator, so nothing is staged; `extract_accelerator` becomes
    Dataflow's worker_accelerator service option (GPU: "type:nvidia-l4;count:1;
    install-nvidia-driver"; TPU: "type:tpu-v5-lite-podslice;topology:1x1").
    """
    from actx.deploy.targets.dataflow import plan as dataflow

    df = target.dataflow
    beam = dataflow.service_args(
        df, job_name(spec), df.extract_machine_type,
        [f"--sdk_container_image={df.sdk_container_image}", "--sdk_location=container"])
    beam.append(f"--dataflow_service_options=worker_accelerator={df.extract_accelerator}")
    argv = ("python3", "-m", "actx.adapters.beam_extract",
            *_worker_argv(run, target, None if extraction else spec.fingerprint, job, only,
                          extraction), *beam,
            *target.beam_args)
    return Command(argv, f"extract {run} on Dataflow workers with {df.extract_accelerator} "
                         f"(job {job_name(spec)})")
