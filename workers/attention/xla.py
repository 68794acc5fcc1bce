"""Attention over per-query key intervals in plain XLA: the CPU's way, and the fallback
everywhere else.

Queries go in chunks (`query_chunks`): a chunk sees only the row's keys up to its last
query (the upper triangle is never computed), and its float32 logits stay a fraction of
the [t, t] ones. The cache is visited block by block, newest first, merged by the online
softmax in float32, and a chunk visits only the keys its queries' intervals reach back to
(workers.attention.key_ranges: the held context, clipped by the window): whole blocks, then the
oldest block in pieces (`block_piece`), so the work follows the context the slots hold.
A block a query does not see is fully masked and leaves its result bit for bit unchanged,
and every group of slots has the same shapes, so a slot's bytes never depend on what the
other slots hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# On the CPU chunks are 4-9x faster than the full logits at t = 1024 (those are
# memory-bound); on any backend they halve the FLOPs. At most MAX_QUERY_CHUNKS chunks, so
# the unrolled graph stays small.
MIN_QUERY_CHUNK = 128
MAX_QUERY_CHUNKS = 8
# The oldest cached block a chunk reaches into is visited in pieces of a quarter block
# (at least MIN_PIECE keys, so each visit stays a large matmul), newest piece first.
PIECES_PER_BLOCK = 4
MIN_PIECE = 128


def query_chunks(t: int) -> list[tuple[int, int]]:
    """Static [start, end) query ranges covering a row of t tokens."""
    n_chunks = min(MAX_QUERY_CHUNKS, -(-t // MIN_QUERY_CHUNK))
    size = -(-t // n_chunks)
    return [(start, min(t, start + size)) for start in range(0, t, size)]


def query_chunk_size(t: int) -> int:
    """The largest chunk `query_chunks(t)` makes (sizes the attention's working memory)."""
    return max(end - start for start, end in query_chunks(t))


def block_piece(block_len: int) -> int:
    """Keys per visit of the oldest cached block a chunk reaches into: a PIECES_PER_BLOCK-th
    of the block where that is a whole number of at least MIN_PIECE keys, else the block."""
    piece = block_len // PIECES_PER_BLOCK
    return piece if block_len % PIECES_PER_BLOCK == 0 and piece >= MIN_PIECE else block_len


def queries_by_kv_head(q_btnh: jax.Array, kv_heads: int) -> jax.Array:
    """[b, t, n, h] -> [b, kv_heads, n // kv_heads, t, h], once per layer.

    The logits einsum then contracts a [group x queries, head_dim] matrix per kv head
    with no transpose of its own. Given [b, t, k, g, h], XLA's CPU dot rearranged the
    queries and its output on every call: one 128-query chunk against a 1024-key block
    (Qwen2.5-0.5B's heads) took 2.4 ms instead of 1.2, and each visit of a cached block
    4.7 ms instead of 3.5.
    """
    b, t, n, h = q_btnh.shape
    return jnp.transpose(q_btnh.reshape(b, t, kv_heads, n // kv_heads, h), (0, 2, 3, 1, 4))


def _capped(logits, softcap):
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def sinks_by_kv_head(sinks_n: jax.Array | None, kv_heads: int) -> jax.Array | None:
    """A head's sink logit [n] as [1, k, g, 1, 1] float32 (the order of
    `queries_by_kv_head`), or None."""
    if sinks_n is None:
        return None
    return sinks_n.astype(jnp.float32).reshape(1, kv_heads, -1, 1, 1)


def softmax(logits_bkgts: jax.Array, sinks_1kg11: jax.Array | None) -> jax.Array:
    """Softmax over the keys (float32); with sinks (gpt-oss), each head's sink logit joins
    the denominator as a key with no value (HF: softmax over [logits, sink], the sink's
    share dropped)."""
    if sinks_1kg11 is None:
        return jax.nn.softmax(logits_bkgts, axis=-1)
    m = jnp.maximum(jnp.max(logits_bkgts, axis=-1, keepdims=True), sinks_1kg11)
    e = jnp.exp(logits_bkgts - m)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sinks_1kg11 - m))


def _seen(lo_bt, hi_bt, first_key: jax.Array | int, n_keys: int) -> jax.Array:
    """bool [b, 1, 1, t, n_keys]: keys first_key.. of the [cache, row] order in [lo, hi)."""
    s = first_key + jnp.arange(n_keys, dtype=jnp.int32)
    return ((s >= lo_bt[..., None]) & (s < hi_bt[..., None]))[:, None, None]


def rows_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                   lo_bt: jax.Array, hi_bt: jax.Array, scale: float,
                   softcap: float | None = None, sinks: jax.Array | None = None
                   ) -> jax.Array:
    """Attention [b, t, n, h] of rows seen alone; [lo, hi) index the row's keys;
    sinks: each head's sink logit [n] (`softmax`)."""
    b, t, n, h = q_btnh.shape
    q_bkgth = queries_by_kv_head(q_btnh, k_btkh.shape[2])
    sinks_1kg11 = sinks_by_kv_head(sinks, k_btkh.shape[2])
    out = []
    for start, end in query_chunks(t):
        # Logits and softmax in float32 (HF eager does the softmax in float32 too).
        logits_bkgts = _capped(jnp.einsum("bkgth,bskh->bkgts", q_bkgth[:, :, :, start:end],
                                          k_btkh[:, :end],
                                          preferred_element_type=jnp.float32) * scale,
                               softcap)
        seen = _seen(lo_bt[:, start:end], hi_bt[:, start:end], 0, end)
        logits_bkgts = jnp.where(seen, logits_bkgts, jnp.finfo(jnp.float32).min)
        probs_bkgts = softmax(logits_bkgts, sinks_1kg11).astype(v_btkh.dtype)
        out.append(jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_btkh[:, :end]))
    return jnp.concatenate(out, axis=1).reshape(b, t, n, h)


