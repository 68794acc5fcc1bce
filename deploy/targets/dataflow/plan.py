"""Prepare on Google Cloud Dataflow: the `actx prepare` command line with standard Beam
PipelineOptions (runner, project, region, temp location, setup.py staging), and the
prepare step of other targets (in-process Beam when no Dataflow is asked for)."""

from __future__ import annotations

import json
import os
import re
import sys

from actx.deploy import config as config_lib
from actx.deploy.commands import Command
from actx.deploy.targets import TargetError
from actx.deploy.targets.tpu_vm.plan import job_dir
from actx.schemas import runspec as runspec_lib

def spec_file(spec: runspec_lib.RunSpec, job: str) -> str:
    """Where submit writes the run spec that the prepare command reads: the job's own
    temporary directory (a dry run names it and writes nothing)."""
    return os.path.join(job_dir(job), f"{spec.name}-{spec.fingerprint}.json")


def write_spec_file(spec: runspec_lib.RunSpec, job: str) -> str:
    path = spec_file(spec, job)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(spec.to_json_obj(), f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def job_name(spec: runspec_lib.RunSpec, df: config_lib.DataflowConfig) -> str:
    if df.job_name:
        return df.job_name
    name = re.sub(r"[^a-z0-9-]+", "-", spec.name.lower()).strip("-") or "run"
    return f"actx-prepare-{name}-{spec.fingerprint}"


def check(run: str, df: config_lib.DataflowConfig) -> None:
    missing = [k for k in ("project", "region", "temp_location") if not getattr(df, k)]
    if missing:
        raise TargetError(f"target.dataflow: {', '.join(missing)} required to prepare on "
                          f"Dataflow")
    if not run.startswith("gs://"):
        raise TargetError(f"run {run!r}: Dataflow workers need a gs:// run directory")
    if not df.temp_location.startswith("gs://"):
        raise TargetError(f"target.dataflow.temp_location {df.temp_location!r}: must be gs://")


def staging_dir(job: str) -> str:
    """Where the plan writes the staging copy that --setup_file names
    (deploy.targets.dataflow.stage)."""
    return os.path.join(job_dir(job), "dataflow-src")


def service_args(df: config_lib.DataflowConfig, name: str, machine_type: str,
                 packages: list[str]) -> list[str]:
    """The Dataflow flags every actx job there shares (where, as whom, how many workers);
    `packages` says what the workers run (a staged setup.py, or a container image)."""
    staging = df.staging_location or f"{df.temp_location.rstrip('/')}/staging"
    args = ["--runner=DataflowRunner", f"--project={df.project}", f"--region={df.region}",
            f"--temp_location={df.temp_location}", f"--staging_location={staging}",
            *packages, f"--job_name={name}"]
    if df.max_num_workers:
        args.append(f"--max_num_workers={df.max_num_workers}")
    if machine_type:
        args.append(f"--machine_type={machine_type}")
    if df.service_account_email:
        args.append(f"--service_account_email={df.service_account_email}")
    if df.subnetwork:
        args.append(f"--subnetwork={df.subnetwork}")
    return args


def pipeline_args(spec: runspec_lib.RunSpec, df: config_lib.DataflowConfig,
                  job: str) -> list[str]:
    """Beam PipelineOptions flags for prepare on Dataflow."""
    setup_file = df.setup_file or os.path.join(staging_dir(job), "setup.py")
    return service_args(df, job_name(spec, df), df.machine_type,
                        [f"--setup_file={setup_file}"]) + list(df.extra_args)


def prepare_commands(spec: runspec_lib.RunSpec, run: str, target: config_lib.TargetConfig,
                     max_reject_fraction: float, on_dataflow: bool,
                     job: str) -> list[Command]:
    """`actx prepare` for this spec: on Dataflow (after staging actx for its workers, unless
    target.dataflow.setup_file names a setup.py), or in-process Beam (writing to `run`)."""
    base = ("actx", "prepare", "--spec", spec_file(spec, job), "--out", run,
            f"--max-reject-fraction={max_reject_fraction:g}")
    if on_dataflow:
        df = target.dataflow
        check(run, df)
        stage = [] if df.setup_file else [Command(
            (sys.executable, "-m", "actx.deploy.targets.dataflow.stage", "--out", staging_dir(job)),
            "stage actx for the Dataflow workers: its packages and a setup.py declaring what "
            "prepare imports")]
        return stage + [Command(base + tuple(pipeline_args(spec, df, job)),
                                f"prepare {run} on Dataflow (job {job_name(spec, df)})",
                                in_process=True)]
    return [Command(base + ("--runner=FnApiRunner",),
                    f"prepare {run} here (in-process Beam runner)", in_process=True)]
