"""The decoder's frozen configuration, read from an HF `config.json`.

One dataclass covers the supported families: Qwen2/2.5, Llama 3.x and Mistral differ only
in q/k/v bias, RoPE frequency scaling and sliding-window attention; Qwen3 adds RMSNorm on
each head's queries and keys; Gemma 2 and 3 scale the embeddings by sqrt(hidden), norm
with (1 + w), wrap attention and the MLP in pre- and post-norms, use GeGLU, their own
attention scale (`query_pre_attn_scalar`), alternate local (sliding-window) and global
layers, and Gemma 2 soft-caps the attention logits while Gemma 3 norms q/k and gives its
local layers their own RoPE base. Anything else a checkpoint asks for is refused here,
naming the field, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                           "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                           "Gemma3ForConditionalGeneration")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM",
                       "Gemma3ForConditionalGeneration")
# Gemma 3's multimodal checkpoints: only the text tower (a Gemma3 text model) is read.
MULTIMODAL_TEXT_TOWER = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
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
    gemma_norms: Gemma's RMSNorm, (1 + w) applied in float32, and its post-attention,
      pre- and post-MLP norms; embeddings scaled by sqrt(hidden_size).
    qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3).
    mlp_activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    query_scale: the attention logits' scale (Gemma: query_pre_attn_scalar ** -0.5);
      None: head_dim ** -0.5.
    attn_logit_softcap: logits -> cap * tanh(logits / cap) (Gemma 2); None: none.
    local_rope: the RoPE of the local layers where it differs from `rope` (Gemma 3's
      local base); None: every layer uses `rope`.
    local_layers: per layer, whether it is a local ("sliding_attention") layer that takes
      `local_rope`; () where `local_rope` is None.
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
    gemma_norms: bool = False
    qk_norm: bool = False
    mlp_activation: str = "silu"
    query_scale: float | None = None
    attn_logit_softcap: float | None = None
    local_rope: RopeConfig | None = None
    local_layers: tuple[bool, ...] = ()

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

    @property
    def local_rope_per_layer(self) -> tuple[bool, ...]:
        """Per layer, whether it takes `local_rope` (a local layer of Gemma 3)."""
        if self.local_rope is None:
            return (False,) * self.num_layers
        return self.local_layers

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Reads an HF config dict; raises ValueError naming any unsupported field."""
        architectures = hf.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architectures={architectures!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = architectures[0]
        if arch in MULTIMODAL_TEXT_TOWER:
            # The language model's own config; the vision tower is never read.
            if not isinstance(hf.get("text_config"), Mapping):
                raise ValueError(f"{source}: {arch} without a text_config")
            hf = hf["text_config"]
            source = f"{source} (text_config)"
            arch = MULTIMODAL_TEXT_TOWER[arch]
        gemma = arch in GEMMA_ARCHITECTURES

        def refuse(field: str, value: Any, why: str = "") -> ValueError:
            return ValueError(f"{source}: unsupported option {field}={value!r} for {arch}"
                              + (f" ({why})" if why else ""))

        if gemma:
            act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
            if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
                raise refuse("hidden_activation", act, "only gelu_pytorch_tanh is implemented")
            if hf.get("use_bidirectional_attention"):
                raise refuse("use_bidirectional_attention", True,
                             "a bidirectional (embedding) model, not a causal decoder")
        else:
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
        windows = _sliding_windows_from_hf(hf, arch, num_layers, refuse)
        rope, local_rope = _ropes_from_hf(hf, arch, refuse)
        softcap = hf.get("attn_logit_softcapping") if gemma else None
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
            rope=rope,
            qkv_bias=arch == "Qwen2ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            sliding_windows=windows,
            max_position_embeddings=int(hf.get("max_position_embeddings") or 0),
            gemma_norms=gemma,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            mlp_activation="gelu_tanh" if gemma else "silu",
            query_scale=(float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5
                         if gemma else None),
            attn_logit_softcap=None if softcap is None else float(softcap),
            local_rope=local_rope,
            local_layers=() if local_rope is None else tuple(
                kind == "sliding_attention" for kind in _gemma_layer_types(hf, arch,
                                                                            num_layers)),
        )


def _ropes_from_hf(hf: Mapping[str, Any], arch: str, refuse
                   ) -> tuple[RopeConfig, RopeConfig | None]:
    """The global layers' RoPE, and Gemma 3's local layers' own (None elsewhere)."""
    if arch != "Gemma3ForCausalLM":
        return _rope_from_hf(hf, refuse), None
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        # transformers 5: one RoPE per layer type.
        full = {**hf, "rope_parameters": params.get("full_attention") or {},
                "rope_scaling": None}
        local = {**hf, "rope_parameters": params.get("sliding_attention") or {},
                 "rope_scaling": None}
        return _rope_from_hf(full, refuse), _rope_from_hf(local, refuse)
    # 4.x: rope_theta / rope_scaling for the global layers, rope_local_base_freq local.
    global_rope = _rope_from_hf({**hf, "rope_theta": hf.get("rope_theta", 1_000_000.0)},
                                refuse)
    local_theta = float(hf.get("rope_local_base_freq", 10_000.0))
    return global_rope, RopeConfig(theta=local_theta)


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
    if arch in GEMMA_ARCHITECTURES:
        return _windows_by_type(_gemma_layer_types(hf, arch, num_layers), window, num_layers,
                                refuse)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not hf.get("use_sliding_window", False):
            window = None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = int(hf.get("max_window_layers", num_layers))
            layer_types = ["sliding_attention" if window is not None and i >= first
                           else "full_attention" for i in range(num_layers)]
        return _windows_by_type(layer_types, window, num_layers, refuse)
    return (None,) * num_layers


def _gemma_layer_types(hf: Mapping[str, Any], arch: str, num_layers: int) -> list[str]:
    """Gemma 2: every other layer local (even indices); Gemma 3: every
    `sliding_window_pattern`-th layer global; transformers 5 writes `layer_types`."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    pattern = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]


def _windows_by_type(layer_types, window, num_layers: int, refuse) -> tuple[int | None, ...]:
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
