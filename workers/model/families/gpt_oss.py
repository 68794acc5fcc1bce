"""gpt-oss (`GptOssForCausalLM`): Llama's pre-norm block with biases on q/k/v and the
output projection, a learned sink logit per head in every softmax (`self_attn.sinks`),
sliding-window and full layers by `layer_types`, YaRN RoPE, and a mixture of experts
on every layer: a router with a bias, whose k largest logits are softmaxed into the
weights, and experts with biases and the clamped SwiGLU ((clip(up, +-limit) + 1) * g *
sigmoid(alpha * g), g = min(gate, limit)). The experts are stored fused:
`mlp.experts.gate_up_proj` [e, d, 2f] (gate and up interleaved along the last axis) and
`mlp.experts.down_proj` [e, f, d], with their biases; the Hub checkpoints store the two
projections as MXFP4 (`quantization_config.quant_method: mxfp4`), dequantised at load."""

from __future__ import annotations

from actx.workers.model.families import base, hf_fields


# GptOssConfig's RoPE where the config gives none (its theta, 150,000, is hf_defaults').
# Only a missing (or null) rope_parameters takes it, as in GptOssConfig.__post_init__: an
# empty one ({}) is plain RoPE there, and here.
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def _options(hf, arch, refuse, num_layers, head_dim) -> dict:
    if hf.get("rope_parameters") is None and not hf.get("rope_scaling"):
        hf = {**hf, "rope_parameters": _DEFAULT_ROPE}
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is None:  # HF's default: even layers slide
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                       for i in range(num_layers)]
    if window is None and "sliding_attention" in layer_types:
        raise refuse("sliding_window", window, "layer_types names sliding layers")
    # Any other quantization_config is refused before the family reads the config
    # (`families.config_from_hf`, by `GPT_OSS.quantizations`).
    method = (hf.get("quantization_config") or {}).get("quant_method")
    limit = hf.get("swiglu_limit", 7.0)
    bias = bool(hf.get("attention_bias", True))
    # GptOssRMSNorm multiplies by its weight in float32 and casts last (every norm: the
    # block's two and the final one), unlike Llama's.
    return {"qkv_bias": bias, "o_bias": bias, "attention_sinks": True,
            "norm_scale_fp32": True,
            "sliding_windows": hf_fields.windows_by_type(layer_types, window, num_layers,
                                                         refuse),
            "rope": hf_fields.rope_from_hf(hf, refuse),
            "softmax_after_topk": True,
            "swiglu_limit": float(limit), "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "mxfp4_experts": method == "mxfp4",
            **hf_fields.moe_fields(hf, refuse, experts_field="num_local_experts",
                                   width_field="intermediate_size", norm_topk_prob=False)}


def _interleaved(hf: str, shape, part: int, packed: bool) -> base.LayerTensor:
    """Gate (part 0: even columns) or up (1: odd) of the fused [e, d, 2f] gate_up_proj;
    in an MXFP4 checkpoint, the same rows of its blocks and scales ([e, 2f, ...]), taken
    before they are dequantised."""
    axes = ("moe_experts", "embed", "moe_mlp")
    if packed:
        return base.LayerTensor(hf, shape, axes, mxfp4=True,
                                packed_part=lambda x: x[:, part::2])
    return base.LayerTensor(hf, shape, axes, lambda w: w[:, :, part::2])


def _tensors(cfg) -> dict[str, base.LayerTensor]:
    d, e, f, n = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_heads
    experts = "mlp.experts"
    packed = cfg.mxfp4_experts
    table = {**base.norm_tensors(cfg), **base.attention_tensors(cfg, bias=cfg.qkv_bias),
             "sinks_ln": base.LayerTensor("self_attn.sinks", (n,), ("heads",)),
             "router_weight_led": base.LayerTensor("mlp.router.weight", (e, d),
                                                   (None, "embed")),
             "router_bias_le": base.LayerTensor("mlp.router.bias", (e,), (None,)),
             "expert_gate_ledf": _interleaved(f"{experts}.gate_up_proj", (e, d, 2 * f), 0,
                                              packed),
             "expert_up_ledf": _interleaved(f"{experts}.gate_up_proj", (e, d, 2 * f), 1,
                                            packed),
             "expert_down_lefd": base.LayerTensor(
                 f"{experts}.down_proj", (e, f, d), ("moe_experts", "moe_mlp", "embed"),
                 mxfp4=packed),
             "expert_gate_bias_lef": base.LayerTensor(
                 f"{experts}.gate_up_proj_bias", (e, 2 * f), ("moe_experts", "moe_mlp"),
                 lambda b: b[:, 0::2]),
             "expert_up_bias_lef": base.LayerTensor(
                 f"{experts}.gate_up_proj_bias", (e, 2 * f), ("moe_experts", "moe_mlp"),
                 lambda b: b[:, 1::2]),
             "expert_down_bias_led": base.LayerTensor(
                 f"{experts}.down_proj_bias", (e, d), ("moe_experts", "embed"))}
    if cfg.o_bias:
        table["o_bias_ld"] = base.LayerTensor("self_attn.o_proj.bias", (d,), ("embed",))
    return table


GPT_OSS = base.Family(
    name="gpt_oss", architectures=("GptOssForCausalLM",),
    reads=("attention_bias", "sliding_window", "layer_types",
           "rope_parameters/rope_scaling: yarn factor beta_fast beta_slow truncate "
           "original_max_position_embeddings attention_factor mscale mscale_all_dim",
           "num_local_experts", "num_experts_per_tok", "swiglu_limit", "swiglu_alpha",
           "quantization_config.quant_method"),
    options=_options, layer_tensors=_tensors, quantizations=("mxfp4",),
    block=("x + attn(rms(x)); then + moe(rms(.)); RMSNorm scales by w in float32 and "
           "casts last; q/k/v/o biases; a learned sink logit "
           "per head in the softmax; sliding_window on the layer_types' sliding layers; "
           "YaRN RoPE; router logits = rms(.) @ router + bias, top-k of the logits, "
           "softmax over the k; experts with biases and the clamped SwiGLU (alpha, limit)"),
    hook_notes={"attn_out": "o_proj's output, its bias included",
                "expert_weights": "the softmax of the k chosen logits"})
