"""Packing layouts, checked by rebuilding rows from the plan and comparing to documents."""

import numpy as np
import pytest

from actx.pipeline import pack
from actx.schemas import runspec as R


def _fill(lengths, packing, sep=0):
    plan = pack.plan_pack(lengths, packing, separator_len=sep)
    names = ("input_ids", "segment_ids", "positions", "doc_index", "context_start")
    block = {n: np.full((plan.total_rows, packing.seq_len),
                        -1 if n in ("doc_index", "context_start") else 0,
                        dtype=np.int32) for n in names}
    docs = [np.arange(1, n + 1, dtype=np.int32) + 1000 * d for d, n in enumerate(lengths)]
    for d, doc in enumerate(docs):
        ids = doc[:plan.stored_tokens[d]]
        if len(ids) < plan.stored_tokens[d]:
            ids = np.concatenate([ids, np.full(plan.stored_tokens[d] - len(ids), 7, np.int32)])
        pack.fill_rows(block, 0, plan.pieces[d], ids, d, packing=packing)
    return plan, block, docs


def test_pad_one_doc_per_row():
    plan, block, docs = _fill([3, 5, 1], R.PackingSpec("pad", 6))
    assert plan.total_rows == 3
    for d, doc in enumerate(docs):
        assert list(block["input_ids"][d, :len(doc)]) == list(doc)
        assert list(block["segment_ids"][d]) == [1] * len(doc) + [0] * (6 - len(doc))
        assert list(block["positions"][d, :len(doc)]) == list(range(len(doc)))
        assert set(block["doc_index"][d, len(doc):]) <= {-1}


def test_pad_continue_and_truncate():
    plan, block, _ = _fill([10, 2], R.PackingSpec("pad", 4, overflow="continue"))
    assert plan.total_rows == 4  # 4 + 4 + 2 | 2
    assert list(block["positions"][2, :2]) == [8, 9]  # positions keep counting in the doc
    assert list(block["doc_index"][:, 0]) == [0, 0, 0, 1]
    plan, block, _ = _fill([10, 2], R.PackingSpec("pad", 4, overflow="truncate"))
    assert plan.total_rows == 2 and plan.truncated_tokens == (6, 0)
    assert plan.stored_tokens == (4, 2)


def test_segmented_next_fit_positions_restart():
    plan, block, docs = _fill([3, 2, 4, 1], R.PackingSpec("segmented", 6))
    # row 0: d0(3) d1(2); row 1: d2(4) d3(1)
    assert plan.total_rows == 2
    assert list(block["segment_ids"][0]) == [1, 1, 1, 2, 2, 0]
    assert list(block["positions"][0]) == [0, 1, 2, 0, 1, 0]
    assert list(block["segment_ids"][1]) == [1, 1, 1, 1, 2, 0]
    assert list(block["doc_index"][1]) == [2, 2, 2, 2, 3, -1]


def test_segmented_long_doc_starts_fresh_row_and_shares_its_tail():
    plan, block, _ = _fill([2, 9, 1], R.PackingSpec("segmented", 4))
    # row 0: d0; rows 1-3: d1 (4, 4, 1); d2 joins row 3
    assert plan.total_rows == 4
    assert list(block["doc_index"][3]) == [1, 2, -1, -1]
    assert list(block["segment_ids"][3]) == [1, 2, 0, 0]


def test_segmented_block_diagonal_mask_equals_each_doc_alone():
    """Attention allowed by (same segment, causal) is exactly each document's causal mask,
    and positions are 0..n-1 per document: the model sees every document as if alone."""
    lengths = [5, 3, 7, 2, 6, 1, 8]
    plan, block, docs = _fill(lengths, R.PackingSpec("segmented", 10))
    for r in range(plan.total_rows):
        seg = block["segment_ids"][r]
        causal = np.tril(np.ones((10, 10), bool))
        mask = (seg[:, None] == seg[None, :]) & (seg[:, None] > 0) & causal
        for d in set(block["doc_index"][r]) - {-1}:
            cols = np.flatnonzero(block["doc_index"][r] == d)
            assert list(block["input_ids"][r, cols]) == list(docs[d])
            assert list(block["positions"][r, cols]) == list(range(len(docs[d])))
            sub = mask[np.ix_(cols, cols)]
            assert (sub == np.tril(np.ones((len(cols), len(cols)), bool))).all()
            others = np.setdiff1d(np.arange(10), cols)
            assert not mask[np.ix_(cols, others)].any()


def test_concat_stream_with_separator():
    plan, block, docs = _fill([3, 4, 2], R.PackingSpec("concat", 4), sep=1)
    stream = [*docs[0], 7, *docs[1], 7, *docs[2]]
    assert plan.total_rows == 3
    assert list(block["input_ids"].reshape(-1)[:len(stream)]) == stream
    assert list(block["positions"][1]) == [0, 1, 2, 3]  # column: a row is one sequence
    assert list(block["segment_ids"][2]) == [1, 2, 2, 0]  # d1 separator, d2, padding
    assert plan.stored_tokens == (4, 5, 2)


@pytest.mark.parametrize("mode", ["pad", "concat", "segmented"])
def test_every_token_placed_once(mode):
    rng = np.random.default_rng(0)
    lengths = list(rng.integers(1, 40, size=50))
    plan = pack.plan_pack(lengths, R.PackingSpec(mode, 16), separator_len=0)
    seen = set()
    for d, pieces in enumerate(plan.pieces):
        assert sum(p.length for p in pieces) == plan.stored_tokens[d] == lengths[d]
        for p in pieces:
            cells = {(p.row, c) for c in range(p.col, p.col + p.length)}
            assert not cells & seen and p.col + p.length <= 16 and p.row < plan.total_rows
            seen |= cells


def test_context_start_records_what_each_token_attended_to():
    """continue: the last max_context positions of the document; truncate: the whole kept
    document; concat: the document from its first token in the row."""
    packing = R.PackingSpec("segmented", 4, max_context=6)
    plan, block, _ = _fill([2, 11, 1], packing)
    # row 0: d0; rows 1-3: d1 (positions 0..10); d2 joins row 3
    assert list(block["context_start"][0]) == [0, 0, -1, -1]
    d1 = block["doc_index"] == 1
    expected = np.maximum(0, block["positions"][d1] - 5)
    assert list(block["context_start"][d1]) == list(expected)
    assert list(block["context_start"][3]) == [3, 4, 5, 0]  # positions 8, 9, 10 | d2
    plan, block, _ = _fill([11], R.PackingSpec("pad", 4, overflow="truncate", max_context=4))
    assert list(block["context_start"][0]) == [0, 0, 0, 0]
    plan, block, _ = _fill([3, 6], R.PackingSpec("concat", 4), sep=1)
    # stream: d0 d0 d0 sep | d1 d1 d1 d1 | d1 d1 sep? (last doc has no separator)
    assert list(block["context_start"][0]) == [0, 0, 0, 0]
    assert list(block["context_start"][1]) == [0, 0, 0, 0]
    assert list(block["context_start"][2]) == [4, 4, -1, -1]


def test_max_context_below_seq_len_is_refused():
    with pytest.raises(ValueError, match="max_context: must be at least seq_len"):
        R.PackingSpec("segmented", 8, max_context=4)
