"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share `Phi3ForCausalLM`): Llama's block with
fused checkpoints: `self_attn.qkv_proj` holds the q, k and v rows in that order and
`mlp.gate_up_proj` the gate rows then the up rows; both are split at load. RoPE may rotate
only the first `partial_rotary_factor` of each head, and may be "longrope" (alias "su",
"yarn" as Phi3Config maps them): short factors for documents within
`original_max_position_embeddings`, long factors for longer ones, cos/sin scaled by the
attention factor. A sliding window, where given, applies to every layer."""

from __future__ import annotations

from actx.workers.model.families import base, hf_fields


def _options(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)
    base.refuse_biases(hf, refuse)
    window = hf.get("sliding_window")
    return {"sliding_windows": (None if window is None else int(window),) * num_layers,
            "rope": hf_fields.rope_from_hf(hf, refuse, partial_allowed=True, longrope=True,
                                    aliases={"su": "longrope", "yarn": "longrope"})}


def _tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg), **base.attention_tensors(cfg, fused_qkv=True),
            **base.mlp_tensors(cfg, fused_gate_up=True)}


PHI3 = base.Family(
    name="phi3", architectures=("Phi3ForCausalLM",),
    reads=("hidden_act", "sliding_window", "partial_rotary_factor",
           "rope_parameters/rope_scaling: longrope|su|yarn short_factor long_factor factor "
           "attention_factor original_max_position_embeddings"),
    options=_options, layer_tensors=_tensors,
    block=("x + attn(rms(x)); then + mlp(rms(.)); RMSNorm scales by w; SwiGLU MLP; fused "
           "qkv_proj and gate_up_proj split at load; partial rotary where configured"))
