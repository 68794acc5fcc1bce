"""The per-slot KV cache that carries a long document's context from row to row.

Chunked prefill, as inference engines do it: the rows of one document go through the same
batch slot in successive steps, and the slot's cache holds the document's keys and values
of the earlier rows, for every layer that runs. Every slot advances by exactly one row per
step, so the cache is a ring of `blocks` blocks of seq_len tokens with one write pointer
for the whole batch: a step attends to the valid blocks, then writes its row into the
block at `ptr`. `pos` holds the document position of every cached key (-1: empty); a slot
that starts another document forgets by resetting its `pos`, and the max_context window is
a comparison of positions. Shapes are static, so the step compiles once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from actx.workers.attention import xla as attention_xla
from actx.workers.model.config import ModelConfig

# Logical axes (see workers.model.sharding): slots split over `data`, kv heads over `model`.
KV_AXES = ("layers", "batch", None, "kv_heads", "head_dim")
POS_AXES = ("batch", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k/v: [layers_run, batch, capacity, kv_heads, head_dim] in the compute dtype, RoPE
    applied; pos_bc: int32 [batch, capacity], document position of each key or -1;
    ptr: int32 scalar, the block the next row is written to."""

    k_lbckh: jax.Array
    v_lbckh: jax.Array
    pos_bc: jax.Array
    ptr: jax.Array

    @property
    def capacity(self) -> int:
        return self.k_lbckh.shape[2]


def capacity_tokens(max_context: int, seq_len: int) -> int:
    """Cached tokens per slot: whole rows covering the max_context - 1 tokens before a row."""
    blocks = max(1, -(-(max_context - 1) // seq_len))
    return blocks * seq_len


def cache_bytes(cfg: ModelConfig, layers_run: int, batch: int, capacity: int,
                itemsize: int) -> int:
    """Bytes of keys and values for `batch` slots (positions are negligible)."""
    return 2 * layers_run * batch * capacity * cfg.num_kv_heads * cfg.head_dim * itemsize


def zeros(cfg: ModelConfig, layers_run: int, batch: int, capacity: int,
          dtype: jnp.dtype) -> KVCache:
    """An empty cache (host-side shapes; the step places it on its sharding)."""
    kv_shape = (layers_run, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype),
                   jnp.full((batch, capacity), -1, jnp.int32), jnp.zeros((), jnp.int32))


def logical_axes() -> KVCache:
    """The same tree with each leaf's logical axes."""
    return KVCache(KV_AXES, KV_AXES, POS_AXES, ())


def attention_scratch_bytes(slots_per_device: int, heads_per_device: int, seq_len: int,
                            capacity: int = 0, implementation: str | None = None,
                            kv_bytes_per_token: int = 0) -> int:
    """The working set of the cached attention of one layer on one device, for the way it
    runs (`workers.attention.dispatch.implementation_for`; None: the larger of XLA's and cuDNN's).

    xla: the float32 logits, their exponentials and the masked copy, [slots, heads, query
    chunk, seq_len] each (the row part and one cache block at a time, one query chunk at
    a time). cudnn: the fused call's mask over every cached and row key, [slots, seq_len,
    capacity + seq_len], as booleans and as a half-precision bias. The Pallas kernels keep
    their tiles on chip; the TPU one reads the cache through a head-major copy of it
    (`kv_bytes_per_token`: keys and values of one token of one layer, all kv heads).
    """
    chunk = attention_xla.query_chunk_size(seq_len)
    xla = 3 * slots_per_device * heads_per_device * chunk * seq_len * 4
    fused = slots_per_device * seq_len * (capacity + seq_len) * (1 + 2)
    if implementation == "xla":
        return xla
    if implementation == "cudnn":
        return fused
    if implementation == "pallas_gpu":
        return 0
    if implementation == "pallas_tpu":
        return slots_per_device * (capacity + seq_len) * kv_bytes_per_token
    return max(xla, fused)


# The share of a device's memory a job may plan for; the rest is for other activations and
# the compiler's buffers.
DEVICE_FRACTION = 0.9


def check_fits(cache_per_device_bytes: int, weights_per_device_bytes: int,
               scratch_per_device_bytes: int, device_bytes: int | None, *, max_context: int,
               slots_per_device: int, layers_run: int, device_kind: str) -> None:
    """Refuses a max_context whose cache would not fit beside the weights and the
    attention's working set.

    device_bytes: the device's memory (None where the backend does not say, e.g. the CPU:
    then nothing is checked). Leaves 10% for other activations and the compiler's buffers.
    """
    if not device_bytes:
        return
    need = cache_per_device_bytes + weights_per_device_bytes + scratch_per_device_bytes
    if need <= DEVICE_FRACTION * device_bytes:
        return
    gib = 1 << 30
    raise ValueError(
        f"packing.max_context={max_context}: the KV cache needs "
        f"{cache_per_device_bytes / gib:.2f} GiB per device ({slots_per_device} batch slots x "
        f"{layers_run} layers x max_context tokens) beside {weights_per_device_bytes / gib:.2f} "
        f"GiB of weights and {scratch_per_device_bytes / gib:.2f} GiB of attention working "
        f"memory, more than 90% of the {device_bytes / gib:.2f} GiB of one {device_kind}. "
        f"Lower the batch size, run fewer layers (hook an earlier layer), raise "
        f"model_parallel, or prepare with a smaller packing.max_context")


def block_positions(positions_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
    """int32 [b, t]: what a row leaves in the cache: the positions of the tokens of the
    document that starts the row (the only one that can continue into the next row), -1
    for other documents and padding."""
    first_segment_b1 = segment_ids_bt[:, :1]
    keep = (segment_ids_bt == first_segment_b1) & (segment_ids_bt > 0)
    return jnp.where(keep, positions_bt, -1).astype(jnp.int32)


def reset_slots(pos_bc: jax.Array, continues_b: jax.Array) -> jax.Array:
    """Forgets the cache of every slot whose row does not continue its previous row."""
    return jnp.where(continues_b[:, None], pos_bc, -1)
