"""The decoder (Qwen2/3, Llama, Mistral, Gemma 2/3, Phi-3, OLMo 2, the mixtures of
experts, gpt-oss among them, GPT-2, GPT-NeoX) as pure functions over a parameter
pytree; the families' differences are flags of `ModelConfig`.

Layers are stacked on a leading axis and run with `jax.lax.scan`, so compile time does
not grow with depth. `forward` returns only the requested activations: per-layer captures
are written into small per-point buffers inside the scan (unrequested layers write a
scratch slot), and the scan stops after the last layer anyone asked for. No LM head.
`forward_cached` runs rows of long documents with a per-slot KV cache (workers.attention.kv_cache),
so a document's later rows attend to its earlier ones exactly as one long sequence would.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from actx.workers.attention import dispatch as attn_lib
from actx.workers.model import capture
from actx.workers.model import checkpoint
from actx.workers.attention import key_ranges
from actx.workers.attention import kv_cache
from actx.workers.model import mlp as mlp_lib
from actx.workers.model import moe
from actx.workers.model import rope as rope_lib
from actx.workers.model import families
from actx.workers.model.config import ModelConfig

# The decoder's public functions (ModelConfig is workers.model.config's).
__all__ = ["Model", "load_pretrained", "forward", "forward_cached"]

# A mixture of experts' matmuls, one of workers.model.moe.IMPLEMENTATIONS; None: the backend's
# (`moe.default_implementation`). Read when a step is traced.
EXPERT_MATMULS: str | None = None

Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded decoder.

    config: shapes and options.
    params: {"embed_vd", "final_norm_d", "layers": {name: [num_layers, ...]}}.
    param_axes: the same tree with logical axis names per dimension.
    mesh: the mesh the params were placed on, or None for a single device.
    digest: crc32c of config.json and every weight file, in name order (the identity of
      the weights: a run refuses to continue with other weights at the same path).
    """

    config: ModelConfig
    params: dict
    param_axes: dict
    mesh: jax.sharding.Mesh | None = None
    digest: str = ""

    @property
    def dtype(self) -> jnp.dtype:
        return self.params["embed_vd"].dtype


def load_pretrained(path: str | os.PathLike, dtype: str = "float32",
                    mesh: jax.sharding.Mesh | None = None) -> Model:
    """Loads an HF checkpoint directory (local path, gs://bucket/dir or memory://dir).

    dtype: "float32" or "bfloat16" (also "float16"), for weights and compute.
    mesh: place each weight straight into its NamedSharding on this mesh.
    """
    np_dtype = np.dtype(jnp.dtype(dtype))
    with checkpoint.local_checkpoint_dir(path) as directory:
        config_path = os.path.join(directory, "config.json")
        if not os.path.exists(config_path):
            raise ValueError(f"{path}: no config.json in the checkpoint directory")
        with open(config_path) as f:
            config = families.config_from_hf(json.load(f), source=f"{path}/config.json")
        reader = checkpoint.TensorReader(directory)
        params = checkpoint.load_params(reader, config, np_dtype, mesh, source=str(path))
        digest = checkpoint.digest(directory)  # files are in the page cache by now
    return Model(config, params, checkpoint.param_logical_axes(config), mesh, digest)


def rms_norm(x_btd: jax.Array, weight_d: jax.Array, eps: float,
             gemma: bool = False, scale_fp32: bool = False) -> jax.Array:
    """RMSNorm computed in float32, then scaled in the input dtype (as HF does); Gemma's
    scales by (1 + w) in float32 and casts last (HF's Gemma2RMSNorm / Gemma3RMSNorm);
    scale_fp32: scales by w in float32 and casts last (HF's Olmo2RMSNorm and
    GptOssRMSNorm)."""
    x32 = x_btd.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if gemma:
        return (normed * (1.0 + weight_d.astype(jnp.float32))).astype(x_btd.dtype)
    if scale_fp32:
        return (weight_d.astype(jnp.float32) * normed).astype(x_btd.dtype)
    return weight_d * normed.astype(x_btd.dtype)


def layer_norm(x_btd: jax.Array, weight_d: jax.Array, bias_d: jax.Array,
               eps: float) -> jax.Array:
    """LayerNorm with a bias (GPT-2, GPT-NeoX), in float32 and cast last, as torch's
    layer_norm computes a bfloat16 input."""
    x32 = x_btd.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(var + eps)
    return (normed * weight_d.astype(jnp.float32)
            + bias_d.astype(jnp.float32)).astype(x_btd.dtype)


