"""A generating run's documents: each prompt becomes `samples_per_prompt` documents, its
tokens followed by `max_new_tokens` positions reserved for what the model writes.

The reserved positions hold the pad id in `tokens/input_ids` and are packed, numbered and
given context like any document tokens, so every later stage (partitions, rows, the
workers' slots, commits, the reader's row space) treats a sample as one document; the
workers write the generated ids and their activations into those positions
(docs/generate.md). The doc table says where the prompt ends (`prompt_tokens`) and which
sample a document is (`sample`).

A record (an input line, an ARC task with its variants) any of whose prompts leaves no room
for max_new_tokens within packing.max_context is rejected whole, with its reason, so the
manifest's counts still reconcile by records.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actx.pipeline import sources
from actx.pipeline import tokenize
from actx.schemas import generate_spec
from actx.schemas import runspec as runspec_lib


def sample_documents(docs: list[tokenize.TokenizedDoc], spec: runspec_lib.RunSpec,
                     rejects: list) -> list[tokenize.TokenizedDoc]:
    """`docs` as the token store holds them: unchanged for a run that does not generate;
    else every sample of every prompt with its room, and `rejects` extended."""
    gen = spec.generate
    if gen is None:
        return docs
    room = spec.packing.max_context - gen.max_new_tokens
    refused: dict[tuple, str] = {}
    for doc in docs:
        n = len(doc.token_ids)
        if n == 0:
            refused.setdefault(doc.key[:3], "an empty prompt: generation needs a token to "
                                            "start from")
        elif n > room:
            refused.setdefault(doc.key[:3], (
                f"a prompt of {n} tokens leaves no room for generate.max_new_tokens="
                f"{gen.max_new_tokens} within packing.max_context={spec.packing.max_context}; "
                f"raise max_context or lower max_new_tokens"))
    out = []
    for doc in docs:
        record = doc.key[:3]
        if record in refused:
            if refused[record] is not None:  # one reject per record
                rejects.append(_reject(doc, spec, refused[record]))
                refused[record] = None
            continue
        out.extend(_samples(doc, gen, spec.packing.pad_id))
    return out


def _samples(doc: tokenize.TokenizedDoc, gen: generate_spec.GenerateSpec, pad_id: int):
    n, reserve = len(doc.token_ids), gen.max_new_tokens
    ids = np.concatenate([doc.token_ids, np.full(reserve, pad_id, np.int32)])
    attrs = None if doc.arc_attrs is None else np.concatenate(
        [doc.arc_attrs, np.full((doc.arc_attrs.shape[0], reserve), -1, np.int32)], axis=1)
    for s in range(gen.samples_per_prompt):
        yield dataclasses.replace(
            doc, key=(*doc.key[:3], doc.key[3] * gen.samples_per_prompt + s), token_ids=ids,
            arc_attrs=attrs, meta={**doc.meta, "prompt_tokens": n, "sample": s})


def _reject(doc: tokenize.TokenizedDoc, spec: runspec_lib.RunSpec, reason: str
            ) -> sources.Reject:
    line_kind = "row" if "row" in doc.meta else "line"
    return sources.Reject(doc.key[0], spec.source_name(doc.key[0]), doc.key[1], doc.key[2],
                          line_kind, f"generate: {reason}")
