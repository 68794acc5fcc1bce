"""The options both batch readers share, as frozen groups, documented once.

`run.stream(...)` (reader.streaming.stream.ShuffledStream) and `run.batches(...)`
(reader.batches.TokenBatches) take the same keywords for the same things; the front door
(reader.run) sorts the keywords a caller passes into these groups (`from_keywords`), so
each reader's constructor takes a few groups instead of thirty loose parameters, and a
misspelt keyword is a TypeError naming the keywords there are.

TokenOptions: which tokens.
  exclude: token masks to leave out (reader.masks.REASONS: "special", "bos", "padding",
    "doc_boundary", "outlier"); outlier_factor: the "outlier" limit, in medians.
  exclude_bos / exclude_special: leave out tokens with the BOS id (anywhere in a row, also
    mid-row in concat packing) / the tokenizer's special tokens.
  whole_document: only tokens that attended to their whole document up to themselves
    (tokens/context_start == 0; see docs/run-directory.md, "What each token sees").
  partitions: committed partitions to use (default: all committed at open time).
OrderOptions: which steps, in which order, on this process.
  seed / epochs: order seed; epochs to run (None: forever).
  start_step: global step to begin at (resume: the step after the last one trained).
  process_index / process_count: this trainer's share (disjoint across processes).
  drop_last: True gives every process the same number of full batches (the tail of
    each epoch is dropped; see shuffle.ShufflePlan and blocks.StreamPlan).
OutputOptions: what a batch's activations are, and how far ahead they are made.
  framework: "numpy", "jax" or "torch"; as_jax=True is framework="jax".
  sharding: with framework="jax", a `jax.sharding.Sharding` of the global batch (see
    `formats.convert`): device-ready arrays for a sharded trainer; it must divide every
    batch, so keep drop_last=True (no short last batch).
  dtype: cast activations (e.g. "float32"); None keeps the stored dtype.
  normalize: None, "standardize" (zero mean, unit variance per dimension) or
    "sqrt_d_mean_norm" (one scale per hook: mean L2 norm sqrt(hidden), not 1;
    "unit_mean_norm" is its earlier name) with the statistics stored by
    `run.compute_stats` (float32 output; see `formats.Normalizer`).
  prefetch: batches made ahead by a background thread (0: made in the caller's thread).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from actx.reader import formats
from actx.reader import masks as masks_lib
from actx.reader import stored_stats


@dataclasses.dataclass(frozen=True)
class TokenOptions:
    """Which tokens a reader returns (see the module docstring)."""

    exclude: Sequence[str] | None = None
    outlier_factor: float = masks_lib.DEFAULT_OUTLIER_FACTOR
    exclude_bos: bool = False
    exclude_special: bool = False
    whole_document: bool = False
    partitions: Sequence[int] | None = None

    def left_out(self) -> frozenset[str]:
        """What a reader with these options leaves out besides padding, as statistics
        record it (stored_stats.left_out): what `normalize=`'s statistics should too."""
        return stored_stats.left_out(masks_lib.check_exclude(self.exclude), self.exclude_bos,
                                     self.exclude_special)


@dataclasses.dataclass(frozen=True)
class OrderOptions:
    """Which steps a reader returns, in which order (see the module docstring)."""

    seed: int = 0
    epochs: int | None = 1
    start_step: int = 0
    process_index: int = 0
    process_count: int = 1
    drop_last: bool = True


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """What a batch's activations are (see the module docstring)."""

    framework: formats.Framework = "numpy"
    as_jax: bool = False
    sharding: Any = None
    dtype: str | None = None
    normalize: str | None = None
    prefetch: int = 2

    @property
    def checked_framework(self) -> str:
        return formats.check_framework("jax" if self.as_jax else self.framework)


def hook_names(hooks: "str | Sequence[str]", run=None) -> tuple[str, ...]:
    """One hook or several, as a tuple; at least one; with `run`, as stored
    (TransformerLens names resolved: snapshot.RunSnapshot.resolve_hook)."""
    names = (hooks,) if isinstance(hooks, str) else tuple(hooks)
    if not names:
        raise ValueError("hooks: name at least one hook")
    return names if run is None else run.resolve_hooks(names)


def from_keywords(what: str, keywords: dict[str, Any], *groups: type) -> tuple:
    """One instance of each option group, built from its fields among `keywords`.

    A keyword no group has is a TypeError naming `what` and the keywords there are, as
    a misspelt keyword argument of a plain function would be."""
    left = dict(keywords)
    built = []
    for group in groups:
        names = {f.name for f in dataclasses.fields(group)}
        built.append(group(**{k: left.pop(k) for k in list(left) if k in names}))
    if left:
        known = sorted(f.name for g in groups for f in dataclasses.fields(g))
        raise TypeError(f"{what}() got unexpected keyword argument(s) "
                        f"{', '.join(map(repr, sorted(left)))}; it takes {', '.join(known)}")
    return tuple(built)
