"""Llama 3.x and Mistral: pre-norm blocks (RMSNorm, weight w), no biases, SwiGLU MLP,
RoPE with "default", "linear" or "llama3" frequency scaling; Mistral adds one sliding
window on every layer."""

from __future__ import annotations

from actx.workers.model.families import base

_BLOCK = ("x + attn(rms(x)); then + mlp(rms(.)); RMSNorm scales by w; SwiGLU "
          "(silu(gate) * up) MLP; no biases")


def tensors(cfg) -> dict[str, base.LayerTensor]:
    return {**base.norm_tensors(cfg), **base.attention_tensors(cfg), **base.mlp_tensors(cfg)}


def _llama(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)
    base.refuse_biases(hf, refuse)
    return {"sliding_windows": (None,) * num_layers}


def _mistral(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)
    base.refuse_biases(hf, refuse)
    window = hf.get("sliding_window")
    return {"sliding_windows": (None if window is None else int(window),) * num_layers}


LLAMA = base.Family(
    name="llama", architectures=("LlamaForCausalLM",),
    reads=("hidden_act", "attention_bias", "mlp_bias", "rope_scaling.llama3/linear"),
    options=_llama, layer_tensors=tensors, block=_BLOCK)
MISTRAL = base.Family(
    name="mistral", architectures=("MistralForCausalLM",),
    reads=("hidden_act", "attention_bias", "mlp_bias", "sliding_window"),
    options=_mistral, layer_tensors=tensors, block=_BLOCK + "; sliding window on every layer")