def norm(x_btd: jax.Array, p: Mapping[str, jax.Array], name: str,
         cfg: ModelConfig) -> jax.Array:
    """The family's norm with weight p[name] (and bias p[name with _bias] for LayerNorm):
    name is e.g. "attn_norm_ld", its bias "attn_norm_bias_ld". Every norm of a family
    whose RMSNorm scales in float32 (`cfg.norm_scale_fp32`) does so: the block's input
    norms as well as the final one."""
    if cfg.layer_norm:
        stem, _, axes = name.rpartition("_")
        return layer_norm(x_btd, p[name], p[f"{stem}_bias_{axes}"], cfg.rms_norm_eps)
    return rms_norm(x_btd, p[name], cfg.rms_norm_eps, cfg.gemma_norms, cfg.norm_scale_fp32)


def embed(params: dict, cfg: ModelConfig, ids_bt: jax.Array,
          positions_bt: jax.Array) -> jax.Array:
    """What the first block reads: the token embeddings; Gemma's times sqrt(hidden);
    with learned positions, plus the embedding of each token's position in its document
    (GPT-2), so packed rows and rows through the KV cache see HF's positions."""
    x_btd = jnp.take(params["embed_vd"], ids_bt, axis=0)
    if cfg.gemma_norms:
        # sqrt(hidden) rounded to the compute dtype first, as HF's Gemma does.
        x_btd = x_btd * jnp.asarray(cfg.hidden_size ** 0.5, x_btd.dtype)
    if cfg.learned_positions:
        # Positions past the table are refused before any step (step.check_positions).
        x_btd = x_btd + jnp.take(params["pos_embed_pd"], positions_bt, axis=0)
    return x_btd


def final_norm(params: dict, cfg: ModelConfig, x_btd: jax.Array) -> jax.Array:
    """The final norm of the last block's output (what an LM head reads)."""
    return norm(x_btd, params, "final_norm_d", cfg)


def _qk_norm(q_btnh, k_btkh, p, cfg):
    """RMSNorm of queries and keys before RoPE: over each head (Qwen3, Gemma 3) or over
    the whole projection, all heads together (OLMo 2, OLMoE)."""
    eps, gemma = cfg.rms_norm_eps, cfg.gemma_norms
    if cfg.qk_norm:
        return (rms_norm(q_btnh, p["q_norm_lh"], eps, gemma),
                rms_norm(k_btkh, p["k_norm_lh"], eps, gemma))
    if cfg.qk_norm_full:
        def whole(x_btnh, w_nh):
            b, t = x_btnh.shape[:2]
            flat = rms_norm(x_btnh.reshape(b, t, -1), w_nh.reshape(-1), eps,
                            scale_fp32=cfg.norm_scale_fp32)
            return flat.reshape(x_btnh.shape)
        return whole(q_btnh, p["q_norm_lnh"]), whole(k_btkh, p["k_norm_lkh"])
    return q_btnh, k_btkh