def cached_attention(q_btnh, k_btkh, v_btkh, lo_bt, hi_bt, cache_k_bckh, cache_v_bckh, ptr,
                     data_shards: int, slots_per_visit: int, scale: float,
                     softcap: float | None = None, sinks: jax.Array | None = None
                     ) -> jax.Array:
    """Attention [b, t, n, h] over the slots' cache ring and the row; [lo, hi) index the
    keys in document order (the ring from block `ptr`, then the row).

    The slots go in groups of `slots_per_visit` (a multiple of `data_shards`, the devices
    of the `data` axis, which holds the batch in contiguous chunks), one group after
    another; for each query chunk a group visits the blocks its queries reach back to.
    """
    b, t, n, h = q_btnh.shape
    if slots_per_visit % data_shards or b % slots_per_visit:
        raise ValueError(f"slots_per_visit {slots_per_visit} must be a multiple of the "
                         f"{data_shards} data shards and divide the batch of {b}")
    k = k_btkh.shape[2]
    block_len = t
    cache_len = cache_k_bckh.shape[1]
    n_blocks = cache_len // block_len
    piece_len = block_piece(block_len)
    q_bkgth = queries_by_kv_head(q_btnh, k)
    chunks = query_chunks(t)

    def scores(q, keys_bskh):
        return _capped(jnp.einsum("bkgth,bskh->bkgts", q, keys_bskh,
                                  preferred_element_type=jnp.float32) * scale, softcap)

    def weighted(p_bkgts, values_bskh):
        return jnp.einsum("bkgts,bskh->bkgth", p_bkgts, values_bskh.astype(jnp.float32))

    # The row part, per query chunk: the online-softmax state (max, sum, weighted values).
    states = []
    for start, end in chunks:
        seen = _seen(lo_bt[:, start:end], hi_bt[:, start:end], cache_len, end)
        logits = jnp.where(seen, scores(q_bkgth[:, :, :, start:end], k_btkh[:, :end]),
                           -jnp.inf)
        m_bkgt = jnp.max(logits, axis=-1)  # finite: every query sees itself
        p = jnp.exp(logits - m_bkgt[..., None])
        states.append((m_bkgt, jnp.sum(p, axis=-1), weighted(p, v_btkh[:, :end])))

    def group(xs):
        q, cache_k, cache_v, lo, hi, chunk_states = xs

        def visit(q_c, lo_c, hi_c, at, first_key, n_keys, state):
            """Merges keys [at, at + n_keys) of the ring, document-order index first_key..
            of the [cache, row] order, into the chunk's online-softmax state."""
            m_old, l_old, acc_old = state
            keys = jax.lax.dynamic_slice_in_dim(cache_k, at, n_keys, axis=1)
            values = jax.lax.dynamic_slice_in_dim(cache_v, at, n_keys, axis=1)
            seen = _seen(lo_c, hi_c, first_key, n_keys)
            logits = jnp.where(seen, scores(q_c, keys), -jnp.inf)
            m_new = jnp.maximum(m_old, jnp.max(logits, axis=-1))
            correction = jnp.exp(m_old - m_new)
            # m_old is finite (the row part), so an unseen key's exp(-inf) is 0.
            p = jnp.exp(logits - m_new[..., None])
            return (m_new, l_old * correction + jnp.sum(p, axis=-1),
                    acc_old * correction[..., None] + weighted(p, values))

        def chunk(start, end, state):
            q_c, lo_c, hi_c = q[:, :, :, start:end], lo[:, start:end], hi[:, start:end]

            def block(j, state):  # the j-th whole block back from the newest
                at = ((ptr - 1 - j) % n_blocks) * block_len
                return visit(q_c, lo_c, hi_c, at, cache_len - (j + 1) * block_len,
                             block_len, state)

            # The keys back to the earliest one any query of the chunk sees: whole blocks,
            # then the newest pieces of the block where that key lies. Held context is whole
            # rows, but a window (max_context not a multiple of seq_len, a layer's sliding
            # window: Mistral, Gemma's local layers) ends inside a block, and each chunk
            # at another key: a whole block visited there would be mostly unseen keys.
            reach = jnp.clip(cache_len - jnp.min(lo_c), 0, cache_len)
            whole = reach // block_len
            state = jax.lax.fori_loop(0, whole, block, state)

            def piece(i, state):  # the i-th piece back from the end of the oldest block
                oldest = ((ptr - 1 - whole) % n_blocks) * block_len
                at = oldest + block_len - (i + 1) * piece_len
                return visit(q_c, lo_c, hi_c, at,
                             cache_len - whole * block_len - (i + 1) * piece_len,
                             piece_len, state)

            pieces = (reach - whole * block_len + piece_len - 1) // piece_len
            return jax.lax.fori_loop(0, pieces, piece, state)

        return [chunk(start, end, state) for (start, end), state in zip(chunks, chunk_states)]

    # [b, ...] -> [groups, slots_per_visit, ...]: device d holds slots d*b/data_shards..;
    # group i takes the i-th run of slots_per_visit / data_shards slots of every device,
    # so each device works on its own slots in parallel.
    groups, per_device = b // slots_per_visit, slots_per_visit // data_shards

    def split(x):
        x = x.reshape((data_shards, groups, per_device) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1).reshape((groups, slots_per_visit) + x.shape[3:])

    def merge(x):
        x = x.reshape((groups, data_shards, per_device) + x.shape[2:])
        return jnp.swapaxes(x, 0, 1).reshape((b,) + x.shape[3:])

    xs = (q_bkgth, cache_k_bckh, cache_v_bckh, lo_bt, hi_bt, states)
    final = jax.lax.map(group, jax.tree.map(split, xs))
    sinks_1kg11 = sinks_by_kv_head(sinks, k)
    if sinks_1kg11 is not None:
        # A sink is a key with no value: its exp joins each query's denominator.
        final = [(m, l + jnp.exp(sinks_1kg11[..., 0] - m), acc) for m, l, acc in final]
    out_bkgth = jnp.concatenate(
        [merge(acc) / merge(l)[..., None] for _, l, acc in final], axis=3)
    return jnp.einsum("bkgth->btkgh", out_bkgth).reshape(b, t, n, h).astype(q_btnh.dtype)
