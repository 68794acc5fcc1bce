"""Mixtral: Mistral's attention (a sliding window on every layer where given) and a
mixture of experts under `block_sparse_moe` (w1 gate, w3 up, w2 down per expert): router
softmax in float32, top-k, always renormalised over the k, weights kept in float32."""

from __future__ import annotations

from actx.workers.model.families import base, hf_fields


def _options(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)
    base.refuse_biases(hf, refuse)
    window = hf.get("sliding_window")
    return {"sliding_windows": (None if window is None else int(window),) * num_layers,
            **hf_fields.moe_fields(hf, refuse, experts_field="num_local_experts",
                            width_field="intermediate_size", norm_topk_prob=True,
                            router_weights_fp32=True)}


def _tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg), **base.attention_tensors(cfg),
            **base.expert_tensors(cfg, router="block_sparse_moe.gate",
                                  expert="block_sparse_moe.experts.{e}",
                                  names=("w1", "w3", "w2"))}


MIXTRAL = base.Family(
    name="mixtral", architectures=("MixtralForCausalLM",),
    reads=("hidden_act", "sliding_window", "num_local_experts", "num_experts_per_tok"),
    options=_options, layer_tensors=_tensors,
    block=("x + attn(rms(x)); then + moe(rms(.)); router softmax in float32, top-k, "
           "renormalised, weights kept in float32; SwiGLU experts (w1 gate, w3 up, w2 down)"))
