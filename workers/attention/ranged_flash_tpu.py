"""Flash attention over per-query key intervals, as a Pallas kernel for TPUs (Mosaic).

The grid is (slot, head, query tile, key tile), the key tiles running over the keys in
document order: the slot's cache ring from its oldest block, then the row. What each
(slot, query tile) needs is prefetched as scalars before the grid starts: the first and
last key tile that meet its queries' intervals (workers.attention.key_ranges). The key and value
index maps clamp the key tile into that span, so the pipeline fetches nothing new for the
tiles outside it (the same block index twice is not fetched again), and `pl.when` skips
their compute; the ring is walked by the index map (tile j of the cache lies at ring tile
`(ptr * block_len / block_k + j) mod tiles`), so the cache is never copied into order.

Softmax in float32 with the online (flash) recurrence in VMEM scratch. Off a TPU the
kernel runs in Pallas interpret mode (the tests run it on the CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
# Query and key tiles of up to 128 tokens (the tests lower it to exercise many tiles).
MAX_TILE = 128


def tile_size(n: int, largest: int, on_tpu: bool) -> int | None:
    """The largest power of two <= largest dividing n; on a TPU at least 8 (sublanes)."""
    size = largest
    while size >= (8 if on_tpu else 1):
        if n % size == 0:
            return size
        size //= 2
    return None


def supports(t: int, on_tpu: bool) -> str | None:
    """Why the kernel cannot take these shapes, or None where it can."""
    if tile_size(t, MAX_TILE, on_tpu) is None:
        return f"rows of {t} tokens are not a multiple of 8"
    return None


def _kernel(ring_tile_ref, first_ref, last_ref, q_ref, lo_ref, hi_ref, *refs,
            cache_tiles: int, block_k: int, scale: float, softcap: float | None):
    if cache_tiles:
        ck_ref, cv_ref, rk_ref, rv_ref, o_ref, m_sc, l_sc, acc_sc = refs
    else:
        rk_ref, rv_ref, o_ref, m_sc, l_sc, acc_sc = refs
    slot, q_tile, k_tile = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    first, last = first_ref[slot, q_tile], last_ref[slot, q_tile]

    @pl.when(k_tile == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def visit(k_ref, v_ref):
        q = q_ref[...]                                        # [block_q, h]
        s = jax.lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        key_idx = k_tile * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where((key_idx >= lo_ref[...]) & (key_idx < hi_ref[...]), s, -jnp.inf)
        m_old = m_sc[...]                                     # [block_q, LANES]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        # Queries whose interval starts past this tile keep finite exponents (zero state).
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, :1])
        correction = jnp.exp(m_old - m_safe)
        l_sc[...] = l_sc[...] * correction + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        acc_sc[...] = acc_sc[...] * correction[:, :1] + jnp.dot(
            p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)

    inside = (k_tile >= first) & (k_tile < last)
    if cache_tiles:
        pl.when(inside & (k_tile < cache_tiles))(lambda: visit(ck_ref, cv_ref))
    pl.when(inside & (k_tile >= cache_tiles))(lambda: visit(rk_ref, rv_ref))

    @pl.when(k_tile == pl.num_programs(3) - 1)
    def _store():
        o_ref[...] = (acc_sc[...] / l_sc[...][:, :1]).astype(o_ref.dtype)


def ranged_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                     lo_bt: jax.Array, hi_bt: jax.Array,
                     cache_k_bckh: jax.Array | None = None,
                     cache_v_bckh: jax.Array | None = None, ptr: jax.Array | None = None,
                     *, scale: float, softcap: float | None = None,
                     block_len: int | None = None) -> jax.Array:
    """Attention [b, t, n, h] of each query over the keys in its [lo, hi) (the same
    contract as `workers.attention.ranged_flash_gpu.ranged_attention`)."""
    b, t, n, h = q_btnh.shape
    kv_heads = k_btkh.shape[2]
    group = n // kv_heads
    cache_len = 0 if cache_k_bckh is None else cache_k_bckh.shape[1]
    on_tpu = jax.default_backend() == "tpu"
    block_q = block_k = tile_size(t, MAX_TILE, on_tpu)
    cache_tiles, row_tiles = cache_len // block_k, t // block_k
    q_tiles = t // block_q

    # What each (slot, query tile) needs: key tiles [first, last) in document order.
    lo_bq = jnp.min(lo_bt.reshape(b, q_tiles, block_q), axis=2)
    hi_bq = jnp.max(hi_bt.reshape(b, q_tiles, block_q), axis=2)
    first_bq = (lo_bq // block_k).astype(jnp.int32)
    last_bq = ((hi_bq + block_k - 1) // block_k).astype(jnp.int32)
    ring_tile = jnp.zeros((1,), jnp.int32) if ptr is None else jnp.reshape(
        ptr * ((block_len or t) // block_k), (1,)).astype(jnp.int32)

    def clamped(j, s, qi, first_ref, last_ref):
        return jnp.clip(j, first_ref[s, qi], last_ref[s, qi] - 1)

    def q_map(s, head, qi, j, ring_ref, first_ref, last_ref):
        return (s, head, qi, 0)

    def range_map(s, head, qi, j, ring_ref, first_ref, last_ref):
        return (s, qi, 0)

    def cache_map(s, head, qi, j, ring_ref, first_ref, last_ref):
        j = jnp.minimum(clamped(j, s, qi, first_ref, last_ref), cache_tiles - 1)
        return (s, head // group, (ring_ref[0] + j) % cache_tiles, 0)

    def row_map(s, head, qi, j, ring_ref, first_ref, last_ref):
        j = clamped(j, s, qi, first_ref, last_ref)
        return (s, head // group, jnp.maximum(j - cache_tiles, 0), 0)

    # Heads before positions, so each block's last two dims are (tokens, head_dim).
    def heads_first(x):
        return jnp.swapaxes(x, 1, 2)

    in_specs = [pl.BlockSpec((None, None, block_q, h), q_map),
                pl.BlockSpec((None, block_q, 1), range_map),
                pl.BlockSpec((None, block_q, 1), range_map)]
    args = [heads_first(q_btnh), lo_bt[..., None], hi_bt[..., None]]
    if cache_tiles:
        in_specs += [pl.BlockSpec((None, None, block_k, h), cache_map)] * 2
        args += [heads_first(cache_k_bckh.astype(q_btnh.dtype)),
                 heads_first(cache_v_bckh.astype(q_btnh.dtype))]
    in_specs += [pl.BlockSpec((None, None, block_k, h), row_map)] * 2
    args += [heads_first(k_btkh), heads_first(v_btkh)]
    kernel = functools.partial(_kernel, cache_tiles=cache_tiles, block_k=block_k,
                               scale=scale, softcap=softcap)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, n, q_tiles, cache_tiles + row_tiles),
        in_specs=in_specs, out_specs=pl.BlockSpec((None, None, block_q, h), q_map),
        scratch_shapes=[pltpu.VMEM((block_q, LANES), jnp.float32),
                        pltpu.VMEM((block_q, LANES), jnp.float32),
                        pltpu.VMEM((block_q, h), jnp.float32)])
    params = {}
    if on_tpu:
        params["compiler_params"] = pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    out_bnth = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, n, t, h), q_btnh.dtype),
        interpret=not on_tpu, name="actx_ranged_flash_tpu", **params,
    )(ring_tile, first_bq, last_bq, *args)
    return jnp.swapaxes(out_bnth, 1, 2)