def block(p: Mapping[str, jax.Array], x_btd: jax.Array, cos_bth: jax.Array,
          sin_bth: jax.Array, lo_bt: jax.Array, hi_bt: jax.Array, cfg: ModelConfig,
          attention_impl: str | None = None,
          cached: Mapping[str, jax.Array] | None = None, moe_impl: str = "blocked",
          attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None,
          layer: jax.Array | int = 0
          ) -> tuple[dict[str, jax.Array], tuple[jax.Array, jax.Array]]:
    """One decoder block; returns every hook point of the block, and the row's keys and
    values (RoPE applied) for the cache.

    lo_bt, hi_bt: the keys each query sees, this layer's window applied
      (workers.attention.key_ranges): the row's, or [cache in document order, row] with a cache.
    cached: this layer's cache view (see `forward_cached`); None for rows seen alone.
    moe_impl: a mixture of experts' matmuls, one of `moe.IMPLEMENTATIONS`.
    attend: (q, k, v) of the row (RoPE applied) -> heads [b, t, n, h], in place of the
      attention above (lo/hi and cached unused): generation's per-slot cache
      (workers.generate.step).
    layer: the block's index (GPT-2's scale_attn_by_inverse_layer_idx divides its
      logits by layer + 1).
    """
    gemma, eps = cfg.gemma_norms, cfg.rms_norm_eps
    post_norms = gemma or cfg.post_norms
    h_btd = norm(x_btd, p, "attn_norm_ld", cfg) if cfg.input_norms else x_btd
    q_btnh = jnp.einsum("btd,dnh->btnh", h_btd, p["q_weight_ldnh"])
    k_btkh = jnp.einsum("btd,dkh->btkh", h_btd, p["k_weight_ldkh"])
    v_btkh = jnp.einsum("btd,dkh->btkh", h_btd, p["v_weight_ldkh"])
    if cfg.qkv_bias:
        q_btnh = q_btnh + p["q_bias_lnh"]
        k_btkh = k_btkh + p["k_bias_lkh"]
        v_btkh = v_btkh + p["v_bias_lkh"]
    q_btnh, k_btkh = _qk_norm(q_btnh, k_btkh, p, cfg)
    if not cfg.learned_positions:
        q_btnh = attn_lib.apply_rope(q_btnh, cos_bth, sin_bth)
        k_btkh = attn_lib.apply_rope(k_btkh, cos_bth, sin_bth)
    if cfg.inverse_layer_scale:
        # HF scales the logits by 1 / (layer + 1); on the queries, in float32, the same.
        q_btnh = (q_btnh.astype(jnp.float32)
                  / (jnp.asarray(layer, jnp.float32) + 1.0)).astype(q_btnh.dtype)
    scoring = {"scale": cfg.query_scale, "softcap": cfg.attn_logit_softcap}
    if cfg.attention_sinks:
        scoring["sinks"] = p["sinks_ln"]
    if attend is not None:
        heads_btnh = attend(q_btnh, k_btkh, v_btkh)
    elif cached is None:
        heads_btnh = attn_lib.attention(q_btnh, k_btkh, v_btkh, lo_bt, hi_bt, attention_impl,
                                        **scoring)
    else:
        # Always this path, also where no slot holds context: switching to the row-only
        # attention for such steps would make a slot's bytes depend on what the other
        # slots hold (batch size, host count), and reruns must rewrite identical bytes.
        heads_btnh = attn_lib.cached_attention(
            q_btnh, k_btkh, v_btkh, lo_bt, hi_bt, cached["k_bckh"], cached["v_bckh"],
            cached["ptr"], cached["data_shards"], attention_impl, **scoring)
    # attn_out / mlp_out are what is added to the residual stream: after the post-norms.
    attn_out_btd = jnp.einsum("btnh,nhd->btd", heads_btnh, p["o_weight_lnhd"])
    if cfg.o_bias:
        attn_out_btd = attn_out_btd + p["o_bias_ld"]
    if post_norms:
        attn_out_btd = rms_norm(attn_out_btd, p["attn_post_norm_ld"], eps, gemma,
                                cfg.norm_scale_fp32)
    mid_btd = x_btd + attn_out_btd

    # A parallel block's MLP reads the block's input, not resid_mid (GPT-NeoX).
    mlp_in_btd = x_btd if cfg.parallel_residual else mid_btd
    h_btd = norm(mlp_in_btd, p, "mlp_norm_ld", cfg) if cfg.input_norms else mlp_in_btd
    mlp_out_btd, router_hooks = mlp_lib.mlp(p, h_btd, cfg, moe_impl, layer)
    if post_norms:
        mlp_out_btd = rms_norm(mlp_out_btd, p["mlp_post_norm_ld"], eps, gemma,
                               cfg.norm_scale_fp32)
    if cfg.parallel_residual:
        # HF's order of the sums: mlp_out + attn_out + x.
        post_btd = (mlp_out_btd + attn_out_btd) + x_btd
    else:
        post_btd = mid_btd + mlp_out_btd
    hooks = {"resid_pre": x_btd, "attn_out": attn_out_btd, "mlp_out": mlp_out_btd,
             "resid_post": post_btd, **router_hooks}
    if not cfg.parallel_residual:  # no such point in a parallel block
        hooks["resid_mid"] = mid_btd
    return hooks, (k_btkh, v_btkh)


def layers_to_run(cfg: ModelConfig, point_layers: Mapping[str, tuple[int, ...]],
                  global_points: tuple[str, ...]) -> int:
    """How many blocks the scan runs: up to the last hooked layer, all for final_norm
    (`capture.blocks_run`, the rule the dry run counts FLOPs by too)."""
    return capture.blocks_run(point_layers, global_points, cfg.num_layers)


def point_width(cfg: ModelConfig, point: str) -> int:
    """The last axis of a per-layer point's array (`capture.point_width`)."""
    return capture.point_width(cfg, point)


def point_dtype(point: str, out_dtype) -> jnp.dtype:
    """A point's array dtype: out_dtype, int32 for expert ids (`capture.point_dtype`)."""
    return jnp.dtype(capture.point_dtype(point, jnp.dtype(out_dtype).name))


