"""What pre-flight found about a job (workers.preflight for a checkpoint,
workers.flax.preflight for a user's Flax model; both return it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class JobCheck:
    """problems: one line each, naming the field and what to do (empty: all is well).
    vocab_size: the model's embedding rows, when its config.json could be read.
    missing: what was not found (a dry run may run before the checkpoint is uploaded).
    notes: what the job does otherwise than HF would (a generation_config.json setting the
    generator does not apply), printed before it starts."""

    problems: tuple[str, ...]
    vocab_size: int | None = None
    missing: tuple[str, ...] = ()  # the checkpoint's config.json is not where it says
    unreachable: Exception | None = None  # the model could not be read (no credentials...)
    notes: tuple[str, ...] = ()  # what is done otherwise than one might expect, said
