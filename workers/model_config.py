"""The decoder's frozen configuration, read from an HF `config.json`.

One dataclass covers the supported families (Qwen2/2.5, Llama 3.x, Mistral): they differ
only in q/k/v bias, RoPE frequency scaling and sliding-window attention. Anything else
a checkpoint asks for is refused here, naming the field, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding frequencies.

    theta: base wavelength (HF `rope_theta`).
    rope_type: "default", "linear" or "llama3".
    factor: frequency divisor for "linear" and "llama3".
    low_freq_factor, high_freq_factor, original_max_position_embeddings: "llama3" only.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] in float64, as HF computes them."""
        # float32 exponent like HF (torch.arange(...).float() / dim), then float64 maths.
        exponent = (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
        inv_freq = 1.0 / (self.theta ** exponent.astype(np.float64))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type != "llama3":
            return inv_freq
        old_context = self.original_max_position_embeddings
        low_freq_wavelen = old_context / self.low_freq_factor
        high_freq_wavelen = old_context / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = ((old_context / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a supported decoder.

    architecture: HF `architectures[0]`, e.g. "Qwen2ForCausalLM".
    num_layers: decoder blocks (HF `num_hidden_layers`).
    hidden_size: residual width d.
    vocab_size: rows of the embedding table.
    num_heads, num_kv_heads, head_dim: attention heads n, key/value heads k (GQA when
      k < n) and per-head width h.
    intermediate_size: MLP width f.
    rms_norm_eps: RMSNorm epsilon.
    rope: rotary embedding frequencies.
    qkv_bias: q/k/v projections have biases (Qwen2).
    tie_word_embeddings: the LM head reuses the embedding (only matters when loading:
      the LM head is never computed).
    sliding_windows: per layer, the attention window in tokens, or None for full causal.
    max_position_embeddings: the longest context the checkpoint declares (0: not given).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    max_position_embeddings: int = 0

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for "
                             f"{self.num_layers} layers")

    @property
    def window_per_layer(self) -> tuple[int | None, ...]:
        return self.sliding_windows or (None,) * self.num_layers

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Reads an HF config dict; raises ValueError naming any unsupported field."""
        architectures = hf.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architectures={architectures!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = architectures[0]

        def refuse(field: str, value: Any, why: str = "") -> ValueError:
            return ValueError(f"{source}: unsupported option {field}={value!r} for {arch}"
                              + (f" ({why})" if why else ""))

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise refuse("hidden_act", act, "only silu is implemented")
        for field in ("attention_bias", "mlp_bias"):
            if arch != "Qwen2ForCausalLM" and hf.get(field, False):
                raise refuse(field, hf[field], "biases on these projections are not implemented")

        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        return cls(
            architecture=arch,
            num_layers=num_layers,
            hidden_size=hidden,
            vocab_size=int(hf["vocab_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(hf, refuse),
            qkv_bias=arch == "Qwen2ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows_from_hf(hf, arch, num_layers, refuse),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 0),
        )


def _rope_from_hf(hf: Mapping[str, Any], refuse) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x wrote
    # top-level `rope_theta` and an optional `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    field = "rope_parameters"
    if not params and hf.get("rope_scaling"):
        params, field = dict(hf["rope_scaling"]), "rope_scaling"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise refuse(f"{field}.rope_type", rope_type,
                     f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise refuse("partial_rotary_factor", partial)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings",
                       hf.get("max_position_embeddings", 8192))))


def _sliding_windows_from_hf(hf: Mapping[str, Any], arch: str, num_layers: int,
                             refuse) -> tuple[int | None, ...]:
    """Per-layer window following HF: Mistral on every layer, Qwen2 per `layer_types`."""
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (None if window is None else int(window),) * num_layers
    if arch == "Qwen2ForCausalLM":
        if not hf.get("use_sliding_window", False):
            window = None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = int(hf.get("max_window_layers", num_layers))
            layer_types = ["sliding_attention" if window is not None and i >= first
                           else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise refuse("layer_types", layer_types, f"expected {num_layers} entries")
        windows = []
        for i, kind in enumerate(layer_types):
            if kind == "full_attention" or window is None:
                windows.append(None)
            elif kind == "sliding_attention":
                windows.append(int(window))
            else:
                raise refuse(f"layer_types[{i}]", kind)
        return tuple(windows)
    return (None,) * num_layers
