"""Token masks: the reasons to leave a token out of training, and the filter readers apply.

Reasons (REASONS), each a boolean [rows, seq_len] mask, True where the token is left out:
  special       its id is one of the tokenizer's special tokens (manifest.special_token_ids,
                recorded by prepare from the tokenizer).
  bos           its id is the BOS id, or it is the first token of its document (document
                position 0: `positions` in pad / segmented rows; in concat rows, where
                positions are columns, the token where a new document begins in the row
                with context_start 0, i.e. not a continuation from the row before).
  padding       segment_ids == 0 (always left out; named so it can be counted).
  doc_boundary  concat rows only: the two tokens on either side of a document boundary
                inside a row (the separator that closes a document and the first token of
                the next), whose context mixes documents. Empty in pad / segmented runs.
  prompt        a generating run's prompt tokens (run.json's `generate`; docs/generate.md).
  generated     a generating run's tokens the model wrote. Both read the run's
                `generated.token_ids` array; positions reserved for a sample that stopped
                before them are left out always, as padding is.
  outlier       per hook: the L2 norm of the token's activation is above `outlier_factor`
                times the hook's median norm. The norms are stored per token beside the
                hook (layout.norms_array_key) and the median in stats.json, both by
                `run.compute_stats` in the same pass that reads the activations for the
                statistics, so no second read of the activations. With several hooks a
                token is left out when it is an outlier in any of them.
The first four come from token arrays alone (a few bytes per position, read with the
token ids anyway); the counts of every reason are stored by `compute_stats` and reported
by `run.describe()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np

from actx.reader import errors
from actx.reader import stored_stats
from actx.schemas import layout

REASONS = ("special", "bos", "padding", "doc_boundary", "prompt", "generated", "outlier")
TOKEN_REASONS = REASONS[:4]
ROLE_REASONS = ("prompt", "generated")
# Norm above this many times the hook's median: the rare tokens (often the first token
# or a repeated delimiter) whose norm is orders of magnitude above the rest.
DEFAULT_OUTLIER_FACTOR = 10.0
# Token arrays each reason needs (segment_ids and input_ids are always read, first).
_NEEDS = {"special": (), "bos": ("positions", "doc_index", "context_start"),
          "padding": (), "doc_boundary": ("doc_index",), "prompt": (), "generated": (),
          "outlier": ()}


def check_exclude(exclude: "Iterable[str] | None") -> tuple[str, ...]:
    """The reasons named in `exclude`, in REASONS order; a clear error for a typo."""
    names = (exclude,) if isinstance(exclude, str) else tuple(exclude or ())
    unknown = [n for n in names if n not in REASONS]
    if unknown:
        raise ValueError(f"exclude: unknown mask {unknown[0]!r}; known: {', '.join(REASONS)}")
    return tuple(r for r in REASONS if r in names)


def check_roles(exclude: tuple[str, ...], run) -> tuple[str, ...]:
    """`exclude` (check_exclude's), refusing "prompt" or "generated" on a run that does
    not generate: there they would leave out nothing, silently."""
    roles = [r for r in exclude if r in ROLE_REASONS]
    if roles and run.spec.generate is None:
        raise ValueError(f"exclude: {roles[0]!r} tells a generating run's prompt from what "
                         f"the model wrote; {run.location} does not generate (its run.json "
                         f"has no generate section)")
    return exclude


def _doc_starts_in_row(segment_ids: np.ndarray, doc_index: np.ndarray) -> np.ndarray:
    """True where a non-padding token's document differs from the token before it in the
    row (or it is in column 0)."""
    start = np.ones(segment_ids.shape, bool)
    start[:, 1:] = doc_index[:, 1:] != doc_index[:, :-1]
    return start & (segment_ids > 0)


def token_reasons(arrays: dict[str, np.ndarray], bos_id: int | None,
                  special_ids: Sequence[int], concat: bool,
                  reasons: Sequence[str] = TOKEN_REASONS) -> dict[str, np.ndarray]:
    """Masks [rows, T] of the token reasons asked for, from token arrays of whole rows
    (segment_ids, input_ids, and what _NEEDS names)."""
    seg, inp = arrays["segment_ids"], arrays["input_ids"]
    valid = seg > 0
    out = {}
    if "special" in reasons:
        out["special"] = valid & np.isin(inp, list(special_ids)) if special_ids else \
            np.zeros(seg.shape, bool)
    if "bos" in reasons:
        if concat:
            first = _doc_starts_in_row(seg, arrays["doc_index"]) & (arrays["context_start"] == 0)
        else:
            first = valid & (arrays["positions"] == 0)
        out["bos"] = first | (valid & (inp == bos_id)) if bos_id is not None else first
    if "padding" in reasons:
        out["padding"] = ~valid
    if "doc_boundary" in reasons:
        boundary = np.zeros(seg.shape, bool)
        if concat:
            inside = _doc_starts_in_row(seg, arrays["doc_index"])
            inside[:, 0] = False
            inside[:, 1:] &= seg[:, :-1] > 0  # a document before it in the row
            boundary |= inside
            boundary[:, :-1] |= inside[:, 1:]  # and the token closing that document
        out["doc_boundary"] = boundary
    return out


@dataclasses.dataclass(frozen=True)
class TokenFilter:
    """Which tokens a reader keeps: not padding, none of the `exclude` reasons, and the
    older switches (exclude_bos: the BOS id only; exclude_special; whole_document).

    exclude_bos goes by the id alone, not the position: in `concat` packing positions are
    column indices (a row is one causal stream across documents), so a BOS that starts or
    separates documents inside a row has position > 0 and is just as much a BOS.
    whole_document keeps only tokens that attended to their whole document up to
    themselves (context_start == 0).

    `sources(run)` are the arrays to read over the same rows, in order (token arrays, a
    generating run's `generated.token_ids`, then each outlier hook's norms); `keep(values)`
    takes what was read and returns the mask.
    generates: the run generates (its unused reserved positions are always left out).
    """

    bos_id: int | None
    special_ids: tuple[int, ...]
    concat: bool
    exclude: tuple[str, ...] = ()
    exclude_bos: bool = False
    exclude_special: bool = False
    whole_document: bool = False
    norm_limits: tuple[tuple[str, float], ...] = ()  # (hook, max norm) for "outlier"
    generates: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """Token arrays read, segment_ids and input_ids first."""
        extra = {n for r in self.exclude for n in _NEEDS[r]}
        if self.whole_document:
            extra.add("context_start")
        return ("segment_ids", "input_ids") + tuple(n for n in layout.TOKEN_ARRAYS if n in extra)

    def sources(self, run, context: Any = None) -> list:
        generated = [layout.activation_array_key(layout.GENERATED_IDS)] if self.generates else []
        return ([run.open_array(layout.token_array_key(n), context) for n in self.names]
                + [run.open_array(k, context) for k in generated]
                + [run.open_array(layout.norms_array_key(h), context) for h, _ in self.norm_limits])

    def keep(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """Bool [rows, T]: the tokens kept, from the sources' values over the same rows."""
        arrays = dict(zip(self.names, values))
        seg, inp = arrays["segment_ids"], arrays["input_ids"]
        mask = seg > 0
        if self.exclude_bos and self.bos_id is not None:
            mask &= inp != self.bos_id
        if self.exclude_special and self.special_ids:
            mask &= ~np.isin(inp, list(self.special_ids))
        if self.whole_document:
            mask &= arrays["context_start"] == 0
        reasons = [r for r in self.exclude if r in TOKEN_REASONS]
        for m in token_reasons(arrays, self.bos_id, self.special_ids, self.concat,
                               reasons).values():
            mask &= ~m
        rest = values[len(self.names):]
        if self.generates:
            generated, rest = rest[0][..., 0], rest[1:]
            mask &= generated != layout.GENERATED_UNUSED
            if "prompt" in self.exclude:
                mask &= generated != layout.GENERATED_PROMPT
            if "generated" in self.exclude:
                mask &= generated < 0
        for norms, (_, limit) in zip(rest, self.norm_limits):
            mask &= ~(norms > limit)
        return mask


def token_filter(run, hooks: Sequence[str], exclude: "Iterable[str] | None" = None, *,
                 exclude_bos: bool = False, exclude_special: bool = False,
                 whole_document: bool = False,
                 outlier_factor: float = DEFAULT_OUTLIER_FACTOR,
                 partitions: Sequence[int] = ()) -> TokenFilter:
    """The filter of a reader over `hooks` and committed `partitions`; "outlier" needs
    `compute_stats` to have stored the norms of every one of those partitions."""
    exclude = check_roles(check_exclude(exclude), run)
    generates = run.spec.generate is not None
    limits = []
    if "outlier" in exclude:
        if not outlier_factor > 0:
            raise ValueError(f"outlier_factor must be positive, got {outlier_factor}")
        for h in hooks:
            s = stored_stats.load_stats(run, h)
            missing = sorted(set(partitions) - set(s.norm_partitions))
            if missing or not np.isfinite(s.norm_median):
                raise errors.ReaderError(
                    f"{run.location}: exclude=['outlier'] needs the token norms of hook "
                    f"{h!r} in partitions {missing or list(partitions)}; run "
                    f"{run.open_call()}.compute_stats([{h!r}]) after they commit")
            limits.append((h, float(outlier_factor * s.norm_median)))
    m = run.manifest
    return TokenFilter(m.bos_id, tuple(m.special_token_ids), run.spec.packing.mode == "concat",
                       exclude, exclude_bos, exclude_special, whole_document, tuple(limits),
                       generates)
