"""The rotary position tables of a step's tokens (RoPE), computed once per step and shared
by every layer of the scan: the global layers' cos and sin (longrope's long factors for
documents past the original context), and Gemma 3's local layers' own."""

from __future__ import annotations

import jax.numpy as jnp

from actx.workers.attention import dispatch as attn_lib
from actx.workers.model.config import ModelConfig


def _tables(cfg: ModelConfig, positions_bt, segment_ids_bt, dtype, cached: bool):
    """cos and sin of the global layers' RoPE. Longrope takes its long factors for the
    tokens of documents longer than original_max_position_embeddings, as HF run on that
    document does; a document's length is its segment's last position + 1 in the row,
    so rows through the cache (documents longer than a row) cannot know it: refused."""
    rope = cfg.rope
    inv_freq = jnp.asarray(rope.inv_freq(cfg.head_dim), jnp.float32)
    short = attn_lib.rope_cos_sin(positions_bt, inv_freq, dtype, rope.attention_factor)
    if not rope.has_long_factors:
        return short
    if cached:
        raise ValueError(
            f"{cfg.architecture}: longrope switches to its long factors for a whole "
            f"document longer than original_max_position_embeddings="
            f"{rope.original_max_position_embeddings}, which rows of a long document seen "
            f"through the KV cache cannot know; extract without max_context (documents "
            f"as rows), or use a checkpoint whose long and short factors are equal")
    long_inv_freq = jnp.asarray(rope.inv_freq(cfg.head_dim, long=True), jnp.float32)
    long = attn_lib.rope_cos_sin(positions_bt, long_inv_freq, dtype, rope.attention_factor)
    same_bts = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    length_bt = jnp.max(jnp.where(same_bts, positions_bt[:, None, :], -1), axis=-1) + 1
    is_long_bt1 = (length_bt > rope.original_max_position_embeddings)[..., None]
    return (jnp.where(is_long_bt1, long[0], short[0]), jnp.where(is_long_bt1, long[1], short[1]))


def step_rope(cfg: ModelConfig, positions_bt, segment_ids_bt, dtype, cached: bool) -> tuple:
    """(cos, sin, the local layers' (cos, sin) or None) of a step's tokens, once per step:
    Gemma 3's local layers rotate with their own RoPE (its attention factor too: YaRN's
    scales their cos and sin as HF's Gemma3RotaryEmbedding does per layer type)."""
    cos_bth, sin_bth = _tables(cfg, positions_bt, segment_ids_bt, dtype, cached=cached)
    local_cos_sin = None
    if cfg.local_rope is not None:
        local_inv_freq = jnp.asarray(cfg.local_rope.inv_freq(cfg.head_dim), jnp.float32)
        local_cos_sin = attn_lib.rope_cos_sin(positions_bt, local_inv_freq, dtype,
                                              cfg.local_rope.attention_factor)
    return cos_bth, sin_bth, local_cos_sin
