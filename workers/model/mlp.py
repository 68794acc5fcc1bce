"""A block's MLP as pure functions: the dense one (gated or not, with biases where the
family has them), the mixture of experts (`workers.model.moe`, plus Qwen2-MoE's shared
expert), and the choice between them per layer where a mixture has dense layers between
sparse ones (Qwen's mlp_only_layers, decoder_sparse_step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from actx.workers.model import moe
from actx.workers.model.config import ModelConfig


def activation(gate_btf: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The family's activation: gelu's tanh form, exact gelu, or silu."""
    if cfg.mlp_activation == "gelu_tanh":
        return jax.nn.gelu(gate_btf, approximate=True)  # HF's gelu_pytorch_tanh, gelu_new
    if cfg.mlp_activation == "gelu":
        return jax.nn.gelu(gate_btf, approximate=False)  # HF's gelu (erf)
    return jax.nn.silu(gate_btf)


def mlp(p, h_btd, cfg: ModelConfig, moe_impl: str, layer=0
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MLP's output, and the router's hook points for a mixture of experts (a dense
    layer between sparse ones gives zeros there, which no capture reads:
    `ModelConfig.router_layers`)."""
    if not cfg.num_experts:
        return dense(p, h_btd, cfg), {}
    if not cfg.mixed_mlps:
        return mixture(p, h_btd, cfg, moe_impl)

    def dense_layer(h_btd):
        b, t, _ = h_btd.shape
        k, e = cfg.experts_per_token, cfg.num_experts
        return dense(p, h_btd, cfg), {
            "router_logits": jnp.zeros((b, t, e), h_btd.dtype),
            "expert_ids": jnp.zeros((b, t, k), jnp.int32),
            "expert_weights": jnp.zeros((b, t, k), jnp.float32 if cfg.router_weights_fp32
                                        else h_btd.dtype)}

    is_moe = jnp.asarray(cfg.moe_per_layer)[layer]
    return jax.lax.cond(is_moe, lambda h: mixture(p, h, cfg, moe_impl), dense_layer, h_btd)


def mixture(p, h_btd, cfg: ModelConfig, moe_impl: str
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The routed experts' weighted sum (plus a shared expert where the family has one)
    and the router's hook points."""
    act = lambda x: activation(x, cfg)  # noqa: E731
    logits_bte, ids_btk, weights_btk = moe.route(h_btd, p["router_weight_led"], cfg,
                                                 p.get("router_bias_le"))
    glu = (moe.swiglu(act) if cfg.swiglu_limit is None
           else moe.clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit))
    out_btd = moe.experts(h_btd, ids_btk, weights_btk, p, glu, moe_impl)
    if cfg.shared_expert_size:
        # HF's Qwen2-MoE: sigmoid(x @ gate) * shared_expert(x), added after the routed sum.
        shared_btd = _swiglu(h_btd, p["shared_gate_ldf"], p["shared_up_ldf"],
                             p["shared_down_lfd"], act)
        gate_bt1 = jax.nn.sigmoid(jnp.einsum("btd,d->bt", h_btd,
                                             p["shared_expert_gate_ld"])[..., None])
        out_btd = out_btd + gate_bt1 * shared_btd
    return out_btd, {"router_logits": logits_bte, "expert_ids": ids_btk,
                     "expert_weights": weights_btk}


def dense(p, h_btd, cfg: ModelConfig) -> jax.Array:
    """The dense MLP: gate/up/down (SwiGLU, GeGLU) or up, activation, down (GPT-2,
    GPT-NeoX), with biases where `mlp_bias`."""
    up_btf = jnp.einsum("btd,df->btf", h_btd, p["up_weight_ldf"])
    if cfg.mlp_bias:
        up_btf = up_btf + p["up_bias_lf"]
    if cfg.gated_mlp:
        gate_btf = jnp.einsum("btd,df->btf", h_btd, p["gate_weight_ldf"])
        inner_btf = activation(gate_btf, cfg) * up_btf
    else:
        inner_btf = activation(up_btf, cfg)
    out_btd = jnp.einsum("btf,fd->btd", inner_btf, p["down_weight_lfd"])
    if cfg.mlp_bias:
        out_btd = out_btd + p["down_bias_ld"]
    return out_btd


def _swiglu(h_btd, gate_df, up_df, down_fd, act) -> jax.Array:
    gate_btf = jnp.einsum("btd,df->btf", h_btd, gate_df)
    up_btf = jnp.einsum("btd,df->btf", h_btd, up_df)
    return jnp.einsum("btf,fd->btd", act(gate_btf) * up_btf, down_fd)
