"""The attention over a row and its slots' cached earlier rows, each way actx computes it,
against a dense float64 reference: XLA block visits slot by slot (the CPU's way) and with
all slots at once (the XLA way elsewhere), the Pallas kernels over per-query key intervals
for GPUs and TPUs (here in Pallas interpret mode, with small tiles so a row and the ring
span several), and one fused attention over the cache and the row together (cuDNN's way,
here computed by XLA)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests import cache_inputs
from actx.workers.attention import (dispatch as attention, xla as attention_xla, ranged_flash_gpu,
                                    ranged_flash_tpu)

B, T, N, K, H, BLOCKS = 4, 8, 4, 2, 16, 3
WAYS = ["slot by slot", "all slots", "pallas gpu", "pallas tpu", "fused"]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 4 tokens: each row is 2 key tiles and the ring 6, so the kernels' skipping
    of tiles outside the intervals and their walk of the ring are exercised."""
    monkeypatch.setattr(ranged_flash_gpu, "MAX_TILE", 4)
    monkeypatch.setattr(ranged_flash_tpu, "MAX_TILE", 4)
    # The XLA way visits the oldest block it reaches into in pieces of 2 keys.
    monkeypatch.setattr(attention_xla, "MIN_PIECE", 2)


def _ways(b):
    def call(impl, **kw):
        return lambda x, ptr: attention.cached_attention(
            x["q"], x["kr"], x["vr"], x["lo"], x["hi"], x["ck"], x["cv"], ptr,
            implementation=impl, **kw)

    return {
        "slot by slot": call("xla", slots_per_visit=1),
        "all slots": call("xla", slots_per_visit=b),
        "pallas gpu": call("pallas_gpu"),
        "pallas tpu": call("pallas_tpu"),
        "fused": lambda x, ptr: attention.fused_cached_attention(
            x["q"], x["kr"], x["vr"], x["lo"], x["hi"], x["ck"], x["cv"], ptr,
            H ** -0.5, "xla"),
    }


