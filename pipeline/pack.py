"""Packing: where each document's tokens go in the fixed-shape [rows, seq_len] arrays.

Pure Python over document lengths only, in document order, so the layout is a
deterministic function of (lengths, packing spec). Prepare packs each pack group (one file,
or one block of its lines; `pipeline.pack_group`) on its own, rows numbered from 0, and
shifts them into place afterwards. Modes (docs/ARCHITECTURE.md, docs/run-directory.md):
  pad        each document starts a new row; the rest of the row is padding.
  concat     documents (each followed by a separator, except the last) form one stream cut
             into rows; positions are the column (a row is one causal sequence).
  segmented  next-fit in document order: a document goes into the current row if it fits,
             else starts a new row; segment ids number documents within a row and positions
             restart at 0 per document, so a block-diagonal causal mask reproduces each
             document run alone.
A document longer than a row (pad, segmented) starts a fresh row and continues into the
following rows ("continue"; positions keep counting inside the document) or is cut at
seq_len ("truncate"; the dropped tokens are counted). Its rows are consecutive and full
except the last, so a worker finds a continuation row by its column 0 (a segment whose
position is > 0) and the document's first row `positions[r, 0] // seq_len` rows above.
What each token attended to is written beside it (`context_start`, see schemas.layout).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from actx.schemas import runspec as runspec_lib


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of one document's tokens in one row.

    row, col: where it starts in the arrays; doc_start: offset of its first token in the
    document's (packed) tokens; length: tokens; segment_id: 1.. within the row;
    position_start: `positions` value of its first token (then +1 per token).
    """

    row: int
    col: int
    doc_start: int
    length: int
    segment_id: int
    position_start: int


@dataclasses.dataclass(frozen=True)
class PackState:
    """Where packing stands between two documents: the current row, its filled columns and
    the segments already in it. Packing a group's documents in one call, or unit by unit
    from each unit's start state, gives the same pieces (`plan_pack`)."""

    row: int = 0
    used: int = 0
    segments: int = 0

    @property
    def rows(self) -> int:
        """Rows begun so far (the current one counts once it holds a token)."""
        return self.row + (1 if self.used else 0)


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """pieces[d]: where document d goes; stored_tokens[d] / truncated_tokens[d]: its counts.

    total_rows: rows begun from the start of the group (earlier units' rows included);
    end: the state after the last document, where the next unit of the group resumes.
    """

    total_rows: int
    pieces: tuple[tuple[Piece, ...], ...]
    stored_tokens: tuple[int, ...]
    truncated_tokens: tuple[int, ...]
    end: PackState = PackState()


def _split_long(length: int, row: int, seq_len: int, truncate: bool) -> tuple[list[Piece], int]:
    """Pieces of a document starting at column 0 of `row`; returns (pieces, next free row)."""
    if truncate:
        length = min(length, seq_len)
    pieces = [Piece(row + i, 0, start, min(seq_len, length - start), 1, start)
              for i, start in enumerate(range(0, length, seq_len))]
    return pieces, row + len(pieces)


def plan_pack(lengths: Sequence[int], packing: runspec_lib.PackingSpec,
              separator_len: int = 0, start: PackState = PackState(),
              last: bool = True) -> PackPlan:
    """Lays out documents of the given token counts, in order, from `start`.

    separator_len: tokens appended after every document but the group's last (concat
    only); last: these documents end their group (else the last one gets a separator too).
    """
    seq_len, mode = packing.seq_len, packing.mode
    truncate = packing.overflow == "truncate"
    all_pieces, stored, truncated = [], [], []
    if mode == "concat":
        cursor = start.row * seq_len + start.used  # position in the group's stream
        in_row = start.segments  # document runs already in the cursor's row
        for d, n in enumerate(lengths):
            n_packed = n + (0 if last and d + 1 == len(lengths) else separator_len)
            pieces, done = [], 0
            while done < n_packed:
                row, col = divmod(cursor, seq_len)
                in_row = 1 if col == 0 else in_row + 1  # segment ids number runs per row
                take = min(n_packed - done, seq_len - col)
                pieces.append(Piece(row, col, done, take, in_row, col))
                done += take
                cursor += take
            all_pieces.append(tuple(pieces))
            stored.append(n_packed)
            truncated.append(0)
        row, used = divmod(cursor, seq_len)
        end = PackState(row, used, in_row if used else 0)
        return PackPlan(end.rows, tuple(all_pieces), tuple(stored), tuple(truncated), end)

    row, used, segments_in_row = start.row, start.used, start.segments
    for n in lengths:
        kept = min(n, seq_len) if truncate else n
        if mode == "pad" or kept > seq_len or used + kept > seq_len:
            if used:
                row, used, segments_in_row = row + 1, 0, 0
        if kept > seq_len:
            pieces, row = _split_long(kept, row, seq_len, truncate=False)
            last_piece = pieces[-1]
            row -= 1  # the last piece's row may take further documents (segmented)
            used, segments_in_row = last_piece.length, 1
        else:
            segments_in_row += 1
            pieces = [Piece(row, used, 0, kept, segments_in_row, 0)]
            used += kept
        if mode == "pad":
            row, used, segments_in_row = row + 1, 0, 0
        all_pieces.append(tuple(pieces))
        stored.append(kept)
        truncated.append(n - kept)
    end = PackState(row, used, segments_in_row)
    return PackPlan(end.rows, tuple(all_pieces), tuple(stored), tuple(truncated), end)


def context_start(piece: Piece, packing: runspec_lib.PackingSpec) -> np.ndarray:
    """int32 [piece.length]: the first document position each token of `piece` attends to.

    concat: the row is one causal stream, so the document is seen from its first token in
    the row. truncate: the whole (kept) document. continue: the last max_context tokens.
    """
    if packing.mode == "concat":
        return np.full(piece.length, piece.doc_start, np.int32)
    doc_positions = np.arange(piece.doc_start, piece.doc_start + piece.length, dtype=np.int32)
    if packing.overflow == "truncate":
        return np.zeros(piece.length, np.int32)
    return np.maximum(0, doc_positions - (packing.max_context - 1)).astype(np.int32)


def fill_rows(block: dict[str, np.ndarray], row_offset: int, pieces: Sequence[Piece],
              token_ids: np.ndarray, doc_index: int,
              extra: dict[str, np.ndarray] | None = None, *,
              packing: runspec_lib.PackingSpec) -> None:
    """Writes a document's pieces into a partition block (arrays [rows, seq_len]).

    token_ids: the document's packed tokens; extra: per-token arrays (e.g. ARC attributes)
    of the same length, written into the block arrays of the same names.
    """
    for p in pieces:
        r, c0, c1 = p.row - row_offset, p.col, p.col + p.length
        block["input_ids"][r, c0:c1] = token_ids[p.doc_start:p.doc_start + p.length]
        block["segment_ids"][r, c0:c1] = p.segment_id
        block["positions"][r, c0:c1] = np.arange(p.position_start, p.position_start + p.length)
        block["doc_index"][r, c0:c1] = doc_index
        block["context_start"][r, c0:c1] = context_start(p, packing)
        for name, values in (extra or {}).items():
            block[name][r, c0:c1] = values[p.doc_start:p.doc_start + p.length]


def packed_ids(token_ids: np.ndarray, stored: int, separator_id: int | None) -> np.ndarray:
    """The document's tokens as packed: truncated, or followed by the separator (the
    reference for one document; prepare's writers do all documents at once)."""
    if stored <= len(token_ids):
        return token_ids[:stored]
    return np.concatenate([token_ids, np.full(stored - len(token_ids), separator_id,
                                              dtype=token_ids.dtype)])
