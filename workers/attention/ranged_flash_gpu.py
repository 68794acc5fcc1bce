"""Flash attention over per-query key intervals, as a Pallas kernel for GPUs (Triton).

Each program takes one query tile of one head of one slot and walks only the key tiles
that meet its queries' intervals (workers.attention.key_ranges): first the slot's cache ring in
document order (tile j of it lies at ring offset `ptr * block_len + j * block_k`, wrapped),
then the row's own keys. Keys outside a query's interval are masked inside the tiles at
the intervals' ends (tiles inside every interval of the query tile skip the mask); tiles
wholly outside every interval of the tile are never loaded.
So the work follows the context each slot holds, and a slot's result depends only on its
own inputs (its grid programs read nothing of the other slots).

Softmax in float32 with the online (flash) recurrence; the products accumulate in float32.
Off a GPU the kernel runs in Pallas interpret mode (the tests run it on the CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Triton's dot wants tiles of at least 16 along each dimension.
MIN_TILE = 16
# No tile longer than this (the tests lower it to exercise many tiles).
MAX_TILE = 128
# Query and key tile lengths, Triton's warps per program (None: 4 up to head_dim 64, else
# 8) and pipeline stages: `python bench/cached_attention.py --sweep-tiles` measures the
# choices on a GPU (bench/RESULTS.md has the H100's figures).
BLOCK_Q = 64
BLOCK_K = 64
NUM_WARPS: int | None = None
NUM_STAGES = 2


def tile_size(n: int, largest: int, smallest: int = 1) -> int | None:
    """The largest power of two <= `largest` and >= `smallest` that divides n (None)."""
    size = largest
    while size >= smallest:
        if n % size == 0:
            return size
        size //= 2
    return None


def supports(t: int, head_dim: int, on_gpu: bool) -> str | None:
    """Why the kernel cannot take these shapes, or None where it can."""
    smallest = MIN_TILE if on_gpu else 1
    if tile_size(t, min(BLOCK_Q, BLOCK_K, MAX_TILE), smallest) is None:
        return f"rows of {t} tokens are not a multiple of {smallest}"
    if on_gpu and (head_dim & (head_dim - 1) or head_dim < MIN_TILE):
        return f"head_dim {head_dim} is not a power of two >= {MIN_TILE}"
    return None


def online_softmax(state, s, values, masked: bool):
    """One key tile into the flash state (acc [q, h], running max [q], running sum [q]),
    all float32: s [q, k] the tile's logits (-inf where masked), values [k, h]."""
    acc, m_old, l_old = state
    m_new = jnp.maximum(m_old, jnp.max(s, axis=1))
    if masked:
        # A query whose interval starts past this tile has seen nothing yet: keep its
        # exponents finite (its state stays zero, corrected away once it sees its keys).
        m_new_finite = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    else:
        m_new_finite = m_new
    p = jnp.exp(s - m_new_finite[:, None])
    correction = jnp.exp(m_old - m_new_finite)
    acc = acc * correction[:, None] + jnp.dot(p.astype(values.dtype), values,
                                              preferred_element_type=jnp.float32)
    return acc, m_new, l_old * correction + jnp.sum(p, axis=1)


