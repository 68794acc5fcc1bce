"""The per-query key intervals (workers.attention.key_ranges) against the masks they replace.

Random documents are packed by the real packer (`pad` and `segmented`, overflow
"continue"), run through the worker's chain schedule, and the slots' caches are kept step
by step as the model keeps them (kv_cache.reset_slots, block_positions, one ring pointer).
At every step and for every window, the dense mask built from the intervals equals, bit
for bit, the mask the attention used before intervals: the row's block-diagonal causal
mask (`attention.attention_mask`) beside the cached keys each query sees
(`attention.cached_keys_seen`), with the cache read in document order; and the intervals'
mask over the ring as it lies equals `cached_keys_seen` on the ring itself.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from actx.pipeline import pack
from actx.schemas import runspec
from actx.workers.attention import dispatch as attention, key_ranges, kv_cache
from actx.workers.loop import schedule


def _block(lengths, packing, rng):
    plan = pack.plan_pack(lengths, packing)
    block = {n: np.zeros((plan.total_rows, packing.seq_len), np.int32)
             for n in ("input_ids", "segment_ids", "positions")}
    block["doc_index"] = np.full((plan.total_rows, packing.seq_len), -1, np.int32)
    block["context_start"] = np.full((plan.total_rows, packing.seq_len), -1, np.int32)
    for d, n in enumerate(lengths):
        pack.fill_rows(block, 0, plan.pieces[d], rng.integers(1, 100, n).astype(np.int32), d,
                       packing=packing)
    return block


def _steps(block, batch):
    seg, pos = block["segment_ids"], block["positions"]
    continues_row = (seg[:, 0] > 0) & (pos[:, 0] > 0)
    return schedule.assign(schedule.chains(0, seg.shape[0], continues_row), batch, 0)


def _masks_agree(seg, pos, continues, pos_bc, ptr, seq_len, windows):
    """Checks one step; returns the number of blocks each slot held."""
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    cont_b = jnp.asarray(continues)
    pos_bc = kv_cache.reset_slots(pos_bc, cont_b)
    q_cont = cont_b[:, None] & (seg == seg[:, :1]) & (seg > 0)
    cap = pos_bc.shape[1]
    held = key_ranges.held_keys(pos_bc)
    lo, hi = key_ranges.key_ranges(seg, q_cont, held, cap)
    doc_order = jnp.roll(pos_bc, -int(ptr) * seq_len, axis=1)  # oldest block first
    for window in windows:
        lo_w = key_ranges.windowed(lo, hi, window)
        old = jnp.concatenate([attention.cached_keys_seen(doc_order, pos, q_cont, window),
                               attention.attention_mask(seg, window)], axis=-1)
        new = key_ranges.dense_mask(lo_w, hi, cap + seq_len)
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
        ring = key_ranges.physical_cache_mask(lo_w, hi, cap, seq_len, jnp.int32(ptr))
        np.testing.assert_array_equal(
            np.asarray(ring), np.asarray(attention.cached_keys_seen(pos_bc, pos, q_cont,
                                                                    window)))
    new_pos = pos_bc.at[:, ptr * seq_len:(ptr + 1) * seq_len].set(
        kv_cache.block_positions(pos, seg))
    return new_pos, np.asarray(held) // seq_len


@pytest.mark.parametrize("mode", ["segmented", "pad"])
@pytest.mark.parametrize("seq_len,max_context,model_window", [
    (8, 24, None),       # max_context a multiple of seq_len
    (8, 20, None),       # not a multiple: the cache holds more than max_context - 1
    (8, 33, 12),         # Mistral's sliding window below max_context
    (6, 13, 5),          # window below a row
])
def test_intervals_give_the_masks_they_replace(mode, seq_len, max_context, model_window):
    rng = np.random.default_rng(seq_len * 1000 + max_context)
    packing = runspec.PackingSpec(mode, seq_len, max_context=max_context)
    # Short documents between long ones that wrap the ring several times.
    lengths = [int(n) for n in rng.choice([1, 2, 3, seq_len - 1, seq_len, seq_len + 1,
                                           3 * seq_len + 2, 9 * seq_len + 5], 60)]
    block = _block(lengths, packing, rng)
    cap = kv_cache.capacity_tokens(max_context, seq_len)
    blocks = cap // seq_len
    windows = sorted({max_context, min(max_context, model_window or max_context),
                      attention.NO_WINDOW})
    depths_seen = set()
    for batch in (1, 3):
        pos_bc, ptr = jnp.full((batch, cap), -1, jnp.int32), 0
        for s in _steps(block, batch):
            rows = list(s.rows)
            pos_bc, held = _masks_agree(block["segment_ids"][rows], block["positions"][rows],
                                        np.asarray(s.continues), pos_bc, ptr, seq_len,
                                        windows)
            depths_seen.update(int(h) for h in held)
            ptr = (ptr + 1) % blocks
    assert depths_seen == set(range(blocks + 1)), "every cache depth, empty to full"


def test_rows_alone_intervals_are_the_block_diagonal_causal_mask():
    rng = np.random.default_rng(5)
    seg = np.sort(rng.integers(0, 4, (6, 16)), axis=1)[:, ::-1].copy()  # padding last
    for window in (3, 7, attention.NO_WINDOW):
        lo, hi = key_ranges.key_ranges(jnp.asarray(seg))
        got = key_ranges.dense_mask(key_ranges.windowed(lo, hi, window), hi, 16)
        np.testing.assert_array_equal(
            np.asarray(got), np.asarray(attention.attention_mask(jnp.asarray(seg), window)))


def test_a_wrong_interval_is_caught():
    """The comparison can fail: an interval one key too long differs from the mask."""
    seg = jnp.asarray([[1, 1, 2, 2, 2, 0, 0, 0]])
    lo, hi = key_ranges.key_ranges(seg)
    wrong = key_ranges.dense_mask(lo - 1, hi, 8)
    assert not np.array_equal(np.asarray(wrong),
                              np.asarray(attention.attention_mask(seg, attention.NO_WINDOW)))
