"""Rotary embeddings, what each token sees, and grouped-query attention on each backend.

What a token sees is defined by two masks: `attention_mask` within the row (block-diagonal
causal over segment ids, 0 = padding, optionally limited to a sliding window, so packed
documents see only themselves; padding sees earlier padding and always itself, so no row
of the softmax is empty) and `cached_keys_seen` over the keys a slot cached from its
document's earlier rows (workers.attention.kv_cache). The attention itself takes the same as one
key interval per query (workers.attention.key_ranges; tests/test_key_ranges.py holds the two equal),
and each backend runs it with the kernel that skips the keys outside the intervals:

  xla         XLA query chunks and cache block visits (workers.attention.xla): the CPU
  pallas_gpu  a Pallas flash-attention kernel (Triton) over the intervals: half precision
              on GPUs (workers.attention.ranged_flash_gpu)
  pallas_tpu  a Pallas flash-attention kernel (Mosaic) over the intervals, the cache ring
              walked by its index maps: TPUs (workers.attention.ranged_flash_tpu)
  cudnn       one fused cuDNN attention over [cache, row] with the dense mask: every cached
              key computed (the GPU's fallback where the Pallas kernel cannot run)

`implementation_for` picks one per backend, dtype and shape once, and says in one log line
when it falls back.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from actx.schemas import errors
from actx.workers.attention import (xla as attention_xla, key_ranges, ranged_flash_gpu,
                                    ranged_flash_tpu)

log = logging.getLogger(__name__)

# Stands in for "no sliding window" inside the layer scan, where the window is traced.
NO_WINDOW = 2**30


def rope_cos_sin(positions_bt: jax.Array, inv_freq_f: jax.Array,
                 dtype: jnp.dtype, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin [b, t, r] for rotate-half RoPE over r rotary dims, computed in float32
    like HF; scale: multiplies both before the cast (longrope's attention factor)."""
    freqs_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq_f.astype(jnp.float32)
    emb_bth = jnp.concatenate([freqs_btf, freqs_btf], axis=-1)
    cos_bth, sin_bth = jnp.cos(emb_bth), jnp.sin(emb_bth)
    if scale != 1.0:
        cos_bth, sin_bth = cos_bth * scale, sin_bth * scale
    return cos_bth.astype(dtype), sin_bth.astype(dtype)


def apply_rope(x_btnh: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array) -> jax.Array:
    """Rotates pairs (i, i + r/2) of each head's first r dims (r: cos' width; the rest
    pass unrotated: partial rotary), the HF `rotate_half` convention."""
    rotary = cos_bth.shape[-1]
    if rotary < x_btnh.shape[-1]:
        return jnp.concatenate([apply_rope(x_btnh[..., :rotary], cos_bth, sin_bth),
                                x_btnh[..., rotary:]], axis=-1)
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


def cached_keys_seen(cache_pos_bc: jax.Array, q_pos_bt: jax.Array,
                     q_continues_bt: jax.Array, window: jax.Array | int) -> jax.Array:
    """Boolean [b, t, c]: query t sees cached key c. Only a query that continues the
    slot's document does, and only keys the slot holds (pos >= 0) that are earlier than
    it and within the window (q_pos - window < pos < q_pos)."""
    pos_b1c = cache_pos_bc[:, None, :]
    q_pos_bt1 = q_pos_bt[:, :, None]
    return (q_continues_bt[:, :, None] & (pos_b1c >= 0) & (pos_b1c < q_pos_bt1)
            & (q_pos_bt1 - pos_b1c < window))


IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu", "cudnn")
# The Pallas kernels over key intervals: one `ranged_attention` contract, with or without
# a cache.
_KERNELS = {"pallas_gpu": ranged_flash_gpu, "pallas_tpu": ranged_flash_tpu}


def default_implementation(dtype: jnp.dtype) -> str:
    """The preferred way on this backend: "pallas_tpu" on TPUs, "pallas_gpu" for half
    precision on GPUs (float32 keeps XLA there: Triton's float32 products round to TF32),
    else "xla"."""
    backend = jax.default_backend()
    if backend == "tpu":
        return "pallas_tpu"
    if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "pallas_gpu"
    return "xla"


