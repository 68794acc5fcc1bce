"""What the workers would refuse about a job, found before any work starts: without JAX,
without reading weights, from the checkpoint's config.json and safetensors headers (local
or gs://).

`actx submit` and `actx prepare` call `check_job` (through `workers.main`) before they
prepare or create anything, so a misspelled hook or a layer beyond the model costs a
second, not a prepared token store and a provisioned slice.
"""

from __future__ import annotations

import dataclasses

from actx.schemas import layout
from actx.schemas import parallelism
from actx.schemas import position_limits
from actx.schemas import quantised
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import store_errors
from actx.workers.model import capture as capture_lib
from actx.workers.model import checkpoint_check
from actx.workers.model import config as model_config_lib
from actx.workers.model import families
from actx.workers.job_check import JobCheck


def check_job(spec: runspec_lib.RunSpec, batch_size: int | None = None,
              model_parallel: int = 1, data_parallel: int | None = None) -> JobCheck:
    """The model, hooks, context length and batch split of a job.

    data_parallel: devices the replica's batch is split over (None: not known here).
    """
    if spec.model.flax:  # a user's Flax model: its own checks (workers.flax.preflight)
        from actx.workers.flax import preflight as flax_preflight

        found = flax_preflight.check_job(spec, batch_size, data_parallel)
        if spec.generate is not None:  # as workers.flax.worker.worker_for_run refuses it
            found = dataclasses.replace(found, problems=found.problems + (
                f"spec.generate: {FLAX_GENERATES}",))
        return found
    problems: list[str] = []
    missing: list[str] = []
    capture = None
    try:
        capture = capture_lib.CaptureSpec.parse(spec.capture.hooks, dtype=spec.capture.dtype)
    except ValueError as e:
        problems.append(f"spec.capture.hooks: {e}")
    # `actx prepare` may run without a model (its path is then only recorded, empty).
    # What needs no model (hook syntax, the batch) is checked even when it cannot be read.
    config = unreachable = None
    try:
        config = _model_config(spec.model.path, problems, missing) if spec.model.path else None
        if config is not None:
            weight_problems, weights_missing = checkpoint_check.problems(spec.model.path,
                                                                         config)
            problems += weight_problems
            missing += weights_missing
    except store_errors.StoreError as e:
        unreachable = e
    if config is not None:
        if capture is not None:
            try:
                capture.validate(config)
            except ValueError as e:
                problems.append(f"spec.capture.hooks: {e}")
        if config.learned_positions:
            problems += [f"spec.{p}" for p in position_limits.learned_position_problems(
                spec.packing, config.max_position_embeddings, config.architecture,
                spec.model.path, spec.generate is not None)]
        else:
            context = position_limits.context_problem(
                spec.packing, config.max_position_embeddings, spec.model.path)
            if context:
                problems.append(f"spec.{context}")
        if spec.packing.carries_context and config.rope.has_long_factors:
            problems.append(
                f"spec.packing.max_context={spec.packing.max_context}: "
                f"{config.architecture}'s longrope takes its long factors for a whole "
                f"document longer than original_max_position_embeddings="
                f"{config.rope.original_max_position_embeddings}, which rows of a long "
                f"document seen through the KV cache cannot know; set packing.overflow: "
                f"truncate (with any packing.mode), so each document is computed alone "
                f"within its row")
        heads = parallelism.heads_problem(config.num_heads, model_parallel)
        if heads:
            problems.append(f"model_parallel={heads}")
        problems += generate_problems(spec, config)
    if batch_size is not None and batch_size < 1:
        problems.append(f"batch_size={batch_size}: must be at least 1")
    elif batch_size is not None:
        split = parallelism.devices_problem(batch_size, data_parallel,
                                            lead=f"batch_size={batch_size} does not")
        if split:
            problems.append(split)
    notes = generate_notes(spec) if config is not None and unreachable is None else []
    return JobCheck(tuple(problems), config.vocab_size if config is not None else None,
                    tuple(missing), unreachable, tuple(notes))


