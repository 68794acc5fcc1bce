"""Pre-flight: everything about a job that can be checked before any work starts, listed at
once. `actx submit` and `actx prepare` run it before they prepare, create or launch
anything, so a typo costs seconds, not a prepared token store and a provisioned slice.

It checks the model's config.json (local or gs://) and architecture, hooks and layer
ranges, the context length, whether the tokenizer is the model's
(schemas.tokenizer_identity), the input paths, the batch
against the target's devices, and the target's own settings (`Target.problems`,
deploy/targets/__init__.py) and what of the spec it cannot run (`Target.spec_problems`: a
generating run through Beam or on a replica of several hosts). In a dry run, inputs it
cannot reach (no credentials on this machine) or that are not there yet are named as not
checked instead of refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actx.deploy import targets
from actx.schemas import errors
from actx.schemas import layout as layout_lib
from actx.schemas import runspec as runspec_lib
from actx.schemas import store_errors
from actx.schemas import tokenizer_identity

if TYPE_CHECKING:  # imported where used: not every command opens a run
    from actx.schemas import run_dir


class PreflightError(errors.UserError):
    """The job cannot run as configured; the message lists every problem found."""


def target_problems(run: str, target) -> tuple[list[str], int | None]:
    """(problems of the target's settings, the replica's data-parallel size if known):
    `Target.problems` of the target that `target` (a Target or its TargetConfig) is."""
    return targets.as_target(target).problems(run)


def _prepared_for(run: "str | run_dir.RunDir", spec: runspec_lib.RunSpec) -> bool:
    """Whether `run` already holds this spec's token store (its inputs are then not
    needed again)."""
    from actx.schemas import run_dir

    try:
        return run_dir.RunDir.at(run).is_prepared_for(spec, tokens_only=True)
    except Exception:  # unreadable: prepare will say so
        return False


def problems(spec: runspec_lib.RunSpec, run: "str | run_dir.RunDir", target=None,
             dry_run: bool = False) -> tuple[list[str], list[str]]:
    """(problems, notes): what is wrong, and what a dry run could not check from here."""
    from actx.pipeline import preflight as pipeline_preflight
    from actx.schemas import run_dir
    from actx.workers import preflight as workers_preflight

    run = run_dir.RunDir.at(run)

    found: list[str] = []
    notes: list[str] = []
    batch = data_parallel = None
    model_parallel = 1
    if target is not None:
        target = targets.as_target(target)
        target_found, data_parallel = target.problems(run.uri)
        found += target_found + target.spec_problems(spec)
        batch, model_parallel = target.config.batch_size, target.config.model_parallel

    def unreachable(what: str, e: Exception) -> None:
        if not dry_run:
            if found:  # what was found without the store, with why the rest was not
                raise PreflightError(f"{len(found) + 1} problems, nothing was started:\n  "
                                     + "\n  ".join([*found, str(e)]))
            raise e
        notes.append(f"{what} not checked: {e}")

    def absent(lines) -> None:
        # A dry run may show the commands before the data and checkpoint are uploaded.
        (notes if dry_run else found).extend(
            f"not found yet: {line}" if dry_run else line for line in lines)

    if target is not None and not spec.model.path and not spec.model.flax:
        found.append("spec.model.path: empty; extraction needs a Hugging Face checkpoint "
                     "directory (config.json + *.safetensors), local or gs://, or a Flax "
                     "model as spec.model.flax")
    if target is not None:
        notes += _padding_notes(spec, target)
    job = workers_preflight.check_job(spec, batch, model_parallel, data_parallel)
    found += job.problems
    notes += job.notes
    absent(job.missing)
    if job.unreachable is not None:
        unreachable("the model", job.unreachable)
    tokenizer = None
    try:
        if not _prepared_for(run, spec):
            input_problems, input_missing, tokenizer = pipeline_preflight.check_inputs(spec)
            found += input_problems
            absent(input_missing)
        else:  # the token store stands, but the model may be another one now
            tokenizer = tokenizer_identity.read_tokenizer(spec.tokenizer.path)
    except store_errors.StoreError as e:
        unreachable("the inputs and tokenizer", e)
    if tokenizer is not None and job.vocab_size is not None and spec.model.flax:
        # A Flax model has no checkpoint directory to compare with: its embedding only.
        if tokenizer.vocab_size > job.vocab_size:
            found.append(
                f"spec.tokenizer.path: its vocabulary ({tokenizer.vocab_size} ids) is larger "
                f"than the model's embedding ({job.vocab_size} rows, {spec.model.flax}); "
                f"tokenizer and model do not belong together")
    elif tokenizer is not None and job.vocab_size is not None:
        try:
            found += tokenizer_identity.match_problems(
                tokenizer, spec.tokenizer.path, spec.model.path, job.vocab_size,
                allowed=spec.tokenizer.allow_model_mismatch)
        except store_errors.StoreError as e:
            unreachable("the model's tokenizer", e)
    return found, notes


def _padding_notes(spec: runspec_lib.RunSpec, target) -> list[str]:
    """A layout whose partitions leave hosts of a multi-host replica without rows (a
    partition is split over them by whole objects; the others pad): what share of the
    replica's steps pad, and the partition size that keeps every host busy."""
    try:
        hosts, replicas = target.hosts_and_replicas()
    except Exception:  # noqa: BLE001 - a target the pre-flight refuses already, saying why
        return []
    per_replica = hosts // max(1, replicas)
    rows, rps = spec.layout.partition_rows, spec.layout.rows_per_shard
    share = layout_lib.padding_share(rows, rps, per_replica) if per_replica > 1 else 0.0
    if share <= 0:
        return []
    return [f"spec.layout: a partition's {-(-rows // rps)} object(s) of {rps} rows are "
            f"split over the {per_replica} hosts of a replica by whole objects, so "
            f"{share:.0%} of their steps are padding; set spec.layout.partition_rows to a "
            f"multiple of {per_replica * rps} ({per_replica} hosts x {rps} rows) to keep "
            f"every host busy"]


# A dry run may run where the job's bucket cannot be reached (no credentials, no network):
# it gives each remote read this long, then names what it could not check.
DRY_RUN_DEADLINE_S = 3.0


def check(spec: runspec_lib.RunSpec, run: "str | run_dir.RunDir", target=None,
          dry_run: bool = False, out=None) -> None:
    """Raises PreflightError listing every problem; prints dry-run notes to `out`."""
    import contextlib

    bound = store_errors.deadline(DRY_RUN_DEADLINE_S) if dry_run else contextlib.nullcontext()
    with bound:
        found, notes = problems(spec, run, target, dry_run)
    for note in notes:
        if out is not None:
            print(f"# pre-flight: {note}", file=out)
    if found:
        raise PreflightError(
            found[0] if len(found) == 1 else
            f"{len(found)} problems, nothing was started:\n  " + "\n  ".join(found))
