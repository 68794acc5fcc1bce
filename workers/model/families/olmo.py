"""OLMo 2 and OLMoE (AllenAI). OLMo 2 norms after attention and after the MLP, not before
(x + rms(attn(x)), then + rms(mlp(.))), and RMSNorm over the whole q and k projections
(all heads together) before RoPE. OLMoE has Llama's pre-norms, the same whole-projection
q/k norms, and a mixture of experts in place of the MLP."""

from __future__ import annotations

from actx.workers.model.families import base, hf_fields


def _olmo2(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)
    base.refuse_biases(hf, refuse)
    return {"qk_norm_full": True, "input_norms": False, "post_norms": True,
            "norm_scale_fp32": True, "sliding_windows": (None,) * num_layers}


def _olmoe(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)
    base.refuse_biases(hf, refuse)
    if hf.get("clip_qkv") is not None:
        raise refuse("clip_qkv", hf["clip_qkv"], "clipping q/k/v is not implemented")
    return {"qk_norm_full": True, "sliding_windows": (None,) * num_layers,
            **hf_fields.moe_fields(hf, refuse, experts_field="num_experts",
                            width_field="intermediate_size",
                            norm_topk_prob=bool(hf.get("norm_topk_prob", False)))}


def _olmo2_tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg, pre=None, input_norm=False, post=True),
            **base.attention_tensors(cfg, qk_norm="full"), **base.mlp_tensors(cfg)}


def _olmoe_tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg), **base.attention_tensors(cfg, qk_norm="full"),
            **base.expert_tensors(cfg, router="mlp.gate", expert="mlp.experts.{e}")}


OLMO2 = base.Family(
    name="olmo2", architectures=("Olmo2ForCausalLM",),
    reads=("hidden_act", "attention_bias", "mlp_bias"),
    options=_olmo2, layer_tensors=_olmo2_tensors,
    block=("x + rms(attn(x)); then + rms(mlp(.)) (norms after, none before); RMSNorm over "
           "the whole q and k projections before RoPE; every RMSNorm scales by w in float32 "
           "and casts last; SwiGLU MLP"),
    hook_notes={"attn_out": "after post_attention_layernorm",
                "mlp_out": "after post_feedforward_layernorm"})
OLMOE = base.Family(
    name="olmoe", architectures=("OlmoeForCausalLM",),
    reads=("hidden_act", "attention_bias", "mlp_bias", "clip_qkv", "num_experts",
           "num_experts_per_tok", "norm_topk_prob"),
    options=_olmoe, layer_tensors=_olmoe_tensors,
    block=("x + attn(rms(x)); then + moe(rms(.)); RMSNorm over the whole q and k "
           "projections; router softmax in float32, top-k, renormalised when "
           "norm_topk_prob, weights cast to the compute dtype; SwiGLU experts"))
