"""Rotary embeddings, the segment-aware causal mask, and grouped-query attention.

The mask is block-diagonal causal over segment ids (0 = padding), optionally limited to a
sliding window, so packed documents see only themselves. Padding tokens share segment 0
and always see themselves, so no row of the softmax is empty (no NaN). `cached_attention`
adds the keys a slot cached from its document's earlier rows (workers.kv_cache).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

# Stands in for "no sliding window" inside the layer scan, where the window is traced.
NO_WINDOW = 2**30


def rope_cos_sin(positions_bt: jax.Array, inv_freq_f: jax.Array,
                 dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [b, t, h] for rotate-half RoPE, computed in float32 like HF."""
    freqs_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq_f.astype(jnp.float32)
    emb_bth = jnp.concatenate([freqs_btf, freqs_btf], axis=-1)
    return jnp.cos(emb_bth).astype(dtype), jnp.sin(emb_bth).astype(dtype)


def apply_rope(x_btnh: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array) -> jax.Array:
    """Rotates pairs (i, i + h/2) of each head, the HF `rotate_half` convention."""
    half = x_btnh.shape[-1] // 2
    rotated_btnh = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
    return x_btnh * cos_bth[:, :, None, :] + rotated_btnh * sin_bth[:, :, None, :]


def attention_mask(segment_ids_bt: jax.Array, window: jax.Array | int) -> jax.Array:
    """Boolean [b, t, s]: query t may attend key s.

    Causal, same segment, and within `window` tokens (t - s < window, as HF's
    sliding-window overlay). Padding (segment 0) attends earlier padding, and always itself.
    """
    t = segment_ids_bt.shape[1]
    q_idx_t1 = jnp.arange(t)[:, None]
    k_idx_1s = jnp.arange(t)[None, :]
    allowed_ts = (k_idx_1s <= q_idx_t1) & (q_idx_t1 - k_idx_1s < window)
    same_segment_bts = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return allowed_ts[None] & same_segment_bts


# Queries are processed in chunks: each chunk attends only to the keys up to its last query
# (the mask is causal, so later keys are never seen), which skips the upper triangle, and
# its float32 logits [b, k, g, chunk, keys] stay a fraction of the [t, t] ones. On the CPU
# that is 4-9x faster at t = 1024 (the full logits are memory-bound); on any backend it
# halves the FLOPs. At most MAX_QUERY_CHUNKS chunks, so the unrolled graph stays small.
MIN_QUERY_CHUNK = 128
MAX_QUERY_CHUNKS = 8