def _kernel(off_ref, lo_ref, hi_ref, q_ref, *refs, cache_len: int, block_k: int,
            scale: float, softcap: float | None):
    if cache_len:
        ck_ref, cv_ref, rk_ref, rv_ref, o_ref = refs
    else:
        rk_ref, rv_ref, o_ref = refs
    q = q_ref[...]                                   # [block_q, h]
    lo, hi = lo_ref[...], hi_ref[...]                # [block_q]
    block_q, h = q.shape
    first = jnp.min(lo) // block_k                   # key tiles in document order
    last = (jnp.max(hi) + block_k - 1) // block_k
    cache_tiles = cache_len // block_k

    def visit(keys, values, base, state, masked):
        s = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        if masked:  # a tile at an interval's end (inside every one: no mask)
            key_idx = base + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            s = jnp.where((key_idx >= lo[:, None]) & (key_idx < hi[:, None]), s, -jnp.inf)
        return online_softmax(state, s, values, masked)

    def tiles(start, stop, state, masked):
        """Visits key tiles [start, stop) in document order: ring tiles, then row tiles."""
        if cache_len:
            ring_at = off_ref[0]

            def cache_tile(j, state):
                at = pl.multiple_of((ring_at + j * block_k) % cache_len, block_k)
                return visit(ck_ref[pl.ds(at, block_k), :], cv_ref[pl.ds(at, block_k), :],
                             j * block_k, state, masked)

            state = jax.lax.fori_loop(start, jnp.minimum(stop, cache_tiles), cache_tile,
                                      state)

        def row_tile(j, state):
            at = pl.multiple_of(j * block_k - cache_len, block_k)
            return visit(rk_ref[pl.ds(at, block_k), :], rv_ref[pl.ds(at, block_k), :],
                         j * block_k, state, masked)

        return jax.lax.fori_loop(jnp.maximum(start, cache_tiles), stop, row_tile, state)

    # Tiles wholly inside every query's interval need no mask (the long stretch of a
    # slot's context); only those at the intervals' ends are masked. Still document order.
    inner_lo = jnp.clip((jnp.max(lo) + block_k - 1) // block_k, first, last)
    inner_hi = jnp.clip(jnp.min(hi) // block_k, inner_lo, last)
    state = (jnp.zeros((block_q, h), jnp.float32),
             jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    state = tiles(first, inner_lo, state, masked=True)
    state = tiles(inner_lo, inner_hi, state, masked=False)
    acc, _, l = tiles(inner_hi, last, state, masked=True)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def ranged_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                     lo_bt: jax.Array, hi_bt: jax.Array,
                     cache_k_bckh: jax.Array | None = None,
                     cache_v_bckh: jax.Array | None = None, ptr: jax.Array | None = None,
                     *, scale: float, softcap: float | None = None,
                     block_len: int | None = None) -> jax.Array:
    """Attention [b, t, n, h] of each query over the keys in its [lo, hi).

    Key indices run over [cache in document order, row]: the cache ring [b, C, k, h] is
    read from its block `ptr` (blocks of `block_len`, the row length) onwards, wrapped.
    Without a cache the intervals index the row's keys alone.
    """
    b, t, n, h = q_btnh.shape
    kv_heads = k_btkh.shape[2]
    group = n // kv_heads
    cache_len = 0 if cache_k_bckh is None else cache_k_bckh.shape[1]
    on_gpu = jax.default_backend() == "gpu"
    smallest = MIN_TILE if on_gpu else 1
    block_q = tile_size(t, min(BLOCK_Q, MAX_TILE), smallest)
    block_k = tile_size(t, min(BLOCK_K, MAX_TILE), smallest)
    off = jnp.zeros((1,), jnp.int32) if ptr is None else \
        jnp.reshape(ptr * (block_len or t), (1,)).astype(jnp.int32)
    kernel = functools.partial(_kernel, cache_len=cache_len, block_k=block_k, scale=scale,
                               softcap=softcap)
    grid = (t // block_q, b, n)
    q_spec = pl.BlockSpec((None, block_q, None, h), lambda i, s, head: (s, i, head, 0))
    range_spec = pl.BlockSpec((None, block_q), lambda i, s, head: (s, i))

    def whole(length):
        return pl.BlockSpec((None, length, None, h),
                            lambda i, s, head: (s, 0, head // group, 0))

    in_specs = [pl.BlockSpec((1,), lambda i, s, head: (0,)), range_spec, range_spec, q_spec]
    args = [off, lo_bt, hi_bt, q_btnh]
    if cache_len:
        in_specs += [whole(cache_len), whole(cache_len)]
        args += [cache_k_bckh.astype(q_btnh.dtype), cache_v_bckh.astype(q_btnh.dtype)]
    in_specs += [whole(t), whole(t)]
    args += [k_btkh, v_btkh]
    params = {}
    if on_gpu:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(
            num_warps=NUM_WARPS or (4 if h <= 64 else 8), num_stages=NUM_STAGES)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_btnh.shape, q_btnh.dtype),
        interpret=not on_gpu, name="actx_ranged_flash", **params)(*args)
