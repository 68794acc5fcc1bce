"""Qwen2/2.5 (q/k/v biases), Qwen3 (RMSNorm on each head's queries and keys before RoPE),
Qwen3-MoE (Qwen3's attention, a mixture of experts in place of the MLP, dense MLPs on
the layers mlp_only_layers and decoder_sparse_step leave) and Qwen2-MoE (Qwen2's
attention, the mixture plus a shared expert behind a sigmoid gate). Sliding
windows per `layer_types`, or from `use_sliding_window` and `max_window_layers`."""

from __future__ import annotations

from actx.workers.model.families import base, hf_fields

_BLOCK = ("x + attn(rms(x)); then + mlp(rms(.)); RMSNorm scales by w; SwiGLU MLP")
_MIXED_NOTES = {"router_logits": "only on the sparse layers: layers.*.router_logits (and "
                                 "experts) takes those; a dense layer's index is refused "
                                 "by name"}


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


def _moe_layers(hf, refuse, num_layers) -> tuple[bool, ...]:
    """Per layer, whether its MLP is the mixture (HF: not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0); the others are a dense MLP."""
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, (list, tuple)) or any(
            not isinstance(i, int) or not 0 <= i < num_layers for i in only):
        raise refuse("mlp_only_layers", only, f"layer indices 0..{num_layers - 1}")
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise refuse("decoder_sparse_step", step, "a whole number >= 1")
    return tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))


def _moe(hf, refuse, num_layers) -> dict:
    moe_layers = _moe_layers(hf, refuse, num_layers)
    return {**hf_fields.moe_fields(hf, refuse, experts_field="num_experts",
                                   width_field="moe_intermediate_size",
                                   norm_topk_prob=bool(hf.get("norm_topk_prob", False))),
            "moe_layers": moe_layers if not all(moe_layers) else ()}


def _qwen3_moe(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_biases(hf, refuse)
    # HF's Qwen3-MoE applies sliding_window (where use_sliding_window) to every layer.
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    return {"qk_norm": True, "mlp_activation": base.mlp_activation(hf, refuse),
            "sliding_windows": (None if window is None else int(window),) * num_layers,
            **_moe(hf, refuse, num_layers)}


def _qwen2_windows(hf, refuse, num_layers) -> tuple[int | None, ...]:
    """Qwen2-MoE's layer_types, or its config's own default: every other layer
    (even indices) below max_window_layers slides where use_sliding_window."""
    use = bool(hf.get("use_sliding_window", False))
    window = hf.get("sliding_window") if use else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = int(hf.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if use and (i + 1) % 2 and i < first
                       else "full_attention" for i in range(num_layers)]
    if window in (None, 0) and "sliding_attention" in layer_types:
        raise refuse("sliding_window", window, "layer_types names sliding layers")
    return hf_fields.windows_by_type(layer_types, window, num_layers, refuse)


def _qwen2_moe(hf, arch, refuse, num_layers, head_dim) -> dict:
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    if shared < 1:
        raise refuse("shared_expert_intermediate_size", hf.get(
            "shared_expert_intermediate_size"), "Qwen2-MoE's shared expert needs a width")
    return {"qkv_bias": bool(hf.get("qkv_bias", True)),
            "mlp_activation": base.mlp_activation(hf, refuse),
            "sliding_windows": _qwen2_windows(hf, refuse, num_layers),
            "shared_expert_size": shared, **_moe(hf, refuse, num_layers)}


def _tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg),
            **base.attention_tensors(cfg, bias=cfg.qkv_bias,
                                     qk_norm="head" if cfg.qk_norm else None),
            **base.mlp_tensors(cfg)}


def _moe_tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg),
            **base.attention_tensors(cfg, bias=cfg.qkv_bias,
                                     qk_norm="head" if cfg.qk_norm else None),
            **base.moe_layer_tensors(cfg, router="mlp.gate", expert="mlp.experts.{e}")}


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
    reads=("hidden_act", "attention_bias", "mlp_bias", "sliding_window",
           "use_sliding_window", "num_experts", "num_experts_per_tok",
           "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
           "decoder_sparse_step"),
    options=_qwen3_moe, layer_tensors=_moe_tensors,
    block=("Qwen3's attention (sliding_window on every layer where use_sliding_window); the "
           "MLP is a mixture of experts: router logits = rms(.) @ gate, softmax in float32, "
           "top-k, renormalised over the k when norm_topk_prob, weights cast to the "
           "compute dtype; output = sum of the chosen gated experts (hidden_act: silu, "
           "gelu, gelu_new) times their weights; "
           "a layer in mlp_only_layers, or whose i + 1 is no multiple of "
           "decoder_sparse_step, has a dense SwiGLU MLP of intermediate_size instead"),
    hook_notes=_MIXED_NOTES)
QWEN2_MOE = base.Family(
    name="qwen2_moe", architectures=("Qwen2MoeForCausalLM",),
    reads=("hidden_act", "qkv_bias", "sliding_window", "use_sliding_window",
           "max_window_layers", "layer_types", "num_experts", "num_experts_per_tok",
           "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
           "mlp_only_layers", "decoder_sparse_step"),
    options=_qwen2_moe, layer_tensors=_moe_tensors,
    block=("Qwen2's attention (q/k/v biases where qkv_bias; sliding windows per "
           "layer_types); the MLP is a mixture of experts routed as Qwen3-MoE's, plus a "
           "shared SwiGLU expert every token runs, scaled by sigmoid(rms(.) @ "
           "shared_expert_gate) and added to the routed sum; dense layers as Qwen3-MoE's"),
    hook_notes={**_MIXED_NOTES,
                "mlp_out": "routed experts' weighted sum + sigmoid(gate) * shared expert",
                "expert_ids": "the routed choice only (the shared expert is not routed: it "
                              "runs on every token)"})
