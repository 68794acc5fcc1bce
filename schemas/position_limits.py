"""What to change when a run's rows or documents pass a model's positions: a context
(packing.max_context) beyond max_position_embeddings, or a position beyond a table of
learned position embeddings (GPT-2's n_positions).

In schemas because prepare (which must not import the workers) refuses these before its
work when it can read the model's config.json, and the workers' pre-flight and admission
refuse them again from the checkpoint they load: one rule and one line of advice for all.
"""

from __future__ import annotations

from actx.schemas import runspec as runspec_lib


def context_problem(packing: runspec_lib.PackingSpec, limit: int, model_path: str
                    ) -> str | None:
    """What to change when a document's context (packing.max_context, which is at least
    seq_len) is longer than the model's max_position_embeddings (`limit`; 0: not given).
    The setting to lower is seq_len when a row alone is too long (max_context cannot go
    below it), max_context only when it alone is too large."""
    if not (packing.carries_context and limit and packing.max_context > limit):
        return None
    where = (f"the model's max_position_embeddings={limit} "
             f"({model_path.rstrip('/')}/config.json)")
    if packing.seq_len > limit:
        return (f"packing.seq_len={packing.seq_len} is larger than {where}: set "
                f"packing.seq_len to at most {limit}{_and_max_context(packing, limit)}")
    return (f"packing.max_context={packing.max_context} is larger than {where}: set "
            f"packing.max_context to at most {limit} (and at least "
            f"seq_len={packing.seq_len})")


def learned_position_problems(packing: runspec_lib.PackingSpec, limit: int,
                              architecture: str, model_path: str,
                              generates: bool = False) -> list[str]:
    """What to change where a token's position in its document could pass a model's
    learned position embeddings (`limit` of them): a row longer than the table, or a
    document continued across rows (its positions grow with its length, which no setting
    bounds). Positions are never clamped or wrapped: HF has no value for them.
    generates: a generating run, whose prompt and answer fit packing.max_context (a
    longer prompt is rejected at prepare), so max_context bounds every position."""
    where = (f"{architecture}'s learned position embeddings end at "
             f"n_positions={limit} ({model_path.rstrip('/')}/config.json)")
    found = []
    if packing.seq_len > limit:
        found.append(f"packing.seq_len={packing.seq_len}: {where}; set packing.seq_len to "
                     f"at most {limit}")
    if generates:
        if packing.max_context > limit:
            found.append(f"packing.max_context={packing.max_context}: {where}, and a prompt "
                         f"with its answer may take max_context positions; set "
                         f"packing.max_context to at most {limit}")
    elif packing.carries_context:
        found.append(f"packing.overflow={packing.overflow!r}: {where}, and a document "
                     f"continued across rows would pass them; set packing.overflow: "
                     f"truncate (each document's first packing.seq_len tokens, the rest "
                     f"counted in the manifest)")
    return found


def _and_max_context(packing: runspec_lib.PackingSpec, limit: int) -> str:
    """The rest of the seq_len advice: whether max_context must come down too (its default,
    max(DEFAULT_MAX_CONTEXT, seq_len), is beyond a model of fewer positions)."""
    if packing.max_context > packing.seq_len or limit < runspec_lib.DEFAULT_MAX_CONTEXT:
        return (f" and packing.max_context to at most {limit} (its default is "
                f"max({runspec_lib.DEFAULT_MAX_CONTEXT}, seq_len))")
    return f" (and packing.max_context, if you set it, to at most {limit})"