@dataclasses.dataclass(frozen=True)
class HookShapes:
    """What a job's capture stores and computes, by the workers' own rules, before it runs
    (`actx submit --dry-run`).

    hooks: {hook name: (values per token, stored dtype)}, as the workers will record them
      in activations/actx.json; {} where not known.
    blocks: decoder blocks the forward runs for those hooks (capture.blocks_run); None
      where not known.
    config: the checkpoint's ModelConfig, whose sizes bound the forward's FLOPs
      (deploy.cost_bound); None where not known.
    why: why they are not known ("" where they are).
    """

    hooks: dict[str, tuple[int, str]]
    blocks: int | None = None
    config: model_config_lib.ModelConfig | None = None
    why: str = ""


# Why a user's Flax model cannot generate (the pre-flight and the worker say the same).
FLAX_GENERATES = ("a user's Flax model (model.flax) cannot generate in actx yet (its call "
                  "takes no KV cache); use a Hugging Face checkpoint (model.path)")


def generate_notes(spec: runspec_lib.RunSpec) -> list[str]:
    """What the checkpoint's generation_config.json sets that HF `generate` would apply
    and actx's generator does not (workers.generate.config.unapplied)."""
    from actx.workers.generate import config as generate_config

    if spec.generate is None:
        return []
    store = store_lib.open_store(spec.model.path)  # the model's checkpoint, not the run
    where = f"{spec.model.path.rstrip('/')}/generation_config.json"
    try:
        data = store.read_json("generation_config.json") or {}
    except Exception:  # noqa: BLE001 - unreadable: nothing HF would apply from it either
        return []
    return generate_config.unapplied(data, spec.generate.temperature == 0, where,
                                     spec.generate.repetition_penalty)


def generate_problems(spec: runspec_lib.RunSpec, config) -> list[str]:
    """What a generating run asks that this model cannot do (stop ids beyond its
    vocabulary, a longrope model whose factors a growing text cannot know); the spec's own
    checks (generate_spec.GenerateSpec, RunSpec) came first."""
    gen = spec.generate
    if gen is None:
        return []
    problems = []
    outside = [t for t in gen.stop_token_ids or () if t >= config.vocab_size]
    if outside:
        problems.append(f"spec.generate.stop_token_ids: {outside} outside the model's "
                        f"vocabulary of {config.vocab_size} ids")
    if config.rope.has_long_factors:
        problems.append(f"spec.generate: {config.architecture}'s longrope switches to its "
                        f"long factors once a text outgrows original_max_position_embeddings"
                        f"={config.rope.original_max_position_embeddings}, which a text "
                        f"still being generated cannot know; use a checkpoint whose long and "
                        f"short factors are equal")
    return problems


def hook_shapes(spec: runspec_lib.RunSpec) -> HookShapes:
    """The job's hooks, blocks run and model config from the checkpoint's config.json (one
    read), or HookShapes({}, why=why not): what `actx submit --dry-run` sizes and bounds
    before anything runs."""
    if spec.model.flax:
        return HookShapes({}, why="a Flax model's hooks are known once it loads")
    if not spec.model.path:
        return HookShapes({}, why="no checkpoint directory (spec.model.path) to read the "
                                  "widths from")
    problems: list[str] = []
    missing: list[str] = []
    try:
        capture = capture_lib.CaptureSpec.parse(spec.capture.hooks, dtype=spec.capture.dtype)
        config = _model_config(spec.model.path, problems, missing)
    except Exception as e:  # noqa: BLE001 - the pre-flight has said what is wrong
        return HookShapes({}, why=f"the model's config.json could not be read ({e})")
    if config is None:
        return HookShapes({}, why=(problems + missing)[0])
    names = capture.hook_names(config.num_layers,
                                  capture_lib.router_layers_of(config))
    widths = capture_lib.hook_widths(config, names)
    dtypes = capture_lib.hook_dtypes(names, spec.capture.dtype) or {}
    # Each stored array: a float8 hook's values in their stored type, and its scales.
    shapes = quantised.stored_arrays(widths, {name: dtypes.get(name, spec.capture.dtype)
                                              for name in names})
    if spec.generate is not None:  # the ids the model writes, stored beside the hooks
        shapes[layout.GENERATED_IDS] = (1, "int32")
    return HookShapes(shapes, capture.blocks_run(
        config.num_layers, capture_lib.router_layers_of(config)), config)


