"""Pre-flight for a job whose model is a user's Flax NNX model (`model.flax`): the factory
imports and returns an nnx.Module (and the spec's tokenizer, if the factory names one), its
`__call__` can serve the packing, and every hook names an existing submodule. The module is built abstractly (`nnx.eval_shape`): no weights
are allocated on the submitting machine.
"""

from __future__ import annotations

from actx.schemas import parallelism
from actx.schemas import runspec as runspec_lib
from actx.workers.flax import hooks as flax_hooks, model as flax_model
from actx.workers.job_check import JobCheck


def check_job(spec: runspec_lib.RunSpec, batch_size: int | None = None,
              data_parallel: int | None = None) -> JobCheck:
    """What the workers would refuse about a Flax job, one line each (see preflight)."""
    problems: list[str] = []
    split = None if batch_size is None else parallelism.devices_problem(
        batch_size, data_parallel, lead=f"batch_size={batch_size} does not")
    if split:
        problems.append(split)
    try:
        flax_model.import_nnx()
    except flax_model.FlaxMissing as e:
        problems.append(f"spec.model.flax: {e}")
        return JobCheck(tuple(problems))
    try:
        module, tokenizer = flax_model.build(spec.model.flax, abstract=True)
    except Exception as e:  # the user's code: any error means it cannot be loaded
        problems.append(f"spec.model.flax: {spec.model.flax}: {type(e).__name__}: {e}")
        return JobCheck(tuple(problems))
    if tokenizer is not None and tokenizer.rstrip("/") != spec.tokenizer.path.rstrip("/"):
        problems.append(f"spec.tokenizer.path: {spec.model.flax} names its tokenizer "
                        f"{tokenizer!r}, the spec {spec.tokenizer.path!r}; set "
                        f"spec.tokenizer.path to {tokenizer!r}")
    problem = flax_model.packing_problem(spec.packing, flax_model.CallSignature.of(module),
                                         spec.model.flax)
    if problem:
        problems.append(f"spec.{problem}")
    try:
        flax_hooks.parse_hooks(spec.capture.hooks, flax_model.module_paths(module))
    except ValueError as e:
        problems.append(f"spec.capture.hooks: {e}")
    return JobCheck(tuple(problems), flax_model.vocab_size(module))