def _dense_reference(x, window):
    """float64 numpy: softmax over every cached and row key the query may see."""
    q, kr, vr, ck, cv = (np.asarray(x[n], np.float64) for n in ("q", "kr", "vr", "ck", "cv"))
    cpos, qpos, cont = (np.asarray(x[n]) for n in ("cpos", "qpos", "cont"))
    row_mask = np.asarray(x["mask"])
    out = np.zeros_like(q)
    group = q.shape[2] // kr.shape[2]
    for s in range(q.shape[0]):
        keys, values = np.concatenate([ck[s], kr[s]]), np.concatenate([cv[s], vr[s]])
        for i in range(q.shape[1]):
            seen_cache = (cont[s, i] & (cpos[s] >= 0) & (cpos[s] < qpos[s, i])
                          & (qpos[s, i] - cpos[s] < window))
            seen = np.concatenate([seen_cache, row_mask[s, i]])
            for head in range(q.shape[2]):
                logits = keys[seen, head // group] @ q[s, i, head] / np.sqrt(q.shape[-1])
                p = np.exp(logits - logits.max())
                out[s, i, head] = (p / p.sum()) @ values[seen, head // group]
    return out


@pytest.mark.parametrize("window", [attention.NO_WINDOW, 2 * T + 3])
@pytest.mark.parametrize("depths", [[0, 0, 0, 0], [1, 3, 0, 2], [3, 3, 3, 3]])
@pytest.mark.parametrize("way", WAYS)
def test_every_way_matches_the_dense_reference(way, depths, window):
    rng = np.random.default_rng(7)
    x = cache_inputs.make_inputs(rng, B, T, N, K, H, BLOCKS, depths, jnp.float32, 2, window)
    got = np.asarray(_ways(B)[way](x, jnp.int32(2)))
    want = _dense_reference(x, window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if any(depths):  # the cache changes the answer, so the comparison can fail
        x_alone = dict(x, cont=jnp.zeros_like(x["cont"]))
        assert not np.allclose(_dense_reference(x_alone, window), want, atol=1e-3)


@pytest.mark.parametrize("ptr", [0, 1, 2])
@pytest.mark.parametrize("window", [T + 1, 2 * T - 3, 2 * T + 3])
def test_the_xla_way_visits_the_oldest_block_it_reaches_in_pieces(ptr, window):
    """Windows that end inside a cached block, with the ring's oldest block anywhere: the
    pieces of that block are read where they lie (and only those the queries reach)."""
    assert attention_xla.block_piece(T) == 2
    x = cache_inputs.make_inputs(np.random.default_rng(11), B, T, N, K, H, BLOCKS,
                                 [3, 2, 1, 3], jnp.float32, ptr, window)
    for slots in (1, B):
        got = np.asarray(_ways(B)["slot by slot" if slots == 1 else "all slots"](
            x, jnp.int32(ptr)))
        np.testing.assert_allclose(got, _dense_reference(x, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("way", WAYS)
def test_a_slots_bytes_do_not_depend_on_the_other_slots(way):
    """Slot 0 the same, the other slots holding other keys and depths: slot 0's output is
    bit for bit the same (a rerun on another host has other companions)."""
    rng = np.random.default_rng(3)
    x = cache_inputs.make_inputs(rng, B, T, N, K, H, BLOCKS, [2, 0, 1, 3], jnp.float32, 1,
                             attention.NO_WINDOW)
    other = cache_inputs.make_inputs(np.random.default_rng(4), B, T, N, K, H, BLOCKS,
                                 [2, 3, 3, 0], jnp.float32, 1, attention.NO_WINDOW)
    other = {n: v.at[0].set(x[n][0]) for n, v in other.items()}
    fn = _ways(B)[way]
    a = np.asarray(fn(x, jnp.int32(1)))
    b = np.asarray(fn(other, jnp.int32(1)))
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[1:], b[1:])


def test_slots_per_visit_must_fit_the_batch_and_the_data_shards():
    x = cache_inputs.make_inputs(np.random.default_rng(0), B, T, N, K, H, BLOCKS, [1] * B,
                                 jnp.float32, 0, attention.NO_WINDOW)
    args = [x[n] for n in ("q", "kr", "vr", "lo", "hi", "ck", "cv")]
    with pytest.raises(ValueError, match="slots_per_visit 3 must be a multiple of the 1"):
        attention.cached_attention(*args, jnp.int32(0), implementation="xla",
                                   slots_per_visit=3)
    with pytest.raises(ValueError, match="multiple of the 4 data shards"):
        attention.cached_attention(*args, jnp.int32(0), data_shards=4,
                                   implementation="xla", slots_per_visit=2)


def test_the_working_set_counts_the_larger_of_the_two_ways():
    from actx.workers.attention import kv_cache

    # 16 slots, 14 heads, rows of 1024 (query chunks of 128): XLA's float32 logits,
    # exponentials and masked copy of one chunk against one block, 3 x 16 x 14 x 128 x
    # 1024 x 4 bytes; the fused call's mask over cache + row keys, 1 + 2 bytes per entry.
    xla = 3 * 16 * 14 * 128 * 1024 * 4
    assert kv_cache.attention_scratch_bytes(16, 14, 1024, capacity=1024) == xla
    assert kv_cache.attention_scratch_bytes(16, 14, 1024, capacity=32768) == \
        16 * 1024 * (32768 + 1024) * 3
    # Each way alone: the Pallas GPU kernel keeps its tiles on chip; the TPU one reads a
    # head-major copy of the cache and the row (2 kv heads of 64, bfloat16: 512 bytes).
    assert kv_cache.attention_scratch_bytes(16, 14, 1024, 32768, "xla") == xla
    assert kv_cache.attention_scratch_bytes(16, 14, 1024, 32768, "pallas_gpu") == 0
    assert kv_cache.attention_scratch_bytes(16, 14, 1024, 32768, "pallas_tpu", 512) == \
        16 * (32768 + 1024) * 512


def test_the_recorded_implementation_is_the_one_that_runs_for_soft_capped_models(tmp_path):
    """cuDNN has no logit soft-capping, so a Gemma 2 step asked for it runs XLA, and the
    step reports XLA (what the run's numerics record), not what was asked."""
    from tests import hf_models
    from actx.workers.model import capture, decoder as model_lib, step

    assert attention.implementation_for("bfloat16", 8, 16, 5.0, "cudnn") == "xla"
    assert attention.implementation_for("bfloat16", 8, 16, None, "cudnn") == "cudnn"
    gemma = model_lib.load_pretrained(hf_models.make_tiny_checkpoint(tmp_path / "g", "gemma2"))
    fn = step.make_extract_fn(gemma, capture.CaptureSpec.parse("layers.0.resid_post"),
                              attention_impl="cudnn")
    assert fn.attention_implementation(8) == "xla"