def recorded_model_facts(spec: runspec_lib.RunSpec) -> tuple[str | None, str | None]:
    """(architecture, transformer_lens_differs) as a worker records them in
    activations/actx.json (workers.loop.runner), from the checkpoint's config.json: a
    multimodal checkpoint's text tower, and why TransformerLens's model of it differs;
    (None, None) for a Flax model or a config that cannot be read (what
    deploy.info_rebuild writes into a rebuilt record)."""
    if spec.model.flax or not spec.model.path:
        return None, None
    try:
        config = _model_config(spec.model.path, [], [])
    except Exception:  # noqa: BLE001 - unreachable: not known
        return None, None
    if config is None:
        return None, None
    arch = getattr(config, "architecture", None)
    return (arch if isinstance(arch, str) else None,
            capture_lib.transformer_lens_difference(config))


def _model_config(path: str, problems: list[str], missing: list[str]):
    """The checkpoint's ModelConfig, or None with the reason added to `problems`."""
    where = f"{path.rstrip('/')}/config.json"
    try:
        # The model's checkpoint, not the run.
        data = store_lib.open_store(path).read_json("config.json")
    except store_errors.StoreError:
        raise  # no credentials or no network: one clear line, not a list of guesses
    except Exception as e:  # unreadable JSON, a path that is not a directory
        problems.append(f"spec.model.path: {where} cannot be read ({e})")
        return None
    if data is None:
        missing.append(f"spec.model.path: {where} not found; point spec.model.path at a "
                       f"Hugging Face checkpoint directory (config.json + *.safetensors)")
        return None
    try:
        return families.config_from_hf(data, source=where)
    except ValueError as e:
        problems.append(f"spec.model.path: {e}")
    except (KeyError, TypeError) as e:
        problems.append(f"spec.model.path: {where}: missing or malformed field {e}")
    return None


@dataclasses.dataclass(frozen=True)
class StorageCadences:
    """What a worker reads of the token store each step and how often it lists the run,
    as the modules that do it define them (the dry run's request estimate,
    deploy.storage_plan).

    step_inputs: the token arrays each step reads (workers.loop.prefetch).
    refresh_s: seconds a chooser reuses its listing of commits, claims and heartbeats
      (workers.replicas.choice_policy).
    continuation_inputs: those of step_inputs read whole for a host's slice before its
      steps where the model carries context (prefetch.TokenStore.continuation_flags).
    cache_bytes: a process's tensorstore cache, which keeps the token chunks it read
      (schemas.ts_context).
    """

    step_inputs: tuple[str, ...]
    refresh_s: float
    continuation_inputs: tuple[str, ...] = ()
    cache_bytes: int = 0


def storage_cadences() -> StorageCadences:
    from actx.schemas import ts_context
    from actx.workers.loop import prefetch
    from actx.workers.replicas import choice_policy

    return StorageCadences(tuple(prefetch.STEP_INPUTS), choice_policy.REFRESH_S,
                           tuple(prefetch.CONTINUATION_INPUTS),
                           ts_context.DEFAULT_CACHE_BYTES)


def warmup_rows(spec: runspec_lib.RunSpec, shapes: HookShapes, seq_len: int) -> int | None:
    """The rows before a partition that a document continued into it runs first, as the
    workers compute them (workers.model.loaded: the model's windows over the blocks it
    runs, at packing.max_context); None where rows are independent (no context carried) or
    the model's config is not known here."""
    from actx.workers.loop import schedule

    packing = spec.packing
    if not packing.carries_context or shapes.config is None or shapes.blocks is None:
        return None
    return schedule.model_warmup_rows(shapes.config.window_per_layer, shapes.blocks,
                                      packing.max_context, seq_len)
