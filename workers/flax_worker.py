"""The extraction worker for a run whose model is a user's Flax NNX model (`model.flax`).

`worker_for_run` gives `workers.runner.Worker` for a Hugging Face checkpoint and
`FlaxWorker` for a Flax model. FlaxWorker is the same loop, writers and commits; only what
it runs differs: the model comes from the factory (weights placed by their own sharding
annotations), hooks are module paths, every row is seen alone (no KV cache), and packing
modes the model cannot serve are refused before anything runs.

It is `runner.Worker` with another `_load_model`.
"""

from __future__ import annotations

from actx.schemas import ts_context
from actx.schemas import worker_options
from actx.workers import admission, flax_hooks, flax_model, flax_step, runner


def worker_for_run(opts: worker_options.WorkerOptions) -> runner.Worker:
    """The worker that can run `opts.run`'s model."""
    ts_context.configure(opts.gcs_request_concurrency, opts.gcs_request_retries)
    from actx.schemas import extraction as extraction_lib
    from actx.schemas import run_dir

    opened = run_dir.open_run(opts.run)  # once: the worker takes it as it is
    spec = extraction_lib.read_spec(opened, opts.extraction or "")
    if spec.generate is not None:
        if spec.model.flax:
            from actx.workers import preflight

            raise admission.RunMismatch(f"{opts.run}: generate: {preflight.FLAX_GENERATES}")
        from actx.workers import generate_worker

        return generate_worker.GenerateWorker(opts, opened)
    return (FlaxWorker if spec.model.flax else runner.Worker)(opts, opened)


class FlaxWorker(runner.Worker):
    """`runner.Worker` whose model is a user's Flax module: only `_load_model` differs."""

    def _load_model(self) -> None:
        """The factory's module, its hooks as module paths, every row seen alone."""
        self.progress.say_phase(f"loading weights: Flax model {self.spec.model.flax}")
        self.model = flax_model.load(self.spec.model.flax, self.mesh)
        problem = flax_model.packing_problem(self.spec.packing, self.model.call,
                                             self.spec.model.flax)
        if problem:
            raise admission.RunMismatch(f"{self.location}: {problem}")
        try:
            self.capture = flax_hooks.parse_hooks(self.spec.capture.hooks, self.model.paths)
        except ValueError as e:
            raise admission.RunMismatch(f"{self.location}: capture.hooks: {e}") from e
        if self.model.vocab_size is not None and \
                self.manifest.vocab_size > self.model.vocab_size:
            raise admission.RunMismatch(
                f"tokenizer vocabulary ({self.manifest.vocab_size} ids, from "
                f"{self.spec.tokenizer.path}) is larger than the Flax model's embedding "
                f"({self.model.vocab_size} rows, {self.spec.model.flax}): tokenizer and "
                f"model do not belong together")
        self.max_context = None  # every row is seen alone (continue overflow is refused)
        self.fn = flax_step.FlaxExtractFn(self.model, self.capture, self.mesh,
                                          self.spec.capture.dtype)
        self.warmup_rows = None
        self.hooks = self.fn.hook_widths(self.manifest.seq_len)
        return None  # the model's own attention: nothing of actx's to record
