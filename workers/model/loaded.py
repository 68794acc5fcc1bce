"""A model loaded for extraction, as one value: what `runner.Worker.load_model` returns.

The worker's loop, its admission checks and `model_groups` read the model only through a
`LoadedModel`; a model family that loads differently (a user's Flax module,
`workers.flax.worker`; a generating run, `workers.generate.worker`) overrides that one
method and returns its own `LoadedModel`, instead of setting attributes on the worker.
`load_checkpoint` is the loading of a Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from actx.schemas import manifest as manifest_lib
from actx.schemas import runspec
from actx.schemas import worker_options
from actx.workers.loop import admission, schedule, transfer


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model on the mesh with its step, and what the worker needs to know of them.

    model: the loaded model (its `config` and `digest` go into the run's checks).
    capture: the parsed hooks (`capture.CaptureSpec`, or a Flax model's module paths).
    fn: the extract step (`step.ExtractFn` or `flax_step.FlaxExtractFn`); None for a
      generating worker, whose steps are its own (`workers.generate.worker`).
    hooks: each stored hook's width (name -> width), in the order the step returns them.
    max_context: the tokens of context a slot's KV cache carries from row to row; None when
      every row is seen alone (concat, truncate, a Flax model).
    warmup_rows: the rows before a host's slice that a long document needs to warm the
      cache (`schedule.warmup_rows`); None without a cache.
    attention: the attention implementation the step runs, for the numerics record; None
      when it is the model's own (a Flax model).
    """

    model: Any
    capture: Any
    fn: Any
    hooks: dict[str, int]
    max_context: int | None = None
    warmup_rows: int | None = None
    attention: str | None = None


def load_weights(spec: runspec.RunSpec, manifest: manifest_lib.Manifest, mesh,
                 loading: Callable[[str, str], None]):
    """(model, capture): the run's capture spec and its Hugging Face checkpoint on the mesh,
    after refusing a tokenizer whose vocabulary is not the model's. What extraction
    (`load_checkpoint`) and generation (`generate_worker`) load alike."""
    from actx.workers.model import capture as capture_lib
    from actx.workers.model import decoder as model_lib

    capture = capture_lib.CaptureSpec.parse(spec.capture.hooks, dtype=spec.capture.dtype)
    loading(spec.model.path, spec.model.path)
    model = model_lib.load_pretrained(spec.model.path, dtype=spec.model.dtype, mesh=mesh)
    admission.check_vocabulary(spec, manifest, model.config)
    return model, capture


def load_checkpoint(jax, spec: runspec.RunSpec, manifest: manifest_lib.Manifest, mesh,
                    opts: worker_options.WorkerOptions,
                    loading: Callable[[str, str], None]) -> LoadedModel:
    """Loads the run's Hugging Face checkpoint onto the mesh and builds its extract step;
    refuses a tokenizer that is not the model's and a context that does not fit.
    loading(what, path) says that weights are loading (`runner.Worker.loading`)."""
    from actx.workers.model import capture as capture_lib
    from actx.workers.model import step as step_lib

    model, capture = load_weights(spec, manifest, mesh, loading)
    cfg = model.config
    packing = spec.packing
    # Long documents carry their context from row to row through a slot's KV cache;
    # concat and truncate rows are independent and run without one.
    max_context = packing.max_context if packing.carries_context else None
    fn = step_lib.make_extract_fn(model, capture, mesh, max_context=max_context,
                                  output_memory_kind=transfer.output_memory_kind(jax))
    warmup_rows = None if max_context is None else schedule.model_warmup_rows(
        cfg.window_per_layer, fn.layers_run, max_context, manifest.seq_len)
    admission.check_context_fits(jax, spec, model, fn, mesh, opts.batch_size,
                                 opts.model_parallel, manifest.seq_len, max_context)
    return LoadedModel(model=model, capture=capture, fn=fn,
                       hooks=capture_lib.hook_widths(cfg, fn.hook_names),
                       max_context=max_context, warmup_rows=warmup_rows,
                       attention=fn.attention_implementation(manifest.seq_len))
