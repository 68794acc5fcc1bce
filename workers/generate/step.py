"""One step of batched generation: each slot feeds its next tokens, writes their keys and
values into its own cache, and returns the requested hooks and the logits of its last
fed token.

Unlike `workers.attention.kv_cache` (a ring with one write pointer: every slot advances one row per
step), a generating slot advances by a prompt chunk or by one token, whenever its own
document needs, so each slot's cache is a plain array of its document's keys in position
order, written at the slot's own `start`. A query at position p sees the cached keys at
positions <= p (and within the layer's sliding window): keys a slot wrote beyond its
document's end (garbage from an idle or padded step) are never seen, and its next tokens
overwrite them before any query could see them. A slot's computation reads only its own
cache row, so its bytes never depend on what the other slots hold.

The decoder itself is `workers.model.decoder.block`, given this cache's attention (`attend`), so
generation runs exactly the blocks extraction runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from actx.schemas import errors
from actx.workers.attention import dispatch as attn_lib
from actx.workers.attention import xla as attention_xla, decode_flash
from actx.workers.model import checkpoint, families, moe
from actx.workers.model import decoder as model_lib
from actx.workers.model import rope
from actx.workers.model.config import ModelConfig

log = logging.getLogger("actx.worker")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotCache:
    """k/v: [layers, slots, capacity, kv_heads, head_dim] in the compute dtype, RoPE
    applied; index c of a slot holds the key of its document's position c.
    seen_bv: [slots, vocab] bool, the ids each slot's sample has fed so far (its prompt and
    generated tokens: what HF's repetition penalty looks at); [slots, 0] where the run has
    no repetition penalty. The generator keeps it (`step` passes it through)."""

    k_lbckh: jax.Array
    v_lbckh: jax.Array
    seen_bv: jax.Array

    @property
    def capacity(self) -> int:
        return self.k_lbckh.shape[2]


def zeros(cfg: ModelConfig, slots: int, capacity: int, dtype, seen: bool = False
          ) -> SlotCache:
    """An empty cache; seen: with the [slots, vocab] record of fed ids."""
    shape = (cfg.num_layers, slots, capacity, cfg.num_kv_heads, cfg.head_dim)
    return SlotCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                     jnp.zeros((slots, cfg.vocab_size if seen else 0), bool))


# The record of fed ids: slots over `data`, as the cache's.
SEEN_AXES = ("batch", None)


@dataclasses.dataclass(frozen=True)
class LMHead:
    """weight_vd: the unembedding [vocab, hidden] (the embedding where tied);
    final_softcap: logits -> cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping),
    None: none."""

    weight_vd: jax.Array
    final_softcap: float | None = None


def load_lm_head(path: str | os.PathLike, model: model_lib.Model) -> LMHead:
    """The LM head of the checkpoint at `path` (as `model_lib.load_pretrained` read it),
    in the model's dtype: the family's LM head (`lm_head.weight`; GPT-NeoX's
    `embed_out.weight`), or the embedding where the config ties them."""
    cfg = model.config
    with checkpoint.local_checkpoint_dir(path) as directory:
        with open(os.path.join(directory, "config.json")) as f:
            hf = json.load(f)
        text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else hf
        softcap = text.get("final_logit_softcapping")
        if cfg.tie_word_embeddings:
            weight = model.params["embed_vd"]
        else:
            reader = checkpoint.TensorReader(directory)
            name = families.of(cfg).lm_head
            if name not in reader:
                raise ValueError(f"{path}: the checkpoint has no {name!r} and its config "
                                 f"does not tie it to the embedding (tie_word_embeddings)")
            expected = (cfg.vocab_size, cfg.hidden_size)
            if reader.shape_of(name) != expected:
                raise ValueError(f"{path}: tensor {name!r} has shape "
                                 f"{reader.shape_of(name)}, expected {expected}")
            weight = jax.device_put(np.asarray(reader.read(name),
                                               np.dtype(jnp.dtype(model.dtype))))
    return LMHead(weight, None if softcap is None else float(softcap))


ATTENTIONS = ("xla", "pallas")


def attention_for(dtype, cfg: ModelConfig, capacity: int, requested: str | None = None
                  ) -> str:
    """How a generating step attends: `requested`, else the Pallas kernel on TPUs and for
    half precision on GPUs (as extraction: Triton's float32 products round to TF32), else
    XLA; a kernel that cannot compile here falls back to XLA with one log line."""
    backend = jax.default_backend()
    wanted = requested or ("pallas" if backend == "tpu" or (
        backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)) else "xla")
    if wanted not in ATTENTIONS:
        raise ValueError(f"generation attention {wanted!r}: choose one of "
                         f"{', '.join(ATTENTIONS)}")
    if wanted == "pallas" and cfg.attention_sinks:
        log.warning("generation attention: the Pallas kernel has no attention sinks (%s's "
                    "per-head sink logits); using XLA", cfg.architecture)
        return "xla"
    if wanted == "pallas" and backend in ("gpu", "tpu"):
        why = _kernel_compiles(jnp.dtype(dtype).name, cfg.num_heads, cfg.num_kv_heads,
                               cfg.head_dim, capacity, cfg.attn_logit_softcap)
        if why is not None:
            log.warning("generation attention: the Pallas kernel cannot run here (%s); "
                        "using XLA", why)
            return "xla"
    return wanted


@functools.lru_cache(maxsize=None)
def _kernel_compiles(dtype_name, heads, kv_heads, head_dim, capacity, softcap) -> str | None:
    """None where the decode kernel compiles for one slot of these shapes, else why not:
    a decode step (one query a slot) and a prefill chunk of `decode_flash.ROW_TILE_MAX`
    positions (query rows in several whole tiles), the two shapes of tiles it runs."""
    for queries in (1, min(decode_flash.ROW_TILE_MAX, capacity)):
        q = jax.ShapeDtypeStruct((1, queries, heads, head_dim), jnp.dtype(dtype_name))
        kv = jax.ShapeDtypeStruct((1, capacity, kv_heads, head_dim), jnp.dtype(dtype_name))
        pos = jax.ShapeDtypeStruct((1, queries), jnp.int32)
        try:
            jax.jit(functools.partial(decode_flash.attention, window=capacity,
                                      scale=head_dim ** -0.5, softcap=softcap)).lower(
                q, kv, kv, pos).compile()
        except Exception as err:  # noqa: BLE001 - any compile failure means "not here"
            return f"{type(err).__name__}: {errors.first_line(err, 400)}"
    return None


def _attention(q_btnh, k_bckh, v_bckh, positions_bt, window, scale, softcap, sinks=None):
    """Each query over its slot's cached keys at positions <= its own and less than
    `window` back; logits and softmax in float32, with the heads' sink logits where the
    model has them (as `attention_xla.rows_attention`)."""
    b, t, n, h = q_btnh.shape
    q_bkgth = attention_xla.queries_by_kv_head(q_btnh, k_bckh.shape[2])
    logits = jnp.einsum("bkgth,bckh->bkgtc", q_bkgth, k_bckh,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    key_pos_c = jnp.arange(k_bckh.shape[1], dtype=jnp.int32)
    back_btc = positions_bt[..., None] - key_pos_c
    seen_btc = (back_btc >= 0) & (back_btc < window)
    logits = jnp.where(seen_btc[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = attention_xla.softmax(logits, attention_xla.sinks_by_kv_head(
        sinks, k_bckh.shape[2])).astype(v_bckh.dtype)
    return jnp.einsum("bkgtc,bckh->btkgh", probs, v_bckh).reshape(b, t, n, h)


def _write(cache_bckh, row_btkh, positions_bt):
    """The cache with the row's keys at their positions (beyond the capacity: dropped)."""
    b_idx = jnp.arange(cache_bckh.shape[0])[:, None]
    return cache_bckh.at[b_idx, positions_bt].set(row_btkh.astype(cache_bckh.dtype),
                                                  mode="drop")


def step(params: dict, head: LMHead, cfg: ModelConfig, cache: SlotCache,
         tokens_bt: jax.Array, start_b: jax.Array, last_b: jax.Array, *,
         point_layers: Mapping[str, tuple[int, ...]], global_points: tuple[str, ...],
         out_dtype, attention: str = "xla") -> tuple[dict[str, jax.Array], jax.Array, SlotCache]:
    """Feeds tokens_bt [b, t] at positions start_b + 0..t-1 of each slot's document.

    last_b: the index in the row of each slot's last real token, whose logits are returned.
    attention: "xla" (`_attention`) or "pallas" (`workers.attention.decode_flash`; `attention_for`).
    Returns ({hook: [b, t, width]}, float32 logits [b, vocab], the updated cache). Every
    layer runs (the logits need them all); tokens past a slot's real ones compute garbage
    that the caller drops.
    """
    b, t = tokens_bt.shape
    positions_bt = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)
    x_btd = model_lib.embed(params, cfg, tokens_bt, positions_bt)
    out: dict[str, jax.Array] = {}
    if "embed" in global_points:
        out["embed"] = x_btd.astype(out_dtype)
    cos_bth, sin_bth, local_cos_sin = rope.step_rope(
        cfg, positions_bt, jnp.ones_like(tokens_bt), x_btd.dtype, cached=True)
    num = cfg.num_layers
    windows = np.array([attn_lib.NO_WINDOW if w is None else w
                        for w in cfg.window_per_layer], np.int32)
    points, slots = model_lib.hook_slots(point_layers, num)
    buffers = {p: jnp.zeros((len(point_layers[p]) + 1, b, t, model_lib.point_width(cfg, p)),
                            model_lib.point_dtype(p, out_dtype)) for p in points}
    scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim ** -0.5
    expert_matmuls = model_lib.EXPERT_MATMULS or moe.default_implementation()

    def body(carry, xs):
        x_btd, buffers = carry
        layer, window, is_local, slot, cache_k, cache_v = xs
        layer_params, cos, sin = model_lib.layer_inputs(params, cfg, layer, is_local, cos_bth,
                                                        sin_bth, local_cos_sin)
        written = {}

        def attend(q_btnh, k_btkh, v_btkh):
            written["k"] = _write(cache_k, k_btkh, positions_bt)
            written["v"] = _write(cache_v, v_btkh, positions_bt)
            if attention == "pallas":
                return decode_flash.attention(q_btnh, written["k"], written["v"],
                                              positions_bt, window, scale=scale,
                                              softcap=cfg.attn_logit_softcap)
            return _attention(q_btnh, written["k"], written["v"], positions_bt, window,
                              scale, cfg.attn_logit_softcap, layer_params.get("sinks_ln"))

        hooks, _ = model_lib.block(layer_params, x_btd, cos, sin, None, None, cfg,
                                   moe_impl=expert_matmuls, attend=attend, layer=layer)
        buffers = {p: jax.lax.dynamic_update_index_in_dim(
            buffers[p], hooks[p].astype(buffers[p].dtype), slot[p], 0) for p in points}
        return (hooks["resid_post"], buffers), (written["k"], written["v"])

    xs = (jnp.arange(num, dtype=jnp.int32), jnp.asarray(windows),
          jnp.asarray(np.asarray(cfg.local_rope_per_layer, bool)), slots,
          cache.k_lbckh, cache.v_lbckh)
    (x_btd, buffers), (k_lbckh, v_lbckh) = jax.lax.scan(body, (x_btd, buffers), xs)
    for point in points:
        for j, layer in enumerate(point_layers[point]):
            out[f"layers.{layer}.{point}"] = buffers[point][j]
    normed_btd = model_lib.final_norm(params, cfg, x_btd)
    if "final_norm" in global_points:
        out["final_norm"] = normed_btd.astype(out_dtype)
    last_bd = jnp.take_along_axis(normed_btd, last_b[:, None, None], axis=1)[:, 0]
    # In the compute dtype, soft-capped there, then float32: as HF's forward and generate.
    logits_bv = jnp.einsum("bd,vd->bv", last_bd, head.weight_vd.astype(last_bd.dtype))
    if head.final_softcap is not None:
        cap = jnp.asarray(head.final_softcap, logits_bv.dtype)
        logits_bv = jnp.tanh(logits_bv / cap) * cap
    return out, logits_bv.astype(jnp.float32), dataclasses.replace(
        cache, k_lbckh=k_lbckh, v_lbckh=v_lbckh)