def implementation_for(dtype: jnp.dtype, seq_len: int, head_dim: int,
                       softcap: float | None = None, requested: str | None = None,
                       sinks: bool = False) -> str:
    """The way attention runs for these shapes: `requested` (else the backend's default)
    where it can run, else its fallback (pallas_gpu -> cudnn -> xla, pallas_tpu -> xla),
    with one log line saying why. Decided once per shape, before tracing: a kernel that
    cannot compile here fails at compile time, too late to fall back inside a trace.
    sinks: the heads have sink logits (gpt-oss), which only the XLA way computes: any
    other way falls back to it, saying so."""
    wanted = requested or default_implementation(dtype)
    if wanted not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {wanted!r}: choose one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    if sinks and wanted != "xla":
        _warn_sinks(wanted)
        return "xla"
    return _resolve(wanted, jnp.dtype(dtype).name, seq_len, head_dim, softcap)


@functools.lru_cache(maxsize=None)
def _warn_sinks(wanted: str) -> None:
    log.warning("attention: %s has no attention sinks (the model's per-head sink logits); "
                "using xla", wanted)


@functools.lru_cache(maxsize=None)
def _resolve(wanted, dtype_name, seq_len, head_dim, softcap) -> str:
    why = None
    if wanted == "pallas_gpu":
        why = ranged_flash_gpu.supports(seq_len, head_dim, jax.default_backend() == "gpu") \
            or _compiles(ranged_flash_gpu.ranged_attention, dtype_name, seq_len, head_dim,
                         softcap)
        fallback = "cudnn" if softcap is None else "xla"
    elif wanted == "pallas_tpu":
        why = ranged_flash_tpu.supports(seq_len, jax.default_backend() == "tpu") \
            or _compiles(ranged_flash_tpu.ranged_attention, dtype_name, seq_len, head_dim,
                         softcap)
        fallback = "xla"
    elif wanted == "cudnn" and softcap is not None:
        why, fallback = "cuDNN attention has no logit soft-capping", "xla"
    if why is None:
        return wanted
    log.warning("attention: %s cannot run here (%s); using %s", wanted, why, fallback)
    return _resolve(fallback, dtype_name, seq_len, head_dim, softcap)


def _compiles(kernel, dtype_name, seq_len, head_dim, softcap) -> str | None:
    """None where the kernel compiles for one slot of these shapes, else the error."""
    if jax.default_backend() == "cpu":
        return None  # interpret mode: nothing to compile that could fail
    q = jax.ShapeDtypeStruct((1, seq_len, 1, head_dim), jnp.dtype(dtype_name))
    r = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    try:
        jax.jit(functools.partial(kernel, scale=head_dim ** -0.5, softcap=softcap)).lower(
            q, q, q, r, r).compile()
    except Exception as err:  # noqa: BLE001 - any compile failure means "not here"
        return f"{type(err).__name__}: {errors.first_line(err, 400)}"
    return None


def attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, lo_bt: jax.Array,
              hi_bt: jax.Array, implementation: str | None = None,
              scale: float | None = None, softcap: float | None = None,
              sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention [b, t, n, h] of rows seen alone; k/v heads are shared by
    n // k query heads; query t sees the row's keys [lo, hi) (workers.attention.key_ranges).

    scale: of the logits (default head_dim ** -0.5); softcap: logits -> softcap *
    tanh(logits / softcap) before the mask (Gemma 2); sinks: each head's sink logit [n]
    in the softmax's denominator (gpt-oss; the XLA way).
    """
    b, t, n, h = q_btnh.shape
    scale = h ** -0.5 if scale is None else scale
    way = implementation_for(q_btnh.dtype, t, h, softcap, implementation, sinks is not None)
    if way in _KERNELS:
        return _KERNELS[way].ranged_attention(q_btnh, k_btkh, v_btkh, lo_bt, hi_bt,
                                              scale=scale, softcap=softcap)
    if way == "cudnn":
        out = _cudnn(q_btnh, k_btkh, v_btkh, key_ranges.dense_mask(lo_bt, hi_bt, t), scale)
        if out is not None:
            return out
    return attention_xla.rows_attention(q_btnh, k_btkh, v_btkh, lo_bt, hi_bt, scale, softcap,
                                        sinks)


def _cudnn(q_btnh, keys_bskh, values_bskh, mask_bts, scale) -> jax.Array | None:
    """One fused cuDNN attention with a dense mask, or None where cuDNN refuses it (at
    trace time, for some shapes and versions; XLA is always correct)."""
    try:
        return jax.nn.dot_product_attention(q_btnh, keys_bskh, values_bskh,
                                            mask=mask_bts[:, None], scale=scale,
                                            implementation="cudnn")
    except (ValueError, NotImplementedError, RuntimeError) as err:
        log.warning("cuDNN attention unavailable (%s); using the XLA implementation", err)
        return None


def default_slots_per_visit(batch: int, data_shards: int) -> int:
    """Slots that visit their cached blocks together in the XLA path.

    On the CPU one slot per device at a time: each visit is compute-bound there, so
    following each slot's own depth saves the work of the slots that hold less. On GPUs
    and TPUs a visit of one slot is a handful of tiny kernels, launch-bound (one slot at a
    time made the exact context 12x slower than rows alone on an H100): all slots at once.
    """
    return data_shards if jax.default_backend() == "cpu" else batch


def cached_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                     lo_bt: jax.Array, hi_bt: jax.Array, cache_k_bckh: jax.Array,
                     cache_v_bckh: jax.Array, ptr: jax.Array, data_shards: int = 1,
                     implementation: str | None = None, slots_per_visit: int | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Attention [b, t, n, h] over the row itself and the slot's cached earlier rows.

    [lo, hi) index the keys in document order: the cache ring [b, C, k, h] from its block
    `ptr` (the oldest) onwards, then the row's keys (workers.attention.key_ranges). Every way reads
    the ring where it lies and computes a slot from its own inputs only, so a slot's bytes
    never depend on what the other slots hold. slots_per_visit: the XLA way's group of
    slots (`default_slots_per_visit`); sinks: as `attention`'s.
    """
    b, t, n, h = q_btnh.shape
    scale = h ** -0.5 if scale is None else scale
    way = implementation_for(q_btnh.dtype, t, h, softcap, implementation, sinks is not None)
    if way in _KERNELS:
        return _KERNELS[way].ranged_attention(
            q_btnh, k_btkh, v_btkh, lo_bt, hi_bt, cache_k_bckh, cache_v_bckh, ptr,
            scale=scale, softcap=softcap, block_len=t)
    if way == "cudnn":
        out = fused_cached_attention(q_btnh, k_btkh, v_btkh, lo_bt, hi_bt, cache_k_bckh,
                                     cache_v_bckh, ptr, scale)
        if out is not None:
            return out
    return attention_xla.cached_attention(
        q_btnh, k_btkh, v_btkh, lo_bt, hi_bt, cache_k_bckh, cache_v_bckh, ptr, data_shards,
        slots_per_visit or default_slots_per_visit(b, data_shards), scale, softcap, sinks)


def fused_cached_attention(q_btnh, k_btkh, v_btkh, lo_bt, hi_bt, cache_k_bckh, cache_v_bckh,
                           ptr, scale: float, implementation: str = "cudnn"
                           ) -> jax.Array | None:
    """One attention over [cache keys as they lie in the ring, row keys] (the order within
    a softmax does not matter) with the intervals' dense mask, through
    `jax.nn.dot_product_attention`; it computes every cached key, held or not.
    implementation "xla" computes the same on any backend (tests)."""
    t, cache_len = q_btnh.shape[1], cache_k_bckh.shape[1]
    keys = jnp.concatenate([cache_k_bckh.astype(k_btkh.dtype), k_btkh], axis=1)
    values = jnp.concatenate([cache_v_bckh.astype(v_btkh.dtype), v_btkh], axis=1)
    mask = jnp.concatenate(
        [key_ranges.physical_cache_mask(lo_bt, hi_bt, cache_len, t, ptr),
         key_ranges.dense_mask(lo_bt - cache_len, hi_bt - cache_len, t)], axis=-1)
    if implementation == "cudnn":
        return _cudnn(q_btnh, keys, values, mask, scale)
    return jax.nn.dot_product_attention(q_btnh, keys, values, mask=mask[:, None],
                                        scale=scale, implementation=implementation)
