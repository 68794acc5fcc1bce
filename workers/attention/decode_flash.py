"""Flash attention of a generating step over each slot's own cache, as one Pallas kernel.

A generating slot's cache (`workers.generate.step.SlotCache`) holds its document's keys in
position order, this step's included, so each query at position p sees the keys
[max(0, p - window + 1), p + 1): one interval per query, as `workers.attention.key_ranges` gives
extraction's kernels. A decode step has one query per slot, a prefill step a chunk; both
are few queries against a long cache, so a program takes the queries of one slot and one
key/value head (the `t * group` query rows that share its keys, a tile of them at a time)
and walks the key tiles that meet their intervals, with the online (flash) softmax in float32. Tiles inside
every interval skip the mask; tiles past every interval are never loaded, so the work
follows each slot's own length and a slot's result depends only on its own inputs.

The query rows go to programs in tiles of `row_tile(rows)`: a power of two from 16 to
`ROW_TILE_MAX`, since Triton's lowering takes only power-of-two blocks and its dot at least
16 rows (a prefill chunk of 64 positions in query groups of 7 is 448 rows: 4 tiles of 128).
The rows are padded to whole tiles; padded rows see key 0 only and are dropped. Off a GPU or TPU the kernel runs in Pallas interpret mode
(the tests run it on the CPU against `generate_step`'s XLA attention and HF transformers);
where it cannot compile, `generate_step.attention_for` keeps XLA and says why once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from actx.workers.attention import ranged_flash_gpu

ROW_TILE_MIN, ROW_TILE_MAX = 16, 128  # query rows per program: a power of two in between
KEY_TILE = 128  # keys per tile (the capacity is padded to a multiple of it)


def key_tile(capacity: int) -> int:
    """The key tile: KEY_TILE, or the capacity itself when shorter."""
    return min(KEY_TILE, capacity)


def row_tile(rows: int) -> int:
    """Query rows per program: the power of two covering `rows`, within [16, 128]."""
    return min(ROW_TILE_MAX, max(ROW_TILE_MIN, 1 << max(0, rows - 1).bit_length()))


def _kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, *, block_k: int, scale: float,
            softcap: float | None):
    q = q_ref[...]                                  # [rows, h]
    lo, hi = lo_ref[...], hi_ref[...]               # [rows]
    rows, h = q.shape
    first = jnp.min(lo) // block_k
    last = (jnp.max(hi) + block_k - 1) // block_k

    def visit(j, state, masked):
        at = pl.multiple_of(j * block_k, block_k)
        keys, values = k_ref[pl.ds(at, block_k), :], v_ref[pl.ds(at, block_k), :]
        s = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        if masked:
            key_idx = at + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
            s = jnp.where((key_idx >= lo[:, None]) & (key_idx < hi[:, None]), s, -jnp.inf)
        return ranged_flash_gpu.online_softmax(state, s, values, masked)

    inner_lo = jnp.clip((jnp.max(lo) + block_k - 1) // block_k, first, last)
    inner_hi = jnp.clip(jnp.min(hi) // block_k, inner_lo, last)
    state = (jnp.zeros((rows, h), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    state = jax.lax.fori_loop(first, inner_lo, functools.partial(visit, masked=True), state)
    state = jax.lax.fori_loop(inner_lo, inner_hi, functools.partial(visit, masked=False),
                              state)
    acc, _, l = jax.lax.fori_loop(inner_hi, last, functools.partial(visit, masked=True), state)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def attention(q_btnh: jax.Array, k_bckh: jax.Array, v_bckh: jax.Array,
              positions_bt: jax.Array, window: jax.Array | int, *, scale: float,
              softcap: float | None = None) -> jax.Array:
    """[b, t, n, h]: each query at positions_bt over its slot's cached keys at positions
    within `window` back, up to its own (the cache [b, C, k, h] holds this step's keys)."""
    b, t, n, h = q_btnh.shape
    capacity, kv_heads = k_bckh.shape[1], k_bckh.shape[2]
    group = n // kv_heads
    rows = t * group
    tile = row_tile(rows)
    padded = -(-rows // tile) * tile
    block_k = key_tile(capacity)
    keys_padded = -(-capacity // block_k) * block_k
    # [b, k, t * group, h]: the rows of one kv head, query-major within a position
    q_bkrh = q_btnh.reshape(b, t, kv_heads, group, h).transpose(0, 2, 1, 3, 4).reshape(
        b, kv_heads, rows, h)
    hi_bt = positions_bt + 1
    lo_bt = jnp.maximum(0, hi_bt - window)
    lo_br, hi_br = (jnp.repeat(x, group, axis=1).astype(jnp.int32) for x in (lo_bt, hi_bt))
    if padded != rows:  # padded rows see key 0 alone, then go
        q_bkrh = jnp.pad(q_bkrh, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
        lo_br = jnp.pad(lo_br, ((0, 0), (0, padded - rows)))
        hi_br = jnp.pad(hi_br, ((0, 0), (0, padded - rows)), constant_values=1)
    if keys_padded != capacity:  # keys past the capacity lie past every interval
        pad = ((0, 0), (0, keys_padded - capacity), (0, 0), (0, 0))
        k_bckh, v_bckh = jnp.pad(k_bckh, pad), jnp.pad(v_bckh, pad)
    on_device = jax.default_backend() in ("gpu", "tpu")
    q_spec = pl.BlockSpec((None, None, tile, h), lambda s, head, r: (s, head, r, 0))
    range_spec = pl.BlockSpec((None, tile), lambda s, head, r: (s, r))
    kv_spec = pl.BlockSpec((None, keys_padded, None, h), lambda s, head, r: (s, 0, head, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, scale=scale, softcap=softcap),
        grid=(b, kv_heads, padded // tile), in_specs=[range_spec, range_spec, q_spec, kv_spec, kv_spec],
        out_specs=q_spec, out_shape=jax.ShapeDtypeStruct(q_bkrh.shape, q_btnh.dtype),
        interpret=not on_device, name="actx_decode_flash")(
            lo_br, hi_br, q_bkrh, k_bckh.astype(q_btnh.dtype), v_bckh.astype(q_btnh.dtype))
    return out[:, :, :rows].reshape(b, kv_heads, t, group, h).transpose(
        0, 2, 1, 3, 4).reshape(b, t, n, h)