def query_chunks(t: int) -> list[tuple[int, int]]:
    """Static [start, end) query ranges covering a row of t tokens."""
    n_chunks = min(MAX_QUERY_CHUNKS, -(-t // MIN_QUERY_CHUNK))
    size = -(-t // n_chunks)
    return [(start, min(t, start + size)) for start in range(0, t, size)]


def query_chunk_size(t: int) -> int:
    """The largest chunk `query_chunks(t)` makes (sizes the attention's working memory)."""
    return max(end - start for start, end in query_chunks(t))


def _queries_by_kv_head(q_btnh: jax.Array, kv_heads: int) -> jax.Array:
    """[b, t, n, h] -> [b, kv_heads, n // kv_heads, t, h], once per layer.

    The logits einsum then contracts a [group x queries, head_dim] matrix per kv head
    with no transpose of its own. Given [b, t, k, g, h], XLA's CPU dot rearranged the
    queries and its output on every call: one 128-query chunk against a 1024-key block
    (Qwen2.5-0.5B's heads) took 2.4 ms instead of 1.2, and each visit of a cached block
    4.7 ms instead of 3.5.
    """
    b, t, n, h = q_btnh.shape
    return jnp.transpose(q_btnh.reshape(b, t, kv_heads, n // kv_heads, h), (0, 2, 3, 1, 4))


def _xla_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                   mask_bts: jax.Array) -> jax.Array:
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    q_bkgth = _queries_by_kv_head(q_btnh, k)
    out = []
    for start, end in query_chunks(t):
        # Logits and softmax in float32 (HF eager does the softmax in float32 too).
        logits_bkgts = jnp.einsum("bkgth,bskh->bkgts", q_bkgth[:, :, :, start:end],
                                  k_bskh[:, :end],
                                  preferred_element_type=jnp.float32) * (h ** -0.5)
        logits_bkgts = jnp.where(mask_bts[:, None, None, start:end, :end], logits_bkgts,
                                 jnp.finfo(jnp.float32).min)
        probs_bkgts = jax.nn.softmax(logits_bkgts, axis=-1).astype(v_bskh.dtype)
        out.append(jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh[:, :end]))
    return jnp.concatenate(out, axis=1).reshape(b, t, n, h)


def default_implementation(dtype: jnp.dtype) -> str:
    """"cudnn" for half precision on GPU, else "xla" (CPU, TPU, float32)."""
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "xla"


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
              mask_bts: jax.Array, implementation: str | None = None) -> jax.Array:
    """Grouped-query attention [b, t, n, h]; k/v heads are shared by n // k query heads.

    mask_bts must be causal (as `attention_mask`): no query attends a later key.
    """
    return _cudnn_else_xla(
        implementation or default_implementation(q_btnh.dtype),
        lambda: jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask_bts[:, None],
                                             implementation="cudnn"),
        lambda: _xla_attention(q_btnh, k_bskh, v_bskh, mask_bts))


def _cudnn_else_xla(implementation: str, cudnn, xla) -> jax.Array:
    """cudnn() where implementation is "cudnn" and cuDNN takes it, else xla()."""
    if implementation == "cudnn":
        try:
            return cudnn()
        except (ValueError, NotImplementedError, RuntimeError) as err:
            # cuDNN rejects some shapes/versions at trace time; XLA is always correct.
            log.warning("cuDNN attention unavailable (%s); using the XLA implementation", err)
    return xla()


def cached_keys_seen(cache_pos_bc: jax.Array, q_pos_bt: jax.Array,
                     q_continues_bt: jax.Array, window: jax.Array | int) -> jax.Array:
    """Boolean [b, t, c]: query t sees cached key c. Only a query that continues the
    slot's document does, and only keys the slot holds (pos >= 0) that are earlier than
    it and within the window (q_pos - window < pos < q_pos)."""
    pos_b1c = cache_pos_bc[:, None, :]
    q_pos_bt1 = q_pos_bt[:, :, None]
    return (q_continues_bt[:, :, None] & (pos_b1c >= 0) & (pos_b1c < q_pos_bt1)
            & (q_pos_bt1 - pos_b1c < window))


def default_slots_per_visit(batch: int, data_shards: int) -> int:
    """Slots that visit their cached blocks together in the XLA path.

    On the CPU one slot per device at a time: each visit is compute-bound there, so
    following each slot's own depth saves the work of the slots that hold less. On GPUs
    and TPUs a visit of one slot is a handful of tiny kernels, launch-bound (one slot at a
    time made the exact context 12x slower than rows alone on an H100): all slots at once.
    """
    return data_shards if jax.default_backend() == "cpu" else batch


def cached_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                     mask_bts: jax.Array, cache_k_bckh: jax.Array, cache_v_bckh: jax.Array,
                     cache_pos_bc: jax.Array, q_pos_bt: jax.Array, q_continues_bt: jax.Array,
                     window: jax.Array | int, ptr: jax.Array,
                     data_shards: int = 1, implementation: str | None = None,
                     slots_per_visit: int | None = None) -> jax.Array:
    """Attention over the row itself and the slot's cached earlier rows, [b, t, n, h].

    The row part uses `mask_bts` (causal) as `attention`; a query that continues the slot's
    document also attends to the cached keys `cached_keys_seen` names.

    implementation "cudnn" (the default for half precision on GPU): one fused cuDNN
    attention over the cache and the row's keys together, with that mask; it computes
    every cached key whether held or not (a fixed cost per step), and a slot's result
    depends only on its own inputs.

    implementation "xla": queries go in chunks (`query_chunks`); the cache is visited
    block by block, newest first, merged by the online softmax in float32, so the work
    follows the context the slots hold: the slots are taken in groups of
    `slots_per_visit` (a multiple of `data_shards`, the devices of the `data` axis, which
    holds the batch in contiguous chunks; `default_slots_per_visit`), one group after
    another, and for each query chunk a group visits as many blocks as its deepest slot
    holds, or none where no query of the chunk continues a document. A block a slot does
    not hold (or a query does not see) is fully masked and leaves its result bit for bit
    unchanged, and every group has the same shapes, so a slot's bytes never depend on what
    the other slots hold.
    """
    return _cudnn_else_xla(
        implementation or default_implementation(q_btnh.dtype),
        lambda: fused_cached_attention(q_btnh, k_btkh, v_btkh, mask_bts, cache_k_bckh,
                                       cache_v_bckh, cache_pos_bc, q_pos_bt, q_continues_bt,
                                       window, "cudnn"),
        lambda: _xla_cached_attention(q_btnh, k_btkh, v_btkh, mask_bts, cache_k_bckh,
                                      cache_v_bckh, cache_pos_bc, q_pos_bt, q_continues_bt,
                                      window, ptr, data_shards, slots_per_visit))


