"""Llama 3.x and Mistral: pre-norm blocks (RMSNorm, weight w), no biases, SwiGLU MLP,
RoPE with "default", "linear" or "llama3" frequency scaling; Mistral adds one sliding
window on every layer."""

from __future__ import annotations

from actx.workers.model.families import base

_BLOCK = ("x + attn(rms(x)); then + mlp(rms(.)); RMSNorm scales by w; SwiGLU "
          "(silu(gate) * up) MLP; no biases (Llama's q/k/v/o where attention_bias)")


def tensors(cfg) -> dict[str, base.LayerTensor]:
    table = {**base.norm_tensors(cfg), **base.attention_tensors(cfg, bias=cfg.qkv_bias),
             **base.mlp_tensors(cfg)}
    if cfg.o_bias:
        table["o_bias_ld"] = base.LayerTensor("self_attn.o_proj.bias", (cfg.hidden_size,),
                                              ("embed",))
    return table


def _llama(hf, arch, refuse, num_layers, head_dim) -> dict:
    base.refuse_activation(hf, refuse)
    # LlamaAttention's q/k/v/o projections carry biases where attention_bias (checkpoints
    # converted to Llama's layout from models with them); the gated MLP's mlp_bias is not
    # implemented.
    base.refuse_biases(hf, refuse, fields=("mlp_bias",))
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "sliding_windows": (None,) * num_layers}


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

