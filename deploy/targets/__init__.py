"""Where a job runs: one interface that the pre-flight, `actx submit`, `actx rerun` and
`actx down` call, one module per target behind it:

  local    deploy/targets/local.py            prepare here, then worker processes here, or
                                              Beam's local runners (`target.extract: beam`)
  tpu-vm   deploy/targets/tpu_vm/target.py    a TPU VM slice through gcloud; detached workers
  dataflow deploy/targets/dataflow/target.py  prepare on Dataflow; with `extract: beam`,
                                              extraction on Dataflow's GPU or TPU workers too
  slurm    deploy/targets/slurm/target.py     a Slurm cluster: an sbatch array, one job step
                                              per replica; detached workers

Beside them, deploy/targets/beam.py: extraction through Beam (`target.extract: beam`), on
the local target's runners or on Dataflow's workers.

`KINDS` below is the one list of them (a new target registers there and nowhere else).

The commands do what every target shares (the config, the pre-flight, the extractions'
records, choosing the partitions); a target does what only it knows (where prepare runs,
how workers start and are followed, which lease holds the run, what `down` deletes).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, ClassVar

from actx.schemas import errors
from actx.schemas import run_dir
from actx.schemas import runspec as runspec_lib


class UsageError(errors.UserError):
    """Bad input: printed as one line, exit code 2."""


class TargetError(errors.UserError, ValueError):
    """A target's settings lack something it needs, or ask for what cannot be."""


def refuse(kind: str, problems: list[str]) -> None:
    """Raises TargetError naming every problem of the `kind` target's settings at once;
    returns when there are none."""
    if problems:
        raise TargetError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems with the {kind} target:\n  "
                          + "\n  ".join(problems))


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """The command's flags that decide how a launch goes (not what it extracts)."""

    dry_run: bool = False
    join: bool = False  # local: run beside the job that holds the run
    wait: bool = False  # tpu-vm: follow the detached workers until the job ends
    install: bool = True  # tpu-vm: install actx on the hosts before starting
    recreate: bool = False  # tpu-vm: delete the slice and request it again first
    stale_after_s: float = 60.0
    config: str = "CONFIG"  # the submit config's path, as printed hints name it
    sets: tuple[str, ...] = ()  # the --set overrides given with it

    @property
    def config_file(self) -> str | None:
        """The config file this launch came from (None: none, as in the demo)."""
        return None if self.config == "CONFIG" else self.config

    @classmethod
    def from_args(cls, args) -> "LaunchOptions":
        """From a command's flags; the ones it lacks keep their defaults (submit always
        installs on the slice; rerun with --install)."""
        return cls(dry_run=getattr(args, "dry_run", False), join=getattr(args, "join", False),
                   wait=getattr(args, "wait", False), install=getattr(args, "install", True),
                   recreate=getattr(args, "recreate", False),
                   stale_after_s=(60.0 if getattr(args, "stale_after", None) is None
                                  else args.stale_after),
                   config=getattr(args, "config", None) or "CONFIG",
                   sets=tuple(getattr(args, "set", None) or ()))


@dataclasses.dataclass(frozen=True)
class Job:
    """One launch of extraction on a run.

    run: the run directory (schemas.run_dir.RunDir), made once by the command and passed
      down; a run_dir.OpenedRun once prepare has made the run (`opened()`). Its store
      opens at first use: a target that never touches the run, like Dataflow's, never
      opens it (a bucket needs credentials here). `run.uri` is what crosses into the
      workers' argv or Beam.
    fingerprint: the RunSpec fingerprint the workers must find (None for named
      extractions: each is checked against its own spec).
    only: the partitions to extract (None: every uncommitted one).
    extraction: the workers' --extraction ("base,chat"; None: the default extraction).
    """

    run: run_dir.RunDir
    name: str
    fingerprint: str | None
    only: list[int] | None = None
    extraction: str | None = None

    def opened(self) -> "Job":
        """This job with its run opened (after prepare made it), over the same store."""
        return dataclasses.replace(self, run=self.run.opened())


@dataclasses.dataclass(frozen=True)
class Prepare:
    """What `actx submit` prepares: the spec, the reject threshold, the command line a
    reject abort prints (with the fraction that passes), and `records`: what writes this
    job's own records into the run (the named extractions' specs), which a target calls
    once it holds the run's job lease, before prepare, so a submit refused by the lease
    writes nothing."""

    spec: runspec_lib.RunSpec
    max_reject_fraction: float
    retry_argv: list[str]
    records: Callable[[], None] | None = None

    def write_records(self) -> None:
        if self.records is not None:
            self.records()


def job_name(prefix: str, given: str | None) -> str:
    """The job's name: the one given (--job), else `<prefix>-<time>`."""
    return given or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def show_plan(plan, out, spec_file: str | None = None) -> int:
    """--dry-run: prints the plan's commands exactly, runs nothing, writes nothing (the spec
    file a prepare step names, `spec_file`, is written only when the plan runs); 0."""
    from actx.deploy import commands

    print("# dry run: nothing is executed."
          + (f" The run spec would be in {spec_file}." if spec_file else ""), file=out)
    print(commands.render_plan(plan), file=out, flush=True)
    return 0


