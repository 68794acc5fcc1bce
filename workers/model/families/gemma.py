"""Gemma 2 and 3: embeddings scaled by sqrt(hidden), RMSNorm scaling by (1 + w) in
float32, norms before and after attention and the MLP, GeGLU, attention scale
query_pre_attn_scalar ** -0.5, local (sliding-window) and global layers; Gemma 2 soft-caps
attention logits, Gemma 3 norms each head's q/k and gives its local layers their own RoPE
base. Gemma 3's multimodal checkpoints are read for their text tower only."""

from __future__ import annotations

from actx.workers.model.families import base, hf_fields

_BLOCK = ("x + post_rms(attn(rms(x))); then + post_rms(geglu_mlp(rms(.))); RMSNorm scales "
          "by (1 + w) in float32; embeddings times sqrt(hidden)")
_NOTES = {"attn_out": "after post_attention_layernorm", "mlp_out": "after "
          "post_feedforward_layernorm", "embed": "after the sqrt(hidden) scale"}


def _options(hf, arch, refuse, num_layers, head_dim) -> dict:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise refuse("hidden_activation", act, "only gelu_pytorch_tanh is implemented")
    if hf.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", True,
                     "a bidirectional (embedding) model, not a causal decoder")
    base.refuse_biases(hf, refuse)
    layer_types = hf_fields.gemma_layer_types(hf, arch, num_layers)
    windows = hf_fields.windows_by_type(layer_types, hf.get("sliding_window"), num_layers, refuse)
    rope, local_rope = hf_fields.gemma_ropes_from_hf(hf, arch, refuse)
    # Gemma 3 has no attention soft-capping (its q/k norms bound the logits): HF's
    # Gemma3Attention never applies the config's attn_logit_softcapping, so neither do we.
    softcap = hf.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None
    return {
        "sliding_windows": windows, "rope": rope, "gemma_norms": True,
        "qk_norm": arch == "Gemma3ForCausalLM", "mlp_activation": "gelu_tanh",
        "query_scale": float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        "attn_logit_softcap": None if softcap is None else float(softcap),
        "local_rope": local_rope,
        "local_layers": () if local_rope is None else tuple(
            kind == "sliding_attention" for kind in layer_types),
        "tie_default": True,
    }


def _tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg, pre="pre_feedforward_layernorm.weight", post=True),
            **base.attention_tensors(cfg, qk_norm="head" if cfg.qk_norm else None),
            **base.mlp_tensors(cfg)}


_READS = ("hidden_activation", "use_bidirectional_attention", "sliding_window",
          "layer_types", "query_pre_attn_scalar", "attention_bias", "mlp_bias")
GEMMA2 = base.Family(
    name="gemma2", architectures=("Gemma2ForCausalLM",),
    reads=_READS + ("attn_logit_softcapping",),
    options=_options, layer_tensors=_tensors,
    block=_BLOCK + "; attention logits soft-capped; every other layer local", hook_notes=_NOTES)
GEMMA3 = base.Family(
    name="gemma3", architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    reads=_READS + ("sliding_window_pattern", "rope_local_base_freq",
                    "rope_parameters.full_attention/sliding_attention", "text_config"),
    options=_options, layer_tensors=_tensors,
    block=_BLOCK + "; RMSNorm over each head's q/k; local layers with their own RoPE base",
    hook_notes=_NOTES,
    text_tower={"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"})
