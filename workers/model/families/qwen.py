"""Qwen2/2.5 (q/k/v biases), Qwen3 (RMSNorm on each head's queries and keys before RoPE)
and Qwen3-MoE (Qwen3's attention, a mixture of experts in place of the MLP). Sliding
windows per `layer_types`, or from `use_sliding_window` and `max_window_layers`."""

from __future__ import annotations

from actx.workers.model.families import base, hf_fields

_BLOCK = ("x + attn(rms(x)); then + mlp(rms(.)); RMSNorm scales by w; SwiGLU MLP")


def _qwen_windows(hf, refuse, num_layers) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window", False):
        window = None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = int(hf.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if window is not None and i >= first
                       else "full_attention" for i in range(num_layers)]
    return hf_fields.windows_by_type(layer_types, window, num_layers, refuse)


def _qwen2(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)  # Qwen2's q/k/v always carry biases
    return {"qkv_bias": True, "sliding_windows": _qwen_windows(hf, refuse, num_layers)}


def _qwen3(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)
    base.refuse_biases(hf, refuse)
    return {"qk_norm": True, "sliding_windows": _qwen_windows(hf, refuse, num_layers)}


def _qwen3_moe(hf, arch, refuse, num_layers, head_dim) -> dict:
    options = _qwen3(hf, arch, refuse, num_layers, head_dim)
    if hf.get("mlp_only_layers"):
        raise refuse("mlp_only_layers", hf["mlp_only_layers"],
                     "dense layers between sparse ones are not implemented")
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        raise refuse("decoder_sparse_step", hf["decoder_sparse_step"],
                     "only every layer sparse (1) is implemented")
    return {**options, **hf_fields.moe_fields(hf, refuse, experts_field="num_experts",
                                       width_field="moe_intermediate_size",
                                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)))}


def _tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg),
            **base.attention_tensors(cfg, bias=cfg.qkv_bias,
                                     qk_norm="head" if cfg.qk_norm else None),
            **base.mlp_tensors(cfg)}


def _moe_tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg), **base.attention_tensors(cfg, qk_norm="head"),
            **base.expert_tensors(cfg, router="mlp.gate", expert="mlp.experts.{e}")}


QWEN2 = base.Family(
    name="qwen2", architectures=("Qwen2ForCausalLM",),
    reads=("hidden_act", "sliding_window", "use_sliding_window", "max_window_layers",
           "layer_types"),
    options=_qwen2, layer_tensors=_tensors, block=_BLOCK + "; q/k/v projections with biases")
QWEN3 = base.Family(
    name="qwen3", architectures=("Qwen3ForCausalLM",),
    reads=QWEN2.reads + ("attention_bias", "mlp_bias"),
    options=_qwen3, layer_tensors=_tensors,
    block=_BLOCK + "; RMSNorm over each head's queries and keys before RoPE")
QWEN3_MOE = base.Family(
    name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",),
    reads=QWEN3.reads + ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"),
    options=_qwen3_moe, layer_tensors=_moe_tensors,
    block=("Qwen3's attention; the MLP is a mixture of experts: router logits = rms(.) @ "
           "gate, softmax in float32, top-k, renormalised over the k when norm_topk_prob, "
           "weights cast to the compute dtype; output = sum of the chosen SwiGLU experts "
           "times their weights"))