def prepare_in_process(retry_argv: list[str] | None):
    """How a plan runs its `actx prepare` steps: in this process (the pipeline's entry
    point), so that a reject abort prints `retry_argv` with the fraction that passes."""
    if retry_argv is None:
        return None

    def run(cmd) -> int:
        from actx.pipeline import main as pipeline_main

        return pipeline_main.main(list(cmd.argv[2:]), retry_argv=retry_argv)

    return run


class Target:
    """A place that prepares and extracts runs. Subclasses set `kind` and implement
    `submit` and `rerun`; `problems` and `down` have defaults."""

    kind: ClassVar[str]

    def __init__(self, config):
        self.config = config  # deploy.config.TargetConfig

    # -- pre-flight ---------------------------------------------------------------------
    def problems(self, run: str) -> tuple[list[str], int | None]:
        """(problems of the target's settings for `run`, the data-parallel size of one
        replica if this target knows it; the pre-flight checks the batch against it)."""
        return [], None

    def beam_extract_problem(self, runs_workers: str) -> list[str]:
        """The refusal of `target.extract: "beam"` by a target whose hosts run the workers
        themselves (`runs_workers` says who: "a TPU slice"); nothing for extract: workers."""
        if self.config.extract != "beam":
            return []
        return [f'target.extract: "beam" runs on Beam runners (kind "local" or "dataflow"); '
                f'{runs_workers} runs the workers themselves']

    def spec_problems(self, spec: runspec_lib.RunSpec) -> list[str]:
        """What this target cannot run of `spec` with its settings (the pre-flight and
        `actx rerun` ask, before anything is prepared or started); by default nothing."""
        return []

    # -- launching ------------------------------------------------------------------------
    def submit(self, job: Job, prepare: Prepare, opts: LaunchOptions, out) -> int:
        """Prepares `job.run` (unless it is prepared for this spec) and extracts it."""
        raise NotImplementedError

    def rerun(self, job: Job, opts: LaunchOptions, out) -> int:
        """Extracts `job.only` of the prepared run `job.run` (an OpenedRun)."""
        raise NotImplementedError

    # -- down -----------------------------------------------------------------------------
    def down(self, run: str | None, opts: LaunchOptions, out) -> int:
        """Deletes what `submit` created for this target; by default nothing was created."""
        raise UsageError(
            f"{opts.config}: target.kind is {self.kind!r}; actx down deletes the TPU slice "
            f"that `actx submit` created for a tpu-vm target, and this config has none. "
            + self.stop_hint())

    def stop_hint(self) -> str:
        """How this target's work stops, for `actx down`'s refusal."""
        return ""

    # -- hardware -------------------------------------------------------------------------
    def peak_flops(self) -> tuple[float, str] | tuple[None, str]:
        """(peak FLOP/s of all the accelerators this target's settings name, what they are)
        or (None, why not): the dry run's bound on a target it cannot time from here
        (deploy.cost_bound). By default the target names none."""
        return None, f"the {self.kind} target has no accelerator table here"

    def hosts_and_replicas(self) -> tuple[int, int]:
        """(worker hosts, replicas) this target's settings start: what the dry run's storage
        estimate counts requests for. By default the `target` table's hosts and replicas."""
        return self.config.hosts, self.config.replicas

    def log_every_s(self) -> float | None:
        """Seconds between copies of each host's log into the run (None: a launcher copies
        them once, at the end)."""
        return None


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of target, as the registry lists it.

    name: `target.kind` in a config and `--target` on the command line.
    module / cls: the Target subclass that runs it, imported only when chosen, so that a
      command for one target never imports another's (the local launcher, gcloud plans).
    table: its own settings table under `target` (a field of deploy.config.TargetConfig;
      None: it has none).
    detached: its workers outlive the command that starts them (a DetachedTarget), which
      `--wait` follows; the others run their workers under the command.
    """

    name: str
    module: str
    cls: str
    table: str | None = None
    detached: bool = False


# The one list of targets: `--target`'s choices (deploy/cli.py), the config's allowed
# `target.kind` (deploy/config.py) and `for_config` all read it.
KINDS = {k.name: k for k in (
    Kind("local", "actx.deploy.targets.local", "LocalTarget"),
    Kind("tpu-vm", "actx.deploy.targets.tpu_vm.target", "TpuVmTarget", "tpu", detached=True),
    Kind("dataflow", "actx.deploy.targets.dataflow.target", "DataflowTarget", "dataflow"),
    Kind("slurm", "actx.deploy.targets.slurm.target", "SlurmTarget", "slurm", detached=True),
)}
NAMES = tuple(KINDS)
DETACHED = tuple(k.name for k in KINDS.values() if k.detached)


def for_config(config) -> Target:
    """The target that `config.kind` names (deploy.config.TargetConfig)."""
    import importlib

    kind = KINDS[config.kind]
    return getattr(importlib.import_module(kind.module), kind.cls)(config)


def as_target(target) -> Target:
    """`target` as a Target: itself, or the one its TargetConfig names."""
    return target if isinstance(target, Target) else for_config(target)
