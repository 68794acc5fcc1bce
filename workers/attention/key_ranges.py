"""Which keys each query sees, as one contiguous interval [lo, hi) per query.

The keys of a step are laid out in document order: a slot's cache ring read from its
oldest block (the one at the shared write pointer) to its newest, then the row's own keys.
In that order every query sees one contiguous run of keys:

- a query of the document that continues the slot's previous row: the slot's held keys
  (always the newest ones: a continuing document starts a fresh row, so each cached row of
  it is whole and the oldest of them are the ones overwritten) and the row up to itself;
- any other query: its segment's run in the row, from the run's first token up to itself
  (padding, segment 0, runs at the end of a row as the packer writes it);
- both clipped by the window (`max_context`, or the layer's own sliding window): no key
  more than `window - 1` positions back.

`hi` is the query's own index + 1 (causal: every query sees itself, so no interval is
empty). The kernels skip every key tile outside a query tile's intervals, so they do the
work of the keys attended and no more. `dense_mask` turns the intervals back into the
boolean mask (tests, and the fused cuDNN fallback).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def key_ranges(segment_ids_bt: jax.Array, q_continues_bt: jax.Array | None = None,
               held_b: jax.Array | None = None, cache_len: int = 0
               ) -> tuple[jax.Array, jax.Array]:
    """(lo, hi) int32 [b, t] over the keys [cache in document order (cache_len), row (t)],
    before any window (`windowed` applies a layer's).

    segment_ids_bt: the row's segment ids (0 = padding); each id occupies one run.
    q_continues_bt: query t belongs to the document the slot's cache holds (None: no cache).
    held_b: keys the slot holds for that document (the newest `held` of the cache).
    Computed once per step; only the window differs between layers.
    """
    b, t = segment_ids_bt.shape
    idx_t = jnp.arange(t, dtype=jnp.int32)
    starts_bt = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    run_start_bt = jax.lax.cummax(jnp.where(starts_bt, idx_t, 0), axis=1)
    lo_bt = cache_len + run_start_bt
    if q_continues_bt is not None:
        lo_bt = jnp.where(q_continues_bt, cache_len - held_b[:, None], lo_bt)
    hi_bt = jnp.broadcast_to(cache_len + idx_t + 1, (b, t))
    return lo_bt.astype(jnp.int32), hi_bt.astype(jnp.int32)


def windowed(lo_bt: jax.Array, hi_bt: jax.Array, window: jax.Array | int) -> jax.Array:
    """lo clipped so a query sees no key `window` or more positions back (t - s < window,
    as HF's sliding-window overlay). Keys are consecutive positions within a document, so
    positions back are indices back."""
    return jnp.maximum(lo_bt, hi_bt - window).astype(jnp.int32)


def held_keys(pos_bc: jax.Array) -> jax.Array:
    """int32 [b]: keys each slot's cache holds (pos >= 0), after `kv_cache.reset_slots`."""
    return jnp.sum(pos_bc >= 0, axis=1, dtype=jnp.int32)


def dense_mask(lo_bt: jax.Array, hi_bt: jax.Array, n_keys: int) -> jax.Array:
    """bool [b, t, n_keys]: key s is in [lo, hi) of query t."""
    s = jnp.arange(n_keys, dtype=jnp.int32)
    return (s >= lo_bt[..., None]) & (s < hi_bt[..., None])


def logical_cache_index(cache_len: int, block_len: int, ptr: jax.Array) -> jax.Array:
    """int32 [cache_len]: the document-order index of each physical cache key (the ring's
    oldest block, at `ptr`, comes first)."""
    c = jnp.arange(cache_len, dtype=jnp.int32)
    return (c - ptr * block_len) % max(cache_len, 1)


def physical_cache_mask(lo_bt: jax.Array, hi_bt: jax.Array, cache_len: int,
                        block_len: int, ptr: jax.Array) -> jax.Array:
    """bool [b, t, cache_len]: the intervals' mask over the cache in its physical (ring)
    order, for the ways that read the cache as it lies."""
    s = logical_cache_index(cache_len, block_len, ptr)
    return (s >= lo_bt[..., None]) & (s < hi_bt[..., None])