def forward(params: dict, cfg: ModelConfig, input_ids_bt: jax.Array,
            positions_bt: jax.Array, segment_ids_bt: jax.Array, *,
            point_layers: Mapping[str, tuple[int, ...]],
            global_points: tuple[str, ...] = (),
            out_dtype: jnp.dtype = jnp.float32,
            constrain: Constrain = lambda x, axes: x,
            attention_impl: str | None = None) -> dict[str, jax.Array]:
    """Runs the decoder as far as needed and returns only the requested hooks.

    Every row is seen alone (each segment from its first token in the row).
    point_layers: per-layer point -> layer indices to capture (validated by the caller).
    global_points: any of "embed", "final_norm".
    constrain: applies a sharding constraint given logical axes (identity without a mesh).
    Returns {"embed"?, "final_norm"?, "layers.{i}.{point}"...}, each [b, t, d] out_dtype
    ([b, t, point_width] of point_dtype for a mixture of experts' router points).
    """
    out, _ = _run(params, cfg, input_ids_bt, positions_bt, segment_ids_bt,
                  point_layers=point_layers, global_points=global_points,
                  out_dtype=out_dtype, constrain=constrain, attention_impl=attention_impl)
    return out


def forward_cached(params: dict, cfg: ModelConfig, input_ids_bt: jax.Array,
                   positions_bt: jax.Array, segment_ids_bt: jax.Array,
                   continues_b: jax.Array, cache: kv_cache.KVCache, *, max_context: int,
                   point_layers: Mapping[str, tuple[int, ...]],
                   global_points: tuple[str, ...] = (),
                   out_dtype: jnp.dtype = jnp.float32,
                   constrain: Constrain = lambda x, axes: x,
                   attention_impl: str | None = None, data_shards: int = 1
                   ) -> tuple[dict[str, jax.Array], kv_cache.KVCache]:
    """`forward` for one row per batch slot of long documents (chunked prefill).

    continues_b: bool [b], the slot's row continues the row the slot ran in the previous
      step (same document); the document that starts such a row then attends to the
      cached keys of its earlier rows, within max_context positions.
    cache: the slots' cache from the previous step (`kv_cache.zeros` at first), for
      exactly the layers this call runs. Returns the hooks and the updated cache.
    data_shards: size of the mesh axis the batch is split over (1 without a mesh).
    """
    return _run(params, cfg, input_ids_bt, positions_bt, segment_ids_bt,
                point_layers=point_layers, global_points=global_points,
                out_dtype=out_dtype, constrain=constrain, attention_impl=attention_impl,
                cache=cache, continues_b=continues_b, max_context=max_context,
                data_shards=data_shards)


def hook_slots(point_layers: Mapping[str, tuple[int, ...]], num_run: int) -> tuple:
    """(the captured points, per point slot[i]: layer i's place among its captured layers,
    or the scratch slot (last) for a layer nobody asked for) of a scan over the layers."""
    points = [p for p in point_layers if point_layers[p]]
    slots = {}
    for point in points:
        table = np.full(num_run, len(point_layers[point]), np.int32)
        table[list(point_layers[point])] = np.arange(len(point_layers[point]))
        slots[point] = jnp.asarray(table)
    return points, slots


def layer_inputs(params: dict, cfg: ModelConfig, layer: jax.Array, is_local: jax.Array,
                 cos_bth: jax.Array, sin_bth: jax.Array, local_cos_sin) -> tuple:
    """(the layer's weights, its RoPE cos, sin) inside a scan over the stacked layers: a
    local-attention layer of a model with its own local RoPE takes `local_cos_sin`."""
    cos, sin = cos_bth, sin_bth
    if cfg.local_rope is not None:
        cos = jnp.where(is_local, local_cos_sin[0], cos_bth)
        sin = jnp.where(is_local, local_cos_sin[1], sin_bth)
    layer_params = jax.tree.map(
        lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), params["layers"])
    return layer_params, cos, sin


