"""Tiny random HF checkpoints made with transformers' own classes, for tests.

`make_tiny_checkpoint(path, arch)` writes config.json + safetensors with
`save_pretrained`, exactly as a real checkpoint looks; `load_hf_model(path)` reloads it
as the PyTorch float32 reference (eager attention). Stable API: other tests reuse it.

Archs: "qwen2" (tied embeddings, q/k/v bias, GQA), "qwen2_untied" (has lm_head.weight),
"llama3" (llama3 rope scaling, rope_theta 500000), "mistral" (sliding_window=None unless
overridden).
"""

from __future__ import annotations

import os

ARCHS = ("qwen2", "qwen2_untied", "llama3", "mistral")

# Tiny defaults: hidden 64, 3 layers, 4 heads of 16, 2 kv heads, vocab 512.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
               max_position_embeddings=4096, rms_norm_eps=1e-6)


def tiny_config(arch: str = "qwen2", **overrides):
    """The transformers config object for `arch`, with `overrides` applied."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    kwargs = dict(_COMMON)
    if arch in ("qwen2", "qwen2_untied"):
        kwargs.update(tie_word_embeddings=arch == "qwen2", rope_theta=10000.0)
        cls = transformers.Qwen2Config
    elif arch == "llama3":
        kwargs.update(
            tie_word_embeddings=False, rope_theta=500000.0,
            # Small original context so all three llama3 frequency bands occur at h=16.
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = transformers.LlamaConfig
    else:
        kwargs.update(tie_word_embeddings=False, sliding_window=None, rope_theta=10000.0)
        cls = transformers.MistralConfig
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_checkpoint(path: str | os.PathLike, arch: str = "qwen2", seed: int = 0,
                         dtype: str = "float32", max_shard_size: str | None = None,
                         **overrides) -> str:
    """Writes a random-init HF checkpoint of `arch` into directory `path`; returns path.

    seed: torch seed for the random weights. dtype: "float32" or "bfloat16" on disk.
    max_shard_size: e.g. "100KB" to get a sharded checkpoint with an index json.
    overrides: any config field, e.g. num_hidden_layers=2, sliding_window=8.
    """
    import torch
    import transformers

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        # Random (not init-default) norm weights, so a missed norm scale shows up.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return os.fspath(path)


def load_hf_model(path: str | os.PathLike):
    """The float32, eager-attention PyTorch model of checkpoint `path`, in eval mode."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_hooks(model, input_ids, position_ids=None, attention_mask=None) -> dict:
    """Every actx hook of `model` on `input_ids` ([b, t] int), as float32 numpy.

    attention_mask: [b, t] padding mask, or a prepared additive [b, 1, t, t] float mask
    (`band_mask`), which HF applies as is.

    Keys as actx names: embed, layers.{i}.{resid_pre,attn_out,resid_mid,mlp_out,
    resid_post}, final_norm. resid_post of the last layer is taken before the final norm
    (HF's hidden_states[-1] is after it and becomes final_norm).
    """
    import numpy as np
    import torch

    if attention_mask is not None and np.ndim(attention_mask) == 4:
        # A prepared 4D mask (HF uses it as is): additive float, 0 = attend.
        mask_tensor = torch.as_tensor(np.asarray(attention_mask, np.float32))
    elif attention_mask is not None:
        mask_tensor = torch.as_tensor(attention_mask, dtype=torch.long)
    else:
        mask_tensor = None
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(f"layers.{i}.attn_out", out[0])))
        handles.append(layer.mlp.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(f"layers.{i}.mlp_out", out)))
        handles.append(layer.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(
                f"layers.{i}.resid_post", out[0] if isinstance(out, tuple) else out)))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(input_ids, dtype=torch.long),
                        position_ids=None if position_ids is None
                        else torch.as_tensor(position_ids, dtype=torch.long),
                        attention_mask=mask_tensor,
                        output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    hidden = out.hidden_states
    num_layers = len(model.model.layers)
    result = {"embed": hidden[0], "final_norm": hidden[-1]}
    for i in range(num_layers):
        result[f"layers.{i}.resid_pre"] = hidden[i] if i == 0 else captured[
            f"layers.{i - 1}.resid_post"]
        for point in ("attn_out", "mlp_out", "resid_post"):
            result[f"layers.{i}.{point}"] = captured[f"layers.{i}.{point}"]
        result[f"layers.{i}.resid_mid"] = (result[f"layers.{i}.resid_pre"]
                                           + captured[f"layers.{i}.attn_out"])
    return {k: v.detach().float().numpy() for k, v in result.items()}


def band_mask(length: int, window: int | None):
    """Additive [1, 1, length, length] float mask: causal, and query p sees keys > p - window
    (every key before it when window is None): HF run with a sliding window."""
    import numpy as np

    q = np.arange(length)[:, None]
    k = np.arange(length)[None, :]
    allowed = (k <= q) & ((q - k < window) if window is not None else True)
    return np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[None, None]
