"""How well mixed a stream of batches is: distinct documents, partitions, row blocks and
rows per batch.

A streaming shuffle trades mixing for speed (a batch draws from the few blocks of one or
two buffers); these figures say how much, for a given buffer, next to the exact global
shuffle's. Documents come from tokens/doc_index (a document that continues into further
rows counts once).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from actx.reader import snapshot
from actx.reader.batches import Batch


@dataclasses.dataclass(frozen=True)
class Mixing:
    """Means per batch over `batches` batches of `tokens` tokens on average."""

    batches: int
    tokens: float
    documents: float
    partitions: float
    blocks: float
    rows: float

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "documents": self.documents,
                "partitions": self.partitions, "blocks": self.blocks, "rows": self.rows}


def measure(run: snapshot.RunSnapshot, batches: Iterable[Batch], block_rows: int | None = None
            ) -> Mixing:
    """Mixing figures of `batches` (numpy or not: only rows / cols are used).

    block_rows: the block size the blocks figure counts in (default rows_per_shard: blocks
    never straddle partitions, so block = (partition, (row - row_start) // block_rows)).
    """
    block_rows = block_rows or run.spec.layout.rows_per_shard
    starts = np.asarray([p.row_start for p in run.partitions], np.int64)
    figures = []
    for b in batches:
        rows, cols = np.asarray(b.rows), np.asarray(b.cols)
        docs = run.gather_tokens(["doc_index"], rows, cols)["doc_index"]
        part = np.searchsorted(starts, rows, side="right") - 1
        block = part * (run.total_rows + 1) + (rows - starts[part]) // block_rows
        figures.append((len(rows), len(np.unique(docs)), len(np.unique(part)),
                        len(np.unique(block)), len(np.unique(rows))))
    if not figures:
        return Mixing(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    mean = np.asarray(figures, np.float64).mean(axis=0)
    return Mixing(len(figures), *(float(x) for x in mean))
