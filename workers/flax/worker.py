"""The extraction worker for a run whose model is a user's Flax NNX model (`model.flax`).

`worker_for_run` gives `workers.loop.runner.Worker` for a Hugging Face checkpoint and
`FlaxWorker` for a Flax model. FlaxWorker is the same loop, writers and commits; only what
it runs differs: the model comes from the factory (weights placed by their own sharding
annotations), hooks are module paths, every row is seen alone (no KV cache), and packing
modes the model cannot serve are refused before anything runs.

It is `runner.Worker` with another `load_model`, which returns a `loaded_model.LoadedModel`.
"""

from __future__ import annotations

from actx.schemas import ts_context
from actx.schemas import worker_options
from actx.workers.flax import hooks as flax_hooks, model as flax_model, step as flax_step
from actx.workers.loop import admission, runner
from actx.workers.model import loaded as loaded_model


def worker_for_run(opts: worker_options.WorkerOptions, opened=None) -> runner.Worker:
    """The worker that can run `opts.run`'s model; `opened`: the run as the process opened
    it (a run_dir.OpenedRun, after `ts_context.configure`), else opened here."""
    from actx.schemas import extraction as extraction_lib
    from actx.schemas import run_dir

    if opened is None:  # once: the worker takes it as it is
        ts_context.configure(opts.gcs_request_concurrency, opts.gcs_request_retries)
        opened = run_dir.open_run(opts.run)
    spec = extraction_lib.read_spec(opened, opts.extraction or "")
    if spec.generate is not None:
        if spec.model.flax:
            from actx.workers import preflight

            raise admission.RunMismatch(f"{opts.run}: generate: {preflight.FLAX_GENERATES}")
        from actx.workers.generate import worker as generate_worker

        return generate_worker.GenerateWorker(opts, opened)
    return (FlaxWorker if spec.model.flax else runner.Worker)(opts, opened)


class FlaxWorker(runner.Worker):
    """`runner.Worker` whose model is a user's Flax module: only `load_model` differs."""

    def load_model(self) -> loaded_model.LoadedModel:
        """The factory's module, its hooks as module paths, every row seen alone."""
        self.progress.say_phase(f"loading weights: Flax model {self.spec.model.flax}")
        return load_flax(self.spec, self.manifest, self.mesh, self.location)


def load_flax(spec, manifest, mesh, location) -> loaded_model.LoadedModel:
    """The run's Flax model on the mesh with its step; refuses packing modes the model
    cannot serve, hooks it does not have and a tokenizer larger than its embedding."""
    model = flax_model.load(spec.model.flax, mesh)
    problem = flax_model.packing_problem(spec.packing, model.call, spec.model.flax)
    if problem:
        raise admission.RunMismatch(f"{location}: {problem}")
    try:
        capture = flax_hooks.parse_hooks(spec.capture.hooks, model.paths)
    except ValueError as e:
        raise admission.RunMismatch(f"{location}: capture.hooks: {e}") from e
    if model.vocab_size is not None and manifest.vocab_size > model.vocab_size:
        raise admission.RunMismatch(
            f"tokenizer vocabulary ({manifest.vocab_size} ids, from "
            f"{spec.tokenizer.path}) is larger than the Flax model's embedding "
            f"({model.vocab_size} rows, {spec.model.flax}): tokenizer and "
            f"model do not belong together")
    fn = flax_step.FlaxExtractFn(model, capture, mesh, spec.capture.dtype)
    # Every row is seen alone (continue overflow is refused): no cache, no warm-up rows;
    # the model's own attention: nothing of actx's to record.
    return loaded_model.LoadedModel(model=model, capture=capture, fn=fn,
                                    hooks=fn.hook_widths(manifest.seq_len),
                                    max_context=None, warmup_rows=None, attention=None)