def fused_cached_attention(q_btnh, k_btkh, v_btkh, mask_bts, cache_k_bckh, cache_v_bckh,
                           cache_pos_bc, q_pos_bt, q_continues_bt, window,
                           implementation: str = "cudnn") -> jax.Array:
    """One attention over [cache keys, row keys] (the order within a softmax does not
    matter) through `jax.nn.dot_product_attention`; every query sees at least itself, so
    no row is empty. implementation "xla" computes the same on any backend (tests)."""
    keys = jnp.concatenate([cache_k_bckh.astype(k_btkh.dtype), k_btkh], axis=1)
    values = jnp.concatenate([cache_v_bckh.astype(v_btkh.dtype), v_btkh], axis=1)
    mask = jnp.concatenate(
        [cached_keys_seen(cache_pos_bc, q_pos_bt, q_continues_bt, window), mask_bts],
        axis=-1)
    return jax.nn.dot_product_attention(q_btnh, keys, values, mask=mask[:, None],
                                        implementation=implementation)


def _xla_cached_attention(q_btnh, k_btkh, v_btkh, mask_bts, cache_k_bckh, cache_v_bckh,
                          cache_pos_bc, q_pos_bt, q_continues_bt, window, ptr, data_shards,
                          slots_per_visit) -> jax.Array:
    b, t, n, h = q_btnh.shape
    slots_per_visit = slots_per_visit or default_slots_per_visit(b, data_shards)
    if slots_per_visit % data_shards or b % slots_per_visit:
        raise ValueError(f"slots_per_visit {slots_per_visit} must be a multiple of the "
                         f"{data_shards} data shards and divide the batch of {b}")
    k = k_btkh.shape[2]
    block_len = t
    n_blocks = cache_k_bckh.shape[1] // block_len
    scale = h ** -0.5
    q_bkgth = _queries_by_kv_head(q_btnh, k)
    chunks = query_chunks(t)

    def scores(q, keys_bskh):
        return jnp.einsum("bkgth,bskh->bkgts", q, keys_bskh,
                          preferred_element_type=jnp.float32) * scale

    def weighted(p_bkgts, values_bskh):
        return jnp.einsum("bkgts,bskh->bkgth", p_bkgts, values_bskh.astype(jnp.float32))

    # The row part, per query chunk: the online-softmax state (max, sum, weighted values).
    states = []
    for start, end in chunks:
        row_mask = mask_bts[:, None, None, start:end, :end]
        logits = jnp.where(row_mask, scores(q_bkgth[:, :, :, start:end], k_btkh[:, :end]),
                           -jnp.inf)
        m_bkgt = jnp.max(logits, axis=-1)  # finite: every query sees itself
        p = jnp.exp(logits - m_bkgt[..., None])
        states.append((m_bkgt, jnp.sum(p, axis=-1), weighted(p, v_btkh[:, :end])))
    held_b = (jnp.sum(cache_pos_bc >= 0, axis=1) + block_len - 1) // block_len

    def group(xs):
        q, cache_k, cache_v, cache_pos, q_pos, q_continues, held, chunk_states = xs

        def chunk(start, end, state):
            q_c, q_pos_c, q_continues_c = (q[:, :, :, start:end], q_pos[:, start:end],
                                           q_continues[:, start:end])

            def visit(j, state):
                m_old, l_old, acc_old = state
                at = ((ptr - 1 - j) % n_blocks) * block_len
                keys = jax.lax.dynamic_slice_in_dim(cache_k, at, block_len, axis=1)
                values = jax.lax.dynamic_slice_in_dim(cache_v, at, block_len, axis=1)
                pos_bs = jax.lax.dynamic_slice_in_dim(cache_pos, at, block_len, axis=1)
                seen = cached_keys_seen(pos_bs, q_pos_c, q_continues_c, window)[:, None, None]
                logits = jnp.where(seen, scores(q_c, keys), -jnp.inf)
                m_new = jnp.maximum(m_old, jnp.max(logits, axis=-1))
                correction = jnp.exp(m_old - m_new)
                # m_old is finite (the row part), so an unseen key's exp(-inf) is 0.
                p = jnp.exp(logits - m_new[..., None])
                return (m_new, l_old * correction + jnp.sum(p, axis=-1),
                        acc_old * correction[..., None] + weighted(p, values))

            depth = jnp.where(jnp.any(q_continues_c), jnp.max(held), 0)
            return jax.lax.fori_loop(0, depth, visit, state)

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

    xs = (q_bkgth, cache_k_bckh, cache_v_bckh, cache_pos_bc, q_pos_bt, q_continues_bt,
          held_b, states)
    final = jax.lax.map(group, jax.tree.map(split, xs))
    out_bkgth = jnp.concatenate(
        [merge(acc) / merge(l)[..., None] for _, l, acc in final], axis=3)
    return jnp.einsum("bkgth->btkgh", out_bkgth).reshape(b, t, n, h).astype(q_btnh.dtype)