def _run(params, cfg, input_ids_bt, positions_bt, segment_ids_bt, *, point_layers,
         global_points, out_dtype, constrain, attention_impl, cache=None, continues_b=None,
         max_context=None, data_shards=1):
    b, t = input_ids_bt.shape
    act_axes = ("batch", "seq", "embed")
    x_btd = constrain(embed(params, cfg, input_ids_bt, positions_bt), act_axes)
    out: dict[str, jax.Array] = {}
    if "embed" in global_points:
        out["embed"] = x_btd.astype(out_dtype)

    num_run = layers_to_run(cfg, point_layers, global_points)
    if num_run == 0:
        return out, cache

    cos_bth, sin_bth, local_cos_sin = rope_lib.step_rope(cfg, positions_bt, segment_ids_bt,
                                                x_btd.dtype, cached=cache is not None)
    local_rope = np.asarray(cfg.local_rope_per_layer[:num_run], bool)
    windows = np.array([attn_lib.NO_WINDOW if w is None else w
                        for w in cfg.window_per_layer[:num_run]], np.int32)
    if max_context is not None:
        windows = np.minimum(windows, max_context)

    # Per point: slot[i] = position of layer i among the captured layers, or the scratch
    # slot (last) for layers nobody asked for; buffers hold only captured layers.
    points, slots = hook_slots(point_layers, num_run)
    buf_axes = (None, "batch", "seq", "embed")
    buffers = {p: constrain(jnp.zeros((len(point_layers[p]) + 1, b, t, point_width(cfg, p)),
                                      point_dtype(p, out_dtype)), buf_axes) for p in points}

    shared_view = None
    if cache is not None:
        if cache.k_lbckh.shape[0] != num_run:
            raise ValueError(f"the cache holds {cache.k_lbckh.shape[0]} layers, this step "
                             f"runs {num_run}")
        pos_bc = kv_cache.reset_slots(cache.pos_bc, continues_b)
        q_continues_bt = (continues_b[:, None] & (segment_ids_bt == segment_ids_bt[:, :1])
                          & (segment_ids_bt > 0))
        shared_view = {"pos_bc": pos_bc, "ptr": cache.ptr, "data_shards": data_shards}
        # What each query sees, once per step; each layer applies its own window.
        lo_bt, hi_bt = key_ranges.key_ranges(segment_ids_bt, q_continues_bt,
                                             key_ranges.held_keys(pos_bc), cache.capacity)
    else:
        lo_bt, hi_bt = key_ranges.key_ranges(segment_ids_bt)

    expert_matmuls = EXPERT_MATMULS or moe.default_implementation()

    def body(carry, xs):
        x_btd, buffers = carry
        layer, window, is_local, slot, cache_k, cache_v = xs
        layer_params, cos, sin = layer_inputs(params, cfg, layer, is_local, cos_bth, sin_bth,
                                              local_cos_sin)
        cached = None if shared_view is None else {
            **shared_view, "k_bckh": cache_k, "v_bckh": cache_v}
        hooks, (k_btkh, v_btkh) = block(layer_params, x_btd, cos, sin,
                                        key_ranges.windowed(lo_bt, hi_bt, window), hi_bt,
                                        cfg, attention_impl, cached, expert_matmuls,
                                        layer=layer)
        buffers = {p: constrain(jax.lax.dynamic_update_index_in_dim(
            buffers[p], hooks[p].astype(buffers[p].dtype), slot[p], 0), buf_axes)
            for p in points}
        new_kv = None if cached is None else (k_btkh, v_btkh)
        return (constrain(hooks["resid_post"], act_axes), buffers), new_kv

    no_cache = jnp.zeros((num_run,), jnp.int32)  # scan needs a leaf per layer
    xs = (jnp.arange(num_run, dtype=jnp.int32), jnp.asarray(windows),
          jnp.asarray(local_rope), slots,
          no_cache if cache is None else cache.k_lbckh,
          no_cache if cache is None else cache.v_lbckh)
    (x_btd, buffers), new_kv = jax.lax.scan(body, (x_btd, buffers), xs)

    for point in points:
        for j, layer in enumerate(point_layers[point]):
            out[f"layers.{layer}.{point}"] = buffers[point][j]
    if "final_norm" in global_points:
        out["final_norm"] = final_norm(params, cfg, x_btd).astype(out_dtype)
    if cache is None:
        return out, None
    row_k_ltbkh, row_v_ltbkh = new_kv
    at = cache.ptr * t
    blocks_total = cache.capacity // t
    new_cache = kv_cache.KVCache(
        k_lbckh=jax.lax.dynamic_update_slice_in_dim(cache.k_lbckh, row_k_ltbkh, at, axis=2),
        v_lbckh=jax.lax.dynamic_update_slice_in_dim(cache.v_lbckh, row_v_ltbkh, at, axis=2),
        pos_bc=jax.lax.dynamic_update_slice_in_dim(
            shared_view["pos_bc"], kv_cache.block_positions(positions_bt, segment_ids_bt),
            at, axis=1),
        ptr=(cache.ptr + 1) % blocks_total)
    return out, new_cache
